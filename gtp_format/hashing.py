"""File checksums keyed by algorithm name, computed in 8 MiB blocks; CRC arithmetic (shift, combine).

The manifest records ``files: {relative_path: {"size": n, "<algorithm>": "<hex>"}}``. Which
algorithm the writer picks is its business, so the verifier looks algorithms up by name here and
reports names it does not know instead of failing. Streaming keeps memory flat on multi-GB files.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import threading
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, BinaryIO, Protocol

import google_crc32c
import numpy as np

BLOCK = 8 << 20


class Hasher(Protocol):
    def update(self, data: bytes, /) -> None: ...

    def hexdigest(self) -> str: ...


class _CrcHasher:
    """A :class:`Crc` behind the hashlib interface; hex is 8 lowercase digits."""

    def __init__(self, crc: Crc) -> None:
        self._update, self._crc = crc.update, 0

    def update(self, data: bytes, /) -> None:
        self._crc = self._update(data, self._crc)

    def hexdigest(self) -> str:
        return f"{self._crc:08x}"


HASHERS: dict[str, Callable[[], Hasher]] = {
    "sha256": hashlib.sha256,
    "crc32": lambda: _CrcHasher(CRCS["crc32"]),
    "crc32c": lambda: _CrcHasher(CRCS["crc32c"]),
}


def file_digests(f: BinaryIO, algorithms: list[str]) -> dict[str, str]:
    """Hex digests of an open file for each known algorithm, reading it once."""
    hashers = {a: HASHERS[a]() for a in algorithms}
    while block := f.read(BLOCK):
        for h in hashers.values():
            h.update(block)
    return {a: h.hexdigest() for a, h in hashers.items()}


def gf2_times(mat: list[int], vec: int) -> int:
    out, i = 0, 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec >>= 1
        i += 1
    return out


def gf2_square(mat: list[int]) -> list[int]:
    return [gf2_times(mat, mat[n]) for n in range(32)]


@dataclass(frozen=True)
class Crc:
    """A reflected 32-bit CRC with all-ones init and final XOR (CRC-32 and CRC-32C are both).

    ``update(data, crc)`` continues a running value; :meth:`shift` and :meth:`combine` are the
    GF(2) arithmetic that joins CRCs of pieces hashed separately (zlib's ``crc32_combine``,
    generalised to the polynomial), which is what lets the windows of one file be hashed on
    several threads at once.
    """

    name: str
    poly: int  # reflected polynomial
    update: Callable[[Any, int], int]

    def shift(self, nbytes: int) -> list[int]:
        """GF(2) operator taking the CRC of ``A`` to the register after ``nbytes`` more bytes.

        ``crc(A + B) == gf2_times(shift(len(B)), crc(A)) ^ crc(B)``; the operator is kept so that
        appending the same blob again costs 32 XORs.
        """
        return [self._advance(1 << n, nbytes) for n in range(32)]  # the image of each basis bit

    def combine(self, crc_a: int, crc_b: int, len_b: int) -> int:
        """CRC of ``A + B`` from ``crc(A)``, ``crc(B)`` and ``len(B)``: one operator per set bit (microseconds)."""
        return self._advance(crc_a, len_b) ^ crc_b

    def zeros(self, crc: int, nbytes: int) -> int:
        """``update(bytes(nbytes), crc)`` without the bytes: the CRC of ``nbytes`` zero bytes (the register from
        all ones, inverted) combined onto ``crc``; microseconds where hashing 64 MiB of zeros takes milliseconds."""
        return self.combine(crc, self._advance(0xFFFFFFFF, nbytes) ^ 0xFFFFFFFF, nbytes)

    def _advance(self, crc: int, nbytes: int) -> int:
        """The register ``crc`` after ``nbytes`` zero bytes: the operator for each set bit of ``nbytes``."""
        k = 0
        while nbytes:
            if nbytes & 1:
                crc = gf2_times(self._pow2(k), crc)
            nbytes >>= 1
            k += 1
        return crc

    def _pow2(self, k: int) -> list[int]:
        """The operator for ``2**k`` zero bytes, built once per polynomial (whole before it is published: a
        thread never sees a table another is still filling)."""
        table = _POW2_SHIFTS.get(self.poly)
        if table is None:
            table = []
            op = [self.poly] + [1 << n for n in range(31)]  # one zero bit
            for _ in range(3):  # 8 zero bits
                op = gf2_square(op)
            for _ in range(64):
                table.append(op)
                op = gf2_square(op)
            table = _POW2_SHIFTS.setdefault(self.poly, table)
        return table[k]


_POW2_SHIFTS: dict[int, list[list[int]]] = {}


_PIECE = 4 << 20


def _native_extend() -> Callable[[int, int, int], int] | None:
    """google_crc32c's own ``crc32c_extend(crc, pointer, length)`` called through ``ctypes``, which
    releases the GIL for the call; None where the symbol cannot be found (then the extension's own
    ``extend`` is used).

    Why: the extension holds the GIL for any buffer that is not ``bytes`` (its C code releases it
    only for immutable ``bytes`` of 1 MiB or more), and a save's bytes are numpy views. Measured on
    the lent H200's 16 cores and here (2 cores): a pure-Python thread ran at 7% of its idle speed
    while the extension hashed a 512 MiB numpy buffer, and at 67-100% through ``ctypes``, at the same
    9-11 GB/s. A checkpoint's every byte passes this CRC on the writer threads of an async save while
    the training thread needs the interpreter. ``dlsym`` on the extension's handle also searches the
    libraries it links, so this finds the function wherever the wheel or the system put it.
    """

    try:
        lib = ctypes.CDLL(google_crc32c._crc32c.__file__)  # type: ignore[attr-defined]
        fn = lib.crc32c_extend
    except (AttributeError, OSError):
        return None
    fn.restype = ctypes.c_uint32
    fn.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t]
    return fn


_NATIVE = _native_extend()


def _crc32c_update(data: Any, crc: int = 0) -> int:
    # google_crc32c's extension takes bytes and numpy arrays (not memoryview or bytearray), and
    # releases the GIL only for bytes from 1 MiB (see _native_extend). Other buffers are hashed in
    # place as numpy views, 4 MiB at a time so other threads get the GIL between pieces: copying them
    # to bytes first (one 64 MiB object per call) page-faulted fresh memory and took 5x the hash
    # itself (reshard profile, 2 cores).
    if type(data) is bytes:
        return google_crc32c.extend(crc, data)
    try:
        arr = np.frombuffer(data, dtype=np.uint8)
    except (TypeError, ValueError):  # not C-contiguous, or not a flat byte buffer
        return google_crc32c.extend(crc, bytes(data))
    if _NATIVE is not None:
        return int(_NATIVE(crc, arr.ctypes.data, arr.size)) if arr.size else crc
    for i in range(0, arr.size, _PIECE):
        crc = google_crc32c.extend(crc, arr[i:i + _PIECE])
    return crc


def _libdeflate_crc32() -> Callable[[int, int, int], int] | None:
    """libdeflate's ``libdeflate_crc32(crc, pointer, length)`` through ``ctypes`` (which releases the GIL for the
    call), where the system has the library (Debian and Ubuntu: ``libdeflate0``); None elsewhere, or with
    ``CKPT_CRC32_ZLIB=1`` (the switch of an A/B).

    Why: a zip record's CRC-32 is the only checksum a ``dcp.save`` file carries, so ``verify --data`` runs it over
    every byte, and zlib's (1.2.13, table-driven) was half of what a byte cost the pass: 0.18-0.21 CPU s per GB
    against 0.13 for the copy out of the page cache and 0.04 for the NaN/Inf scan (2-core VM,
    ``benchmarks/verify_data_stages.py``). libdeflate's folds with carry-less multiplies: 4.4 GB/s against 0.75
    for zlib's on the same loaded core (5.9x). The values are the same function (checked here on every size).
    """
    if os.environ.get(CRC32_ZLIB_ENV) == "1":
        return None
    for name in ("libdeflate.so.0", "libdeflate.so"):
        try:
            fn = ctypes.CDLL(name).libdeflate_crc32
        except (OSError, AttributeError):
            continue
        fn.restype = ctypes.c_uint32
        fn.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t]
        return fn
    return None


CRC32_ZLIB_ENV = "CKPT_CRC32_ZLIB"
DEFLATE_MIN = 16 << 10  # smaller buffers go to zlib: the library call and the address cost about what they do


def _zlib_ng_crc32() -> Callable[[Any, int], int] | None:
    """zlib-ng's ``crc32(data, value)`` (the ``zlib-ng`` package: a wheel with the library built in, so every machine
    has it; it releases the GIL as zlib does), or None with ``CKPT_CRC32_ZLIB=1`` or where it is not installed.

    Why it comes first: the lent 16-core hosts have no libdeflate, so the zip records' CRC-32 there ran on the
    system zlib (table-driven). One core, 256 MiB in 512 KiB pieces (the data pass's), the same values: zlib-ng
    11.8 GB/s, libdeflate through ``ctypes`` 9.7, zlib 3.6 (2-core VM)."""
    if os.environ.get(CRC32_ZLIB_ENV) == "1":
        return None
    try:
        from zlib_ng import zlib_ng
    except ImportError:
        return None
    return zlib_ng.crc32


_ZLIB_NG = _zlib_ng_crc32()
_DEFLATE = None if _ZLIB_NG is not None else _libdeflate_crc32()


def crc32(data: Any, value: int = 0) -> int:
    """``zlib.crc32(data, value)``, the same value, through zlib-ng (:func:`_zlib_ng_crc32`), else libdeflate where the
    system has it (:func:`_libdeflate_crc32`), for a contiguous buffer of :data:`DEFLATE_MIN` bytes or more.

    A writable buffer's address for libdeflate comes from ``ctypes`` (0.5 us); a read-only one's (``bytes``) from
    numpy (3.6 us: the data pass calls this once per 512 KiB piece, on every worker, with the GIL held for that
    part)."""
    if _ZLIB_NG is None and _DEFLATE is None:
        return zlib.crc32(data, value)
    try:
        view = memoryview(data)
    except TypeError:
        return zlib.crc32(data, value)  # zlib's own error for what is no buffer
    n = view.nbytes
    if n < DEFLATE_MIN or not view.c_contiguous:
        return zlib.crc32(data, value)  # small, or zlib's own error for a strided view
    if _ZLIB_NG is not None:
        return _ZLIB_NG(view, value & 0xFFFFFFFF)
    try:
        addr = ctypes.addressof(ctypes.c_char.from_buffer(view))
    except TypeError:  # read-only
        addr = np.frombuffer(view.cast("B"), dtype=np.uint8).ctypes.data
    return int(_DEFLATE(value & 0xFFFFFFFF, addr, n))


def crc32_backend() -> str:
    """Which library computes :func:`crc32` for large buffers: ``zlib-ng``, ``libdeflate`` or ``zlib``."""
    return "zlib-ng" if _ZLIB_NG is not None else "libdeflate" if _DEFLATE is not None else "zlib"


CRCS: dict[str, Crc] = {
    "crc32": Crc("crc32", 0xEDB88320, crc32),
    "crc32c": Crc("crc32c", 0x82F63B78, _crc32c_update),
}


# -- a CRC just computed on this thread, for a writer that is handed the very same bytes --------------------------

KNOWN_MIN = 1 << 20  # smaller buffers are hashed again: a combine costs about what hashing 1 MiB does
_KNOWN = threading.local()


def _span(data: Any) -> tuple[int, int] | None:
    try:
        arr = np.frombuffer(data, dtype=np.uint8)
    except (TypeError, ValueError):
        return None
    return arr.ctypes.data, arr.size


def remember(algorithm: str, data: Any, value: int) -> None:
    """Note, for this thread, that ``data`` (a buffer of at least :data:`KNOWN_MIN` bytes) has CRC ``value`` under
    ``algorithm``: the copy's read ledger, which hashes every range a copy reads into the buffer it landed in."""
    span = _span(data) if memoryview(data).nbytes >= KNOWN_MIN else None
    _KNOWN.last = None if span is None else (algorithm, *span, value)


def forget() -> None:
    """Drop this thread's note: called before a copy fills the next chunk, so that a note never outlives the chunk
    whose bytes it was taken from (a buffer reused or reallocated at the same address holds other bytes)."""
    _KNOWN.last = None


def recall(algorithm: str, data: Any) -> int | None:
    """The CRC this thread noted (:func:`remember`) for exactly the memory of ``data`` (same address, same length)
    under ``algorithm``, taken once; ``None`` otherwise.

    Why: a reshard hands its writer the very bytes its read ledger just hashed (a chunk copied unchanged, read
    into the buffer it is written from), and the output's CRC-32C hashed them a second time: 0.19 CPU s/GB of a
    reshard (2-core machine, ``benchmarks/copy_cpu_stages.py``). The writer combines the noted value instead
    (:meth:`Crc.combine`). Sound only while nothing wrote into the buffer between the read and the write: the copy
    forgets the note before each chunk (:func:`forget`), and within one chunk the last read is of the bytes
    returned only when no assembly follows it."""
    last = getattr(_KNOWN, "last", None)
    if last is None or last[0] != algorithm:
        return None
    span = _span(data)
    if span is None or span != last[1:3]:
        return None
    _KNOWN.last = None
    return int(last[3])
