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
import threading

from gtp_format.reader.pickle_scan import MANY, PickleScanError

MAX_DEPTH = 32  # genuine DCP metadata nests 9 deep (Metadata > dict > record > dict > list > chunk > dict > tuple)

# action codes
ATOM, NOP, EMPTY, MARK, COLLECT, _WRAP1, _WRAP2, WRAP3, APPEND, SETITEM, EXTEND, CALL2, CALL3, \
    GLOBAL2, BUILD, POP, POPMARK, DUP, PUT, MEMOIZE, GET, _PERSID, BINPERSID, STOP, GLOBAL = range(25)
IS_GLOBAL = -1  # the "depth" of a global on the replayed stack: BUILD or item assignment on it is refused
# argument kinds (> 0: that many bytes)
_LINE, _LINES2, LEN1, LEN4, LEN8 = -1, -2, -3, -4, -8


def _table() -> list[tuple[int, int] | None]:
    t: list[tuple[int, int] | None] = [None] * 256

    def add(ops: str, arg: int, act: int) -> None:
        for o in ops:
            t[ord(o)] = (arg, act)

    add("N\x88\x89\x97", 0, ATOM)
    add("K", 1, ATOM)
    add("M", 2, ATOM)
    add("J", 4, ATOM)
    add("\x82", 1, GLOBAL)  # EXT1/2/4: a global through copyreg's registry
    add("\x83", 2, GLOBAL)
    add("\x84", 4, GLOBAL)
    add("G", 8, ATOM)
    add("\x8cCU\x8a", LEN1, ATOM)
    add("XTB\x8b", LEN4, ATOM)
    add("\x8d\x8e\x96", LEN8, ATOM)
    add("ILFSV", _LINE, ATOM)
    add("c", _LINES2, GLOBAL)
    add("\x98", 0, NOP)
    add("\x80", 1, NOP)
    add("\x95", 8, NOP)
    add(")]}\x8f", 0, EMPTY)
    add("(", 0, MARK)
    add("tld\x91o", 0, COLLECT)
    add("i", _LINES2, COLLECT)
    add("\x85", 0, _WRAP1)
    add("\x86", 0, _WRAP2)
    add("\x87", 0, WRAP3)
    add("a", 0, APPEND)
    add("s", 0, SETITEM)
    add("eu\x90", 0, EXTEND)
    add("R\x81", 0, CALL2)
    add("\x92", 0, CALL3)
    add("\x93", 0, GLOBAL2)
    add("b", 0, BUILD)
    add("0", 0, POP)
    add("1", 0, POPMARK)
    add("2", 0, DUP)
    add("p", _LINE, PUT)
    add("q", 1, PUT)
    add("r", 4, PUT)
    add("\x94", 0, MEMOIZE)
    add("g", _LINE, GET)
    add("h", 1, GET)
    add("j", 4, GET)
    add("P", _LINE, _PERSID)
    add("Q", 0, BINPERSID)
    add(".", 0, STOP)
    return t


TABLE = _table()


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
    table = TABLE
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
            elif arg == LEN1:
                argpos, pos = pos, pos + 1 + data[pos]
            elif arg == LEN4:
                argpos, pos = pos, pos + 4 + int.from_bytes(data[pos:pos + 4], "little", signed=op == 0x8B)
            elif arg == LEN8:
                argpos, pos = pos, pos + 8 + int.from_bytes(data[pos:pos + 8], "little")
            else:
                argpos = pos
                for _ in range(-arg):
                    pos = data.index(b"\n", pos) + 1
            if act == MEMOIZE:  # the most frequent opcode first
                if dense:
                    memo.append(stack[-1])  # type: ignore[union-attr]
                else:
                    memo[len(memo)] = stack[-1]
                continue
            if act == PUT:
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
            if act == GET:
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
            if act == ATOM:
                stack.append(0)
                continue
            if act == MARK:
                marks.append(len(stack))
                continue
            if act == GLOBAL:
                stack.append(IS_GLOBAL)
                continue
            if act == EMPTY:
                stack.append(1)
            elif act <= WRAP3:  # COLLECT, _WRAP1..3: items replaced by one container around them
                start = marks.pop() if act == COLLECT else len(stack) - (act - COLLECT)
                if start < 0:
                    raise IndexError
                depth = 1 + max(stack[start:], default=0)
                del stack[start:]
                stack.append(depth)
            elif act == APPEND or act == BUILD:
                item = stack.pop() + 1
                if stack[-1] == IS_GLOBAL:
                    _refuse_global_change(act, pos)
                if fragment and act == BUILD and len(stack) == fragment and not marks:
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
            elif act == SETITEM:
                depth = max(stack.pop(), stack.pop()) + 1
                if stack[-1] == IS_GLOBAL:
                    _refuse_global_change(act, pos)
                stack[-1] = max(stack[-1], depth)
            elif act == EXTEND:
                start = marks.pop()
                depth = 1 + max(stack[start:], default=0)
                del stack[start:]
                if stack[-1] == IS_GLOBAL:
                    _refuse_global_change(act, pos)
                stack[-1] = max(stack[-1], depth)
            elif act == CALL2 or act == CALL3 or act == GLOBAL2:
                n = 2 if act != CALL3 else 3
                if len(stack) < n:
                    raise IndexError
                depth = 1 + max(stack[-n:]) if act != GLOBAL2 else IS_GLOBAL
                del stack[-n:]
                stack.append(depth)
            elif act == POP:
                stack.pop()
                continue
            elif act == POPMARK:
                del stack[marks.pop():]
                continue
            elif act == DUP:
                stack.append(stack[-1])
                continue
            elif act == _PERSID:
                stack.append(1)
            elif act == BINPERSID:
                stack[-1] = 1
            elif act == STOP:
                return -1, built
            else:  # NOP
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
            pos += 1 + TABLE[op][0]  # type: ignore[index]
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
        if TABLE[op] is None or TABLE[op][0] != 0 or op in (0x2E, 0x95, 0x80):  # type: ignore[index]
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
    done = _known_run(data, start, end, stack, memo, built, limit, max_depth)
    if done is not None:
        return done
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
        first = None
        if pats[1].groups:
            # each record of the run copies entries that existed before it, of the depths the first one copied
            first = _copies(pats[1].match(data, start), memo, n0)
            keep = first is not None and all(_copies(r, memo, n0) == first for r in set(rows))
        more = len(rows) if keep else 0
        if count + (count - built) * more > limit:  # the replay reports the exact byte where the count runs over
            more, keep = 0, False
    stack.extend(scratch)
    if more:
        if pats[1].groups and first is not None:
            _remember(max_depth, pats, first, scratch, made, count - built)  # type: ignore[arg-type]
        stack.extend(scratch * more)
        memo.extend(made * more)
        return run.end(), count + (count - built) * more, keep  # type: ignore[union-attr]
    return pos, count, keep


# What a unit of a run did to the replay's state, by shape: the next run of the same shape starts with a
# match instead of replaying its first unit and building its expression again. A DCP file of 100 chunks
# per key has a run per key (and per key's storage entries): 26,000 runs at a million chunks, and the
# first unit's replay and expression were most of the fast path's time (check_shape of 1M chunks: about
# half its CPU). The effect of a unit (the depths it pushes and memoizes, the containers it counts)
# depends only on its opcodes and on the depths of the memo entries it copies, so a run whose units
# match the shape and copy entries of the same depths has the same effect per unit, with the same
# checks passed (depths within ``max_depth``: each remembered effect is kept per ``max_depth``).
_Known = tuple[tuple[re.Pattern[bytes], re.Pattern[bytes]], tuple[int, ...], list[int], list[int], int]
_KNOWN_MAX = 8


def _remember(max_depth: int, pats: tuple[re.Pattern[bytes], re.Pattern[bytes]], copies: tuple[int, ...],
              pushed: list[int], made: list[int], counted: int) -> None:
    _COMPILED.remember(max_depth, (pats, copies, list(pushed), list(made), counted))


def _known_run(data: bytes | bytearray, start: int, end: int, stack: list[int], memo: list[int], built: int,
               limit: int, max_depth: int) -> tuple[int, int, bool] | None:
    """The run at ``start`` replayed by a remembered unit's effect (see above), or ``None``: nothing changed."""
    known = _COMPILED.known(max_depth)
    if not known:
        return None
    below = len(memo)
    for pats, copies, pushed, made, counted in known:
        run = pats[0].match(data, start, end)
        if run is None:
            continue
        rows = pats[1].findall(data, start, run.end())
        n = len(rows)
        if not all(_copies(r, memo, below) == copies for r in set(rows)) or built + counted * n > limit:
            return None  # the unit-by-unit path decides (and reports the exact byte of an error)
        stack.extend(pushed * n)
        memo.extend(made * n)
        return run.end(), built + counted * n, True
    return None


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


class _Compiled:
    """The compiled expressions by shape, how often each shape not yet compiled was seen, and the remembered
    effects of runs (above).

    Shared by every thread that walks a pickle (byte objects' pickles are walked on a pool), so each
    read-and-update runs under one lock: the count of a shape was read, then deleted, by two threads at
    once, and the second ``del`` raised ``KeyError``, which the replay reported as a malformed pickle.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._shapes: dict[bytes, tuple[re.Pattern[bytes], re.Pattern[bytes]]] = {}
        self._seen: dict[bytes, int] = {}
        self._known: dict[int, tuple[_Known, ...]] = {}  # remembered unit effects by max_depth, newest first

    def known(self, max_depth: int) -> tuple[_Known, ...]:
        return self._known.get(max_depth, ())  # a tuple, replaced whole under the lock: a consistent snapshot

    def forget_runs(self) -> None:
        with self._lock:
            self._known.clear()

    def remember(self, max_depth: int, entry: _Known) -> None:
        with self._lock:
            known = self._known.get(max_depth, ())
            if not any(k[0] is entry[0] and k[1] == entry[1] for k in known):
                self._known[max_depth] = (entry, *known)[:_KNOWN_MAX]

    def get(self, shape: bytes) -> tuple[re.Pattern[bytes], re.Pattern[bytes]] | None:
        with self._lock:
            pats = self._shapes.get(shape)
            if pats is not None:
                return pats
            seen = self._seen.get(shape, 0) + 1
            if seen < _COMPILE_AFTER:
                if len(self._seen) > 4096:
                    self._seen.clear()
                self._seen[shape] = seen
                return None
            self._seen.pop(shape, None)
        pats = (re.compile(b"(?:" + shape + b")" + MANY, re.DOTALL), re.compile(shape, re.DOTALL))  # outside the lock
        with self._lock:
            if len(self._shapes) > 256:
                self._shapes.clear()
            return self._shapes.setdefault(shape, pats)


_COMPILED = _Compiled()


def _patterns(shape: bytes) -> tuple[re.Pattern[bytes], re.Pattern[bytes]] | None:
    """The compiled run of ``shape`` (one or more, possessive) and ``shape`` alone (to count the run).

    ``None`` until ``shape`` has been seen :data:`_COMPILE_AFTER` times: compiling costs several
    milliseconds, as much as replaying a hundred records, and in small checkpoints most shapes (a
    record with a key name of a new length) come back once or twice at most.
    """
    return _COMPILED.get(shape)


def _refuse_global_change(act: int, pos: int) -> None:
    what = "BUILD (setstate)" if act == BUILD else "item assignment"
    raise PickleScanError(f"the pickle applies {what} to a global at byte {pos}: allow-listed globals (dtypes, "
                          "layouts, record classes) are shared by the whole process and never modified")
