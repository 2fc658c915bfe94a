"""Both pre-walks of a large pickle in one compiled pass, as a filter in front of them.

Why: :func:`~gtp_format.reader.pickle_scan.check_pickle` (memo indices, opcodes, argument lengths) and
:func:`~gtp_format.reader.pickle_shape.check_shape` (nesting depth, container count, no change to a
global) walk every opcode of a DCP ``.metadata`` before the C unpickler may see it: about 65 opcodes
per chunk. In Python, with their regular-expression shortcuts, they took 2.6 of the 8.3 CPU seconds
of opening a 1M-chunk file (the 2-core machine), a third of ``inspect``. Here the same rules run as
one loop compiled by numba (already a dependency, for the chunk statistics).

:func:`passes` answers only "accepted": it returns ``True`` where both walks would accept ``data``
with their default limits, and ``False`` for anything else: a refusal, and every case it leaves to
them (text-argument opcodes such as ``GLOBAL``/``PUT``/``GET`` by line, a memo index past the end,
a length over 4 GiB). The caller then runs the two walks themselves, so each refusal is reported by
them, with the same message at the same byte as before. The loop is the opcode-by-opcode replay of
``check_shape`` (its reference, which its fast path is tested against) with ``check_pickle``'s
rules added, over one table of binary opcodes that both walks agree on (checked when the table is
built); tests/format/test_pickle_walk.py checks it against both walks on genuine, mutated and
hostile pickles.

Only for pickles of at least :data:`MIN_BYTES`, and only where numba imports: numba's import and its
cached code cost about 0.6 s and 110 MB of RSS per process (measured on the 16-core H100 host), where
the two Python walks take about 25 ns a byte (3.5 CPU s for a 139 MB, 1M-chunk file) and the loop 2: it
pays from about 26 MB. The loop is cached on disk (:func:`gtp_format.reader.jit.njit_cached`, which finds a
writable folder where numba's own choices are read-only); the first process on a machine compiles it (1.6 s
there).
"""

from __future__ import annotations

from functools import cache
from typing import Any

import numpy as np

from gtp_format.reader import pickle_scan as scan
from gtp_format.reader import pickle_shape as shape

MIN_BYTES = 32 << 20  # about 230,000 DCP chunks
STACK_CAP = 1 << 20  # items on the replayed stack (genuine DCP metadata: a few thousand, SETITEMS batches)
MARK_CAP = 1 << 12  # open marks (genuine: one per nesting level)

# argument kinds in the table below (> 0: that many bytes; as pickle_shape)
_LEN1, _LEN4, _LEN8, _TEXT, _BAD = shape.LEN1, shape.LEN4, shape.LEN8, -100, -101


def _tables() -> tuple[np.ndarray, np.ndarray]:
    """Argument kind and action per byte: the binary opcodes both walks take, with the same widths."""
    widths: dict[int, int] = {}
    for ops, width in ((scan.ZERO_ARG, 0), (scan.ARG1, 1), (scan.ARG2, 2), (scan.ARG4, 4), (scan.ARG8, 8),
                       (scan.LEN1, _LEN1), (b"r", 4), (b".", 0)):
        widths.update(dict.fromkeys(ops, width))
    widths.update(dict.fromkeys(scan.LEN4, _LEN4))
    widths.update(dict.fromkeys(scan.LEN8, _LEN8))
    text = set(scan.TEXT_LINES) | {scan.PUT}
    arg = np.full(256, _BAD, np.int64)
    act = np.full(256, -1, np.int64)
    for op in range(256):
        entry = shape.TABLE[op]
        if op in text and entry is not None:
            arg[op], act[op] = _TEXT, entry[1]
        elif op in widths and entry is not None:
            if entry[0] != widths[op]:
                raise AssertionError(f"the pickle walks disagree on opcode {op:#04x}'s argument")
            arg[op], act[op] = widths[op], entry[1]
        elif (op in widths) != (entry is not None):
            raise AssertionError(f"the pickle walks disagree on whether {op:#04x} is an opcode")
    return arg, act


_ARG, _ACT = _tables()
# the actions, as module constants (numba freezes globals into the compiled loop; a closure would not be cached)
_ATOM, _NOP, _EMPTY, _MARK, _COLLECT, _WRAP3 = shape.ATOM, shape.NOP, shape.EMPTY, shape.MARK, shape.COLLECT, \
    shape.WRAP3
_APPEND, _SETITEM, _EXTEND, _CALL2, _CALL3, _GLOBAL2 = shape.APPEND, shape.SETITEM, shape.EXTEND, shape.CALL2, \
    shape.CALL3, shape.GLOBAL2
_BUILD, _POP, _POPMARK, _DUP, _PUT, _MEMOIZE, _GET = shape.BUILD, shape.POP, shape.POPMARK, shape.DUP, \
    shape.PUT, shape.MEMOIZE, shape.GET
_BINPERSID, _STOP, _GLOBAL, _IS_GLOBAL = shape.BINPERSID, shape.STOP, shape.GLOBAL, shape.IS_GLOBAL


def walk(data: np.ndarray, arg_of: np.ndarray, act_of: np.ndarray, max_depth: int, limit: int) -> bool:
    """The loop (numba compiles it; tests also run it as Python): ``True`` only where both walks accept."""
    n = data.size
    # Fixed arrays, never regrown: a loop that reassigns an array runs 25x slower under numba (reference counts
    # in the loop). Depths are at most max_depth (else the walk refuses at once) or -1 (a global): the memo
    # holds them in bytes, one per memo operation at most (each is an opcode byte), its pages touched as used.
    stack = np.empty(STACK_CAP, np.int64)
    marks = np.empty(MARK_CAP, np.int64)
    memo = np.empty(n + 1, np.int8)
    sp = 0
    mp = 0
    mlen = 0
    built = 0
    pos = 0
    while pos < n:
        op = data[pos]
        arg = arg_of[op]
        act = act_of[op]
        at = pos
        pos += 1
        argpos = pos
        if arg > 0:
            pos += arg
        elif arg == _LEN1:
            if pos >= n:
                return False
            pos += 1 + np.int64(data[pos])
        elif arg == _LEN4:
            if pos + 4 > n:
                return False
            length = np.int64(data[pos]) | np.int64(data[pos + 1]) << 8 | np.int64(data[pos + 2]) << 16 \
                | np.int64(data[pos + 3]) << 24
            if op == 0x8B and length >= 1 << 31:  # LONG4's signed length: negative is refused
                return False
            pos += 4 + length
        elif arg == _LEN8:
            if pos + 8 > n:
                return False
            for k in range(4, 8):
                if data[pos + k] != 0:
                    return False  # 4 GiB or more: left to the walks
            length = np.int64(data[pos]) | np.int64(data[pos + 1]) << 8 | np.int64(data[pos + 2]) << 16 \
                | np.int64(data[pos + 3]) << 24
            pos += 8 + length
        elif arg != 0:
            return False  # not an opcode, or one whose argument is a line of text: the walks decide
        if pos > n:
            return False
        if sp + 1 >= STACK_CAP or mp + 1 >= MARK_CAP:
            return False  # deeper than any DCP pickle: left to the walks
        if act == _MEMOIZE:
            if sp == 0:
                return False
            memo[mlen] = stack[sp - 1]
            mlen += 1
            continue
        if act == _PUT or act == _GET:
            if arg == 1:
                index = np.int64(data[argpos])
            else:
                index = np.int64(data[argpos]) | np.int64(data[argpos + 1]) << 8 \
                    | np.int64(data[argpos + 2]) << 16 | np.int64(data[argpos + 3]) << 24
            if act == _PUT:
                if op == 0x72 and index > at:  # LONG_BINPUT beyond its position: a memo bomb
                    return False
                if sp == 0 or index > mlen:  # an index past the end: the walks keep a dict then
                    return False
                memo[index] = stack[sp - 1]
                if index == mlen:
                    mlen += 1
                continue
            if index >= mlen:
                return False
            stack[sp] = memo[index]
            sp += 1
            continue
        if act == _ATOM:
            stack[sp] = 0
            sp += 1
            continue
        if act == _MARK:
            marks[mp] = sp
            mp += 1
            continue
        if act == _GLOBAL:
            stack[sp] = _IS_GLOBAL
            sp += 1
            continue
        if act == _NOP:
            continue
        if act == _STOP:
            return True
        if act == _EMPTY:
            stack[sp] = 1
            sp += 1
        elif act <= _WRAP3:  # COLLECT, WRAP1..3: the items from a mark (or the last 1..3) in one container
            if act == _COLLECT:
                if mp == 0:
                    return False
                mp -= 1
                start = marks[mp]
            else:
                start = sp - (act - _COLLECT)
                if start < 0:
                    return False
            depth = 1
            if start < sp:
                top = stack[start]
                for k in range(start + 1, sp):
                    if stack[k] > top:
                        top = stack[k]
                depth = 1 + top
            if depth > max_depth:
                return False
            sp = min(sp, start)
            stack[sp] = depth
            sp += 1
        elif act == _APPEND or act == _BUILD:
            if sp < 2:
                return False
            sp -= 1
            item = stack[sp] + 1
            if stack[sp - 1] == _IS_GLOBAL:
                return False
            if item > stack[sp - 1]:
                stack[sp - 1] = item
                if item > max_depth:
                    return False
            continue
        elif act == _SETITEM:
            if sp < 3:
                return False
            depth = max(stack[sp - 1], stack[sp - 2]) + 1
            if depth > max_depth:
                return False
            sp -= 2
            if stack[sp - 1] == _IS_GLOBAL:
                return False
            stack[sp - 1] = max(stack[sp - 1], depth)
        elif act == _EXTEND:
            if mp == 0:
                return False
            mp -= 1
            start = marks[mp]
            depth = 1
            if start < sp:
                top = stack[start]
                for k in range(start + 1, sp):
                    if stack[k] > top:
                        top = stack[k]
                depth = 1 + top
            sp = min(sp, start)
            if sp == 0 or stack[sp - 1] == _IS_GLOBAL or depth > max_depth:
                return False
            stack[sp - 1] = max(stack[sp - 1], depth)
        elif act == _CALL2 or act == _CALL3 or act == _GLOBAL2:
            k = 3 if act == _CALL3 else 2
            if sp < k:
                return False
            if act == _GLOBAL2:
                depth = _IS_GLOBAL
            else:
                top = stack[sp - k]
                for j in range(sp - k + 1, sp):
                    if stack[j] > top:
                        top = stack[j]
                depth = 1 + top
                if depth > max_depth:
                    return False
            sp -= k
            stack[sp] = depth
            sp += 1
        elif act == _POP:
            if sp == 0:
                return False
            sp -= 1
            continue
        elif act == _POPMARK:
            if mp == 0:
                return False
            mp -= 1
            sp = min(sp, marks[mp])
            continue
        elif act == _DUP:
            if sp == 0:
                return False
            stack[sp] = stack[sp - 1]
            sp += 1
            continue
        elif act == _BINPERSID:
            if sp == 0:
                return False
            stack[sp - 1] = 1
        else:
            return False  # PERSID (a text argument) or anything not listed: the walks decide
        built += 1
        if built > limit or stack[sp - 1] > max_depth:
            return False
    return False  # no STOP


@cache
def _compiled() -> Any:
    """The loop compiled by numba (cached on disk where it can be: :func:`gtp_format.reader.jit.njit_cached`), or
    ``None`` where numba is missing."""
    try:
        import numba  # noqa: F401
    except ImportError:
        return None
    from gtp_format.reader.jit import njit_cached

    return njit_cached(walk, nogil=True)


def passes(data: bytes | bytearray, max_depth: int = shape.MAX_DEPTH) -> bool:
    """``True`` where both pre-walks would accept ``data`` with their default limits; ``False`` means ask them
    (a refusal, something this loop leaves to them, a small pickle, or no numba)."""
    if len(data) < MIN_BYTES or not 0 < max_depth < 127:  # the memo keeps depths in bytes
        return False
    compiled = _compiled()
    if compiled is None:
        return False
    return bool(compiled(np.frombuffer(data, np.uint8), _ARG, _ACT, max_depth, 16 + len(data) // 4))
