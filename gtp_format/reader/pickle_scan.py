"""Walk a pickle's opcode stream before the C unpickler sees it, to refuse memo bombs.

Why this exists: both readers of untrusted ``.metadata`` files (``--load`` here, and ``ckpt``)
want CPython's C unpickler, which is several times faster than the pure-Python ``pickle._Unpickler``
on a DCP metadata pickle (about 65 opcodes per chunk, millions of chunks in a large checkpoint).
An allow-listing ``find_class`` keeps it from calling anything we did not choose, but one hazard
sits below ``find_class``: the C unpickler stores its memo in an array and grows it to twice the
largest ``PUT``/``LONG_BINPUT`` index it meets, zero-filled, so an 11-byte pickle can make it
allocate tens of GiB (CPython issue gh-115952, fixed only in releases newer than ours).

:func:`check_pickle` therefore walks the stream exactly as the unpickler will (same opcode table,
same argument lengths, from the first byte to ``STOP``) and refuses

* any ``PUT``/``LONG_BINPUT`` index larger than its own position in the stream. A pickler assigns
  memo indices 0, 1, 2, ... and each assignment costs at least one byte, so a genuine index is
  always below its position; the bound caps the memo at 16 bytes per byte of input;
* any byte that is not an opcode, and any length that runs past the end of the data.

Everything else an opcode can size (strings, frames, long ints) is read from the in-memory buffer
the caller passes to the unpickler, which checks lengths against the bytes it really has.

Speed: the opcodes with no argument or a fixed-size one, and those with a one-byte length, are
matched by one compiled regular expression with a possessive repeat (3.11+; greedy on 3.10, see
``MANY``), so the walk runs in the ``re`` engine (about a third of the C unpickle's own time) and
drops to Python only for the rare opcodes whose argument is a newline-terminated text or a 4- or
8-byte length.
"""

from __future__ import annotations

import re
import struct
import sys

_ZERO_ARG = b"\x94\x85\x86\x87()}]\x81Rbeu0N\x88\x89atl\x8f\x90\x91\x93\x92do12sQ\x97\x98"
_ARG1 = b"hKq\x80\x82"  # BINGET, BININT1, BINPUT (index < 256: harmless), PROTO, EXT1
_ARG2 = b"M\x83"  # BININT2, EXT2
_ARG4 = b"jJ\x84"  # LONG_BINGET, BININT, EXT4 (LONG_BINPUT is checked in Python)
_ARG8 = b"\x95G"  # FRAME (its length counts bytes that follow as ordinary opcodes), BINFLOAT
_LEN1 = b"\x8cCU\x8a"  # SHORT_BINUNICODE, SHORT_BINBYTES, SHORT_BINSTRING, LONG1: 1-byte length


def _charset(ops: bytes) -> bytes:
    return b"[" + b"".join(re.escape(bytes([o])) for o in ops) + b"]"


def _len1_payload() -> bytes:
    return b"(?:" + b"|".join(re.escape(bytes([n])) + (b".{%d}" % n if n else b"") for n in range(256)) + b")"


# Possessive repeats (``++``, ``*+``) arrived in Python 3.11. On 3.10 the same pattern with greedy
# repeats matches exactly the same text, because nothing follows the outer repeat: the engine
# stops at the first opcode no branch matches and never backtracks. It still records every
# backtracking position it will never use, though: 700 MiB and 4.5x the time for a 37 MB pickle
# on 3.10 when matched in one call. So the walk matches in windows of WINDOW bytes (below), which
# bounds that record on 3.10 and costs nothing measurable on 3.11+.
MANY, _ANY = (b"++", b"*+") if sys.version_info >= (3, 11) else (b"+", b"*")
WINDOW = 1 << 16
_LONGEST = 2 + 255  # the longest opcode the expression matches: a 1-byte length and its payload
_RUN = re.compile(
    b"(?:" + b"|".join([
        _charset(_ZERO_ARG) + MANY,  # a run of them in one tight loop of the engine: 40% faster overall
        _charset(_ARG4) + b".{4}",
        _charset(_ARG1) + b".",
        _charset(_LEN1) + _len1_payload(),
        _charset(_ARG2) + b".{2}",
        _charset(_ARG8) + b".{8}",
    ]) + b")" + _ANY,
    re.DOTALL,
)

_STOP = ord(".")
_LONG_BINPUT = ord("r")
_PUT = ord("p")
_LEN4 = {ord(c): 4 for c in "XTB\x8b"}  # BINUNICODE, BINSTRING, BINBYTES, LONG4
_LEN8 = {ord(c): 8 for c in "\x8d\x8e\x96"}  # BINUNICODE8, BINBYTES8, BYTEARRAY8
_TEXT_LINES = {ord(c): 1 for c in "ILFSVgP"} | {ord("c"): 2, ord("i"): 2}  # newline-terminated arguments


class PickleScanError(ValueError):
    """The stream is not a pickle the unpickler may be given; the message says where and why."""


def check_pickle(data: bytes | bytearray) -> int:
    """Walk ``data`` like the unpickler and return the position of its ``STOP`` opcode.

    Raises :class:`PickleScanError` for a memo index beyond its position, an unknown opcode,
    or an argument that runs past the end.
    """
    end = len(data)
    pos = 0
    while True:
        pos = _run_end(data, pos, end)
        if pos >= end:
            raise PickleScanError(f"the pickle ends at byte {end} without a STOP opcode (truncated?)")
        op = data[pos]
        if op == _STOP:
            return pos
        if op == _LONG_BINPUT:
            if pos + 5 > end:
                raise PickleScanError(f"LONG_BINPUT at byte {pos} is cut off by the end of the data")
            index = struct.unpack_from("<I", data, pos + 1)[0]
            _check_memo_index(index, pos)
            pos += 5
        elif op in _LEN4 or op in _LEN8:
            width = _LEN4.get(op) or _LEN8[op]
            if pos + 1 + width > end:
                raise PickleScanError(f"opcode {op:#04x} at byte {pos} is cut off by the end of the data")
            length = int.from_bytes(data[pos + 1:pos + 1 + width], "little", signed=op == ord("\x8b"))
            if length < 0 or pos + 1 + width + length > end:
                raise PickleScanError(f"opcode {op:#04x} at byte {pos} declares {length} bytes, past the end "
                                      f"of the {end}-byte data")
            pos += 1 + width + length
        elif op == _PUT or op in _TEXT_LINES:
            start = pos + 1
            for _ in range(_TEXT_LINES.get(op, 1)):
                newline = data.find(b"\n", start)
                if newline < 0:
                    raise PickleScanError(f"opcode {chr(op)!r} at byte {pos} has no newline-terminated argument")
                if op == _PUT:
                    text = data[start:newline]
                    if not (text.isdigit() and len(text) <= 19):
                        raise PickleScanError(f"PUT at byte {pos} has the index {bytes(text[:24])!r}, not a "
                                              "decimal memo index")
                    _check_memo_index(int(text), pos)
                start = newline + 1
            pos = start
        else:
            raise PickleScanError(f"byte {pos} holds {op:#04x}, which is not a pickle opcode")


def _run_end(data: bytes | bytearray, pos: int, end: int) -> int:
    """Where the run of regular-expression opcodes that starts at ``pos`` ends, matched window by window.

    A match that stops more than :data:`_LONGEST` bytes before its window's end stopped at an
    opcode the expression does not take; one that stops closer may have been cut by the window,
    so matching resumes there (it always advances: a window is longer than any opcode).
    """
    match = _RUN.match
    while True:
        stop = min(end, pos + WINDOW)
        reached = match(data, pos, stop).end()
        if stop == end or reached < stop - _LONGEST:
            return reached
        pos = reached


def _check_memo_index(index: int, pos: int) -> None:
    if index > pos:
        raise PickleScanError(f"memo index {index} at byte {pos} is larger than any pickler could have "
                              "assigned by then (a memo bomb: the C unpickler would allocate for it)")
