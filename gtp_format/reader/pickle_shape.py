"""Bound the shape of what a pickle builds (nesting depth, container count) before it is built.

Why a second walk besides :func:`gtp_format.reader.pickle_scan.check_pickle`: the C unpickler
builds whatever nesting the opcodes ask for, and some of CPython's C code recurses over that
nesting without any recursion guard. Hashing a tuple is one: a dict key that is a million tuples
deep (``EMPTY_TUPLE`` then ``TUPLE1`` a million times, ``SETITEM``; 1 MB) segfaults the unpickler
itself, measured on CPython 3.11, before any reader code could look at it. Small, many objects
are the other hazard: an empty list costs one opcode byte but 56 bytes of memory, so a file of
empty containers is a 60x memory amplifier.

:func:`check_shape` therefore replays the opcode stream on a stack of *depths* (an int per stack
item, never the objects) and refuses a pickle that would build an object nested deeper than
``max_depth`` or more containers than ``max_containers``. Depths are exact for tuples (they are
immutable, their depth is fixed when built: the only objects whose hashing recurses) and for
everything reachable from the stack; a list mutated after it was memoized can be undercounted,
which is harmless because lists are unhashable and Python-level recursion raises
``RecursionError``, which the readers turn into a one-line error.

The same replay refuses ``BUILD`` (``__setstate__`` or ``__dict__`` update) and item assignment
whose target is a global itself (``GLOBAL``, ``STACK_GLOBAL``, ``EXT*``, or a memo copy of one):
the allow-listed globals (dtype entries, layout and memory-format constants, record classes,
helper functions) are shared by the whole process, and a crafted ``BUILD`` on ``torch.float32``
set its ``itemsize`` for every later read. Genuine pickles only ever ``BUILD`` fresh instances.

Cost: one Python-level step per opcode. A DCP ``.metadata`` has about 65 opcodes per chunk; see
docs/performance.md for what this adds to ``inspect``.
"""

from __future__ import annotations

from gtp_format.reader.pickle_scan import PickleScanError

MAX_DEPTH = 32  # genuine DCP metadata nests 9 deep (Metadata > dict > record > dict > list > chunk > dict > tuple)

# action codes
_ATOM, _NOP, _EMPTY, _MARK, _COLLECT, _WRAP1, _WRAP2, _WRAP3, _APPEND, _SETITEM, _EXTEND, _CALL2, _CALL3, \
    _GLOBAL2, _BUILD, _POP, _POPMARK, _DUP, _PUT, _MEMOIZE, _GET, _PERSID, _BINPERSID, _STOP, _GLOBAL = range(25)
_IS_GLOBAL = -1  # the "depth" of a global on the replayed stack: BUILD or item assignment on it is refused
# argument kinds (> 0: that many bytes)
_LINE, _LINES2, _LEN1, _LEN4, _LEN8 = -1, -2, -3, -4, -8


def _table() -> list[tuple[int, int] | None]:
    t: list[tuple[int, int] | None] = [None] * 256

    def add(ops: str, arg: int, act: int) -> None:
        for o in ops:
            t[ord(o)] = (arg, act)

    add("N\x88\x89\x97", 0, _ATOM)
    add("K", 1, _ATOM)
    add("M", 2, _ATOM)
    add("J", 4, _ATOM)
    add("\x82", 1, _GLOBAL)  # EXT1/2/4: a global through copyreg's registry
    add("\x83", 2, _GLOBAL)
    add("\x84", 4, _GLOBAL)
    add("G", 8, _ATOM)
    add("\x8cCU\x8a", _LEN1, _ATOM)
    add("XTB\x8b", _LEN4, _ATOM)
    add("\x8d\x8e\x96", _LEN8, _ATOM)
    add("ILFSV", _LINE, _ATOM)
    add("c", _LINES2, _GLOBAL)
    add("\x98", 0, _NOP)
    add("\x80", 1, _NOP)
    add("\x95", 8, _NOP)
    add(")]}\x8f", 0, _EMPTY)
    add("(", 0, _MARK)
    add("tld\x91o", 0, _COLLECT)
    add("i", _LINES2, _COLLECT)
    add("\x85", 0, _WRAP1)
    add("\x86", 0, _WRAP2)
    add("\x87", 0, _WRAP3)
    add("a", 0, _APPEND)
    add("s", 0, _SETITEM)
    add("eu\x90", 0, _EXTEND)
    add("R\x81", 0, _CALL2)
    add("\x92", 0, _CALL3)
    add("\x93", 0, _GLOBAL2)
    add("b", 0, _BUILD)
    add("0", 0, _POP)
    add("1", 0, _POPMARK)
    add("2", 0, _DUP)
    add("p", _LINE, _PUT)
    add("q", 1, _PUT)
    add("r", 4, _PUT)
    add("\x94", 0, _MEMOIZE)
    add("g", _LINE, _GET)
    add("h", 1, _GET)
    add("j", 4, _GET)
    add("P", _LINE, _PERSID)
    add("Q", 0, _BINPERSID)
    add(".", 0, _STOP)
    return t


_TABLE = _table()


def check_shape(data: bytes | bytearray, max_depth: int = MAX_DEPTH, max_containers: int | None = None) -> None:
    """Refuse a pickle whose objects nest deeper than ``max_depth`` or that builds more than
    ``max_containers`` containers and objects (default: 16 plus a quarter of its length in bytes).

    ``data`` must already have passed :func:`~gtp_format.reader.pickle_scan.check_pickle`
    (arguments in bounds, a ``STOP``); errors here are :class:`PickleScanError` too.
    """
    limit = 16 + len(data) // 4 if max_containers is None else max_containers
    table = _TABLE
    end = len(data)
    stack: list[int] = []
    marks: list[int] = []
    memo: dict[int, int] = {}
    built = 0
    pos = 0
    try:
        while pos < end:
            op = data[pos]
            arg, act = table[op]  # type: ignore[misc]  # None: not an opcode (check_pickle refused it)
            pos += 1
            if arg > 0:
                argpos, pos = pos, pos + arg
            elif arg == 0:
                argpos = pos
            elif arg == _LEN1:
                argpos, pos = pos, pos + 1 + data[pos]
            elif arg == _LEN4:
                argpos, pos = pos, pos + 4 + int.from_bytes(data[pos:pos + 4], "little", signed=op == 0x8B)
            elif arg == _LEN8:
                argpos, pos = pos, pos + 8 + int.from_bytes(data[pos:pos + 8], "little")
            else:
                argpos = pos
                for _ in range(-arg):
                    pos = data.index(b"\n", pos) + 1
            if act == _PUT or act == _MEMOIZE:  # the most frequent opcodes first
                if act == _MEMOIZE:
                    index = len(memo)
                elif arg == 1:
                    index = data[argpos]
                elif arg == 4:
                    index = int.from_bytes(data[argpos:argpos + 4], "little")
                else:
                    index = int(data[argpos:pos - 1])
                memo[index] = stack[-1]
                continue
            if act == _GET:
                if arg == 1:
                    index = data[argpos]
                elif arg == 4:
                    index = int.from_bytes(data[argpos:argpos + 4], "little")
                else:
                    index = int(data[argpos:pos - 1])
                stack.append(memo[index])
                continue
            if act == _ATOM:
                stack.append(0)
                continue
            if act == _MARK:
                marks.append(len(stack))
                continue
            if act == _GLOBAL:
                stack.append(_IS_GLOBAL)
                continue
            if act == _EMPTY:
                stack.append(1)
            elif act <= _WRAP3:  # _COLLECT, _WRAP1..3: items replaced by one container around them
                start = marks.pop() if act == _COLLECT else len(stack) - (act - _COLLECT)
                if start < 0:
                    raise IndexError
                depth = 1 + max(stack[start:], default=0)
                del stack[start:]
                stack.append(depth)
            elif act == _APPEND or act == _BUILD:
                item = stack.pop() + 1
                if stack[-1] == _IS_GLOBAL:
                    _refuse_global_change(act, pos)
                if item > stack[-1]:
                    stack[-1] = item
                    if item > max_depth:
                        built -= 1  # not a new container: only the depth is checked below
                    else:
                        continue
                else:
                    continue
            elif act == _SETITEM:
                depth = max(stack.pop(), stack.pop()) + 1
                if stack[-1] == _IS_GLOBAL:
                    _refuse_global_change(act, pos)
                stack[-1] = max(stack[-1], depth)
            elif act == _EXTEND:
                start = marks.pop()
                depth = 1 + max(stack[start:], default=0)
                del stack[start:]
                if stack[-1] == _IS_GLOBAL:
                    _refuse_global_change(act, pos)
                stack[-1] = max(stack[-1], depth)
            elif act == _CALL2 or act == _CALL3 or act == _GLOBAL2:
                n = 2 if act != _CALL3 else 3
                if len(stack) < n:
                    raise IndexError
                depth = 1 + max(stack[-n:]) if act != _GLOBAL2 else _IS_GLOBAL
                del stack[-n:]
                stack.append(depth)
            elif act == _POP:
                stack.pop()
                continue
            elif act == _POPMARK:
                del stack[marks.pop():]
                continue
            elif act == _DUP:
                stack.append(stack[-1])
                continue
            elif act == _PERSID:
                stack.append(1)
            elif act == _BINPERSID:
                stack[-1] = 1
            elif act == _STOP:
                return
            else:  # _NOP
                continue
            built += 1
            if built > limit or stack[-1] > max_depth:
                what = f"more than {limit} containers" if built > limit else f"objects nested {stack[-1]} deep"
                raise PickleScanError(f"the pickle builds {what} by byte {pos} (at most {max_depth} levels and one "
                                      f"container per 4 bytes are accepted)")
    except PickleScanError:
        raise
    except (IndexError, KeyError, ValueError):
        raise PickleScanError(f"the opcode at byte {pos} takes more from the stack, mark stack or memo than the "
                              "pickle put there") from None
    raise PickleScanError("the pickle ends without a STOP opcode")


def _refuse_global_change(act: int, pos: int) -> None:
    what = "BUILD (setstate)" if act == _BUILD else "item assignment"
    raise PickleScanError(f"the pickle applies {what} to a global at byte {pos}: allow-listed globals (dtypes, "
                          "layouts, record classes) are shared by the whole process and never modified")
