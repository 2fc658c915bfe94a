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

Cost: one Python-level step per opcode made ``inspect`` of a large ``.metadata`` (about 65
opcodes per chunk) four to six times slower. A DCP file is mostly runs of records of one shape
(a chunk, an index key and its storage info, repeated per chunk), so the replay takes each run at
once (see "the fast path" below): the first record opcode by opcode, the rest as one regular
expression match and arithmetic. On a 100,000-chunk file this replays about 105,000 of 6.5 M
opcodes in Python, and gives the same verdict (depths, memo, counts, the same error at the same
byte) as the opcode-by-opcode replay, which tests/format/test_pickle_shape.py checks. What it
costs against main: docs/performance.md.
"""

from __future__ import annotations

import re

from gtp_format.reader.pickle_scan import MANY, PickleScanError

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


def check_shape(data: bytes | bytearray, max_depth: int = MAX_DEPTH, max_containers: int | None = None,
                fast: bool = True) -> None:
    """Refuse a pickle whose objects nest deeper than ``max_depth`` or that builds more than
    ``max_containers`` containers and objects (default: 16 plus a quarter of its length in bytes).

    ``data`` must already have passed :func:`~gtp_format.reader.pickle_scan.check_pickle`
    (arguments in bounds, a ``STOP``); errors here are :class:`PickleScanError` too. ``fast=False``
    replays every opcode one by one (the reference the fast path is tested against).
    """
    limit = 16 + len(data) // 4 if max_containers is None else max_containers
    _replay(data, 0, len(data), [], [], [], 0, limit, max_depth, fast, 0)


def _replay(data: bytes | bytearray, pos: int, end: int, stack: list[int], marks: list[int],
            memo: list[int] | dict[int, int],
            built: int, limit: int, max_depth: int, fast: bool, fragment: int) -> tuple[int, int]:
    """Replay opcodes from ``pos`` to ``STOP`` (returns ``(-1, built)``) on ``stack``/``marks``/``memo``.

    With ``fragment`` > 0 it stops after the first ``BUILD`` that leaves ``fragment`` items and no
    mark on ``stack`` (returns that position), and refuses PUT (it must not overwrite a memo entry):
    :func:`_fast_run` replays the first records of a run this way.
    """
    table = _TABLE
    first = pos
    dense = isinstance(memo, list)  # memo keys are 0..len-1 (no PUT beyond the end): a list, MEMOIZE appends
    try:
        while pos < end:
            op_start = pos
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
            if act == _MEMOIZE:  # the most frequent opcode first
                if dense:
                    memo.append(stack[-1])  # type: ignore[union-attr]
                else:
                    memo[len(memo)] = stack[-1]
                continue
            if act == _PUT:
                if fragment:
                    raise PickleScanError("PUT in a fast-path record")
                if arg == 1:
                    index = data[argpos]
                elif arg == 4:
                    index = int.from_bytes(data[argpos:argpos + 4], "little")
                else:
                    index = int(data[argpos:pos - 1])
                if dense and index >= len(memo):
                    if index == len(memo):
                        memo.append(stack[-1])  # type: ignore[union-attr]
                        continue
                    memo = dict(enumerate(memo))  # a PUT past the end: keys are no longer 0..len-1
                    dense = False
                memo[index] = stack[-1]
                continue
            if act == _GET:
                if arg == 1:
                    index = data[argpos]
                elif arg == 4:
                    index = int.from_bytes(data[argpos:argpos + 4], "little")
                else:
                    index = int(data[argpos:pos - 1])
                    if index < 0:
                        raise KeyError(index)
                if (fast or fragment) and dense and data.startswith(_RECORD_HEAD, pos):
                    if fragment:
                        if op_start != first:  # the runs that repeat are the innermost records
                            raise PickleScanError("a record within the record")
                    else:
                        done = _fast_run(data, op_start, end, stack, memo, built, limit, max_depth)
                        if done is not None:
                            pos, built, fast = done
                            continue
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
                if fragment and act == _BUILD and len(stack) == fragment and not marks:
                    if item > stack[-1]:
                        stack[-1] = item
                    if item <= max_depth:
                        return pos, built
                    built -= 1
                elif item > stack[-1]:
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
                return -1, built
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


# -- the fast path: runs of records of one shape ----------------------------------------------------
#
# A DCP ``.metadata`` is ~65 opcodes per chunk in a few record shapes repeated for every chunk:
# ``GET cls, EMPTY_TUPLE, NEWOBJ, MEMOIZE, EMPTY_DICT, MEMOIZE, MARK, key/value pairs, SETITEMS,
# BUILD``, whose values are memo copies, atoms or ``torch.Size(ints)`` calls. Replaying each opcode
# in Python made ``inspect`` several times slower. What a record does to the replay's state (one
# item of some depth pushed, some depths memoized, some containers counted) depends only on its
# opcodes and on the depths of the memo entries it copies, never on the values of its atoms
# (ints, strings, None, booleans: depth 0 whatever they hold). So the first record of a run is
# replayed opcode by opcode (:func:`_replay` with ``fragment``), the same opcodes with the same
# memo copies and any atoms are matched after it by one regular expression (in ``re``'s engine),
# and the run's effect is that first record's effect times the run's length: the same checks,
# by arithmetic. Anything else (a record that copies a memo entry it made itself, a PUT, a frame
# boundary) ends the run, and the opcode-by-opcode replay goes on.

_RECORD_HEAD = b")\x81"  # after ``GET cls``: EMPTY_TUPLE, NEWOBJ
_MAX_RECORD = 4096  # bytes of one record the fast path looks at
_INT_OPS = {ord(c) for c in "KMJ"}
_LEN1_ATOMS = {ord(c) for c in "\x8a\x8cC"}  # LONG1, SHORT_BINUNICODE, SHORT_BINBYTES
_INT = b"(?:K.|M..|J....)"  # BININT1, BININT2, BININT: any value, any of the three widths
_GET_GROUP = b"(h.|j....)"
_SHAPES: dict[bytes, tuple[re.Pattern[bytes], re.Pattern[bytes]]] = {}
_SEEN: dict[bytes, int] = {}
_COMPILE_AFTER = 8


def _shape(data: bytes | bytearray, start: int, stop: int, memo_len: int) -> bytes | None:
    """A regular expression for records with the opcodes of ``data[start:stop]``, any ints, strings of
    the same lengths, and a group for each memo copy (checked after the match: :func:`_same_copies`).

    ``None`` when the record copies a memo entry it made itself (index ``memo_len`` or more) or has
    an opcode the fast path leaves to the replay.
    """
    out = []
    pos = start
    while pos < stop:
        op = data[pos]
        if op in _INT_OPS:
            pos += 1 + _TABLE[op][0]  # type: ignore[index]
            out.append(_INT)
            continue
        if op in _LEN1_ATOMS:  # any bytes of the same length
            n = data[pos + 1]
            out.append(re.escape(bytes(data[pos:pos + 2])) + (b".{%d}" % n if n else b""))
            pos += 2 + n
            continue
        if op == 0x68 or op == 0x6A:  # BINGET, LONG_BINGET: which entry is checked after the match
            width = 1 if op == 0x68 else 4
            if int.from_bytes(data[pos + 1:pos + 1 + width], "little") >= memo_len:
                return None
            out.append(_GET_GROUP)
            pos += 1 + width
            continue
        if _TABLE[op] is None or _TABLE[op][0] != 0 or op in (0x2E, 0x95, 0x80):  # type: ignore[index]
            return None  # an opcode with an argument not handled above, STOP, FRAME, PROTO
        out.append(re.escape(bytes([op])))
        pos += 1
    return b"".join(out)


def _fast_run(data: bytes | bytearray, start: int, end: int, stack: list[int], memo: list[int], built: int,
              limit: int, max_depth: int) -> tuple[int, int, bool] | None:
    """Replay the run of same-shaped records at ``start`` (a ``GET cls`` before EMPTY_TUPLE, NEWOBJ).

    The unit that repeats is one record, or two that alternate (DCP's storage index: a
    ``MetadataIndex`` key, then its ``_StorageInfo``). Returns ``(position after the run,
    containers counted, keep the fast path on)``, or ``None`` (nothing changed) when the first
    record is not one the fast path takes; the caller then replays it opcode by opcode, which
    raises whatever error it holds at its exact byte.
    """
    n0 = len(memo)
    scratch: list[int] = []
    unit: list[bytes] = []
    made: list[int] = []  # depths the unit memoizes, in order
    pos, count, run = start, built, None
    for records in (1, 2):
        try:
            stop, after = _replay(data, pos, min(end, pos + _MAX_RECORD), scratch, [], memo, count, limit,
                                  max_depth, False, records)
        except PickleScanError:
            stop = -1
        shape = _shape(data, pos, stop, n0) if stop > 0 and len(scratch) == records else None
        if shape is None:  # undo this record's MEMOIZEs and pushes: the caller replays it again
            del memo[n0 + len(made):]
            del scratch[len(unit):]
            break
        unit.append(shape)
        pos, count = stop, after
        made = memo[n0:]
        pats = _patterns(b"".join(unit))  # None the first time a shape is seen: most never repeat
        run = pats[0].match(data, pos, end) if pats is not None else None
        if run is not None or records == 2 or not _record_at(data, pos):
            break
        run = None
    if not unit:
        return None
    more, keep = 0, True
    if run is not None:
        rows = pats[1].findall(data, pos, run.end())
        if pats[1].groups:
            # each record of the run copies entries that existed before it, of the depths the first one copied
            first = _copies(pats[1].match(data, start), memo, n0)
            keep = first is not None and all(_copies(r, memo, n0) == first for r in set(rows))
        more = len(rows) if keep else 0
        if count + (count - built) * more > limit:  # the replay reports the exact byte where the count runs over
            more, keep = 0, False
    stack.extend(scratch)
    if more:
        stack.extend(scratch * more)
        memo.extend(made * more)
        return run.end(), count + (count - built) * more, keep  # type: ignore[union-attr]
    return pos, count, keep


def _copies(row: object, memo: list[int], below: int) -> tuple[int, ...] | None:
    """Depths of the memo entries one matched record copies (``row``: its groups, a match or a
    ``findall`` row); ``None`` if one is missing or at ``below`` or later (made within the run)."""
    if row is None:
        return None
    if isinstance(row, re.Match):
        row = row.groups()
    if isinstance(row, bytes):
        row = (row,)
    out = []
    for g in row:  # type: ignore[union-attr]
        i = g[1] if len(g) == 2 else int.from_bytes(g[1:5], "little")
        if i >= below:
            return None
        out.append(memo[i])
    return tuple(out)


def _record_at(data: bytes | bytearray, pos: int) -> bool:
    """A record starts at ``pos``: BINGET or LONG_BINGET (its class), then EMPTY_TUPLE, NEWOBJ."""
    op = data[pos] if pos < len(data) else 0
    return (op == 0x68 or op == 0x6A) and data.startswith(_RECORD_HEAD, pos + (2 if op == 0x68 else 5))


def _patterns(shape: bytes) -> tuple[re.Pattern[bytes], re.Pattern[bytes]] | None:
    """The compiled run of ``shape`` (one or more, possessive) and ``shape`` alone (to count the run).

    ``None`` until ``shape`` has been seen :data:`_COMPILE_AFTER` times: compiling costs several
    milliseconds, as much as replaying a hundred records, and in small checkpoints most shapes (a
    record with a key name of a new length) come back once or twice at most.
    """
    pats = _SHAPES.get(shape)
    if pats is None:
        seen = _SEEN.get(shape, 0) + 1
        if seen < _COMPILE_AFTER:
            if len(_SEEN) > 4096:
                _SEEN.clear()
            _SEEN[shape] = seen
            return None
        del _SEEN[shape]
        if len(_SHAPES) > 256:
            _SHAPES.clear()
        pats = _SHAPES[shape] = (re.compile(b"(?:" + shape + b")" + MANY, re.DOTALL), re.compile(shape, re.DOTALL))
    return pats


def _refuse_global_change(act: int, pos: int) -> None:
    what = "BUILD (setstate)" if act == _BUILD else "item assignment"
    raise PickleScanError(f"the pickle applies {what} to a global at byte {pos}: allow-listed globals (dtypes, "
                          "layouts, record classes) are shared by the whole process and never modified")
