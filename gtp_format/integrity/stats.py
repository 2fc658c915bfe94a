"""Value statistics of one chunk from its stored elements, by dtype (bfloat16 included), in one fused pass.

Counts of NaN, +Inf, -Inf and zeros (``-0.0`` is a zero), and over the *finite* values the min, the
max and the sum of squares accumulated in fp64. Finite-only, so that one NaN does not erase the
range of everything else, and so ``inspect --stats`` can show both "3 NaN" and the scale of the
rest. Dtypes without a numeric view here (float8, complex, bit containers) get no statistics:
their hash is still recorded.

Why one compiled pass (numba) and not numpy: numpy has no call that gives a min, a max, a zero count
and an fp64 sum of squares together, so the statistics were six passes per block (min, max, the zero
compare and count, the fp64 cast, the square, the pairwise sum): 65 ms of one core per 256 MB of
float32 on the 2-core machine, a quarter of a CPU save's own CPU, and the save is CPU-bound there
when the disk is fast (docs/performance.md). One loop that reads each element once takes
11 ms for the same bytes (``benchmarks/bench_save_integrity.py``'s last table: 0.08 CPU s against 0.42 for
the six passes over one rank's chunks).

How the loop stays vectorised and exact:

* the min and max come from integer reductions of the element's *bits* (the smallest and largest as
  signed integers, the largest as unsigned: :func:`_float_block` says how they give the range),
  because a compiler may vectorise an integer min but not a float one whose NaN behaviour it must
  keep. So the range is exact and follows IEEE 754's total order: ``-0.0 < 0.0``, and a block of both
  zeros has min ``-0.0`` and max ``0.0``;
* NaN and ±Inf are found from the same reductions (exponent all ones); a block that holds one is taken
  again by the exact path (:func:`_exact_block`: counted, dropped, the rest through the same loop),
  so the fast path never has to carry NaN through its arithmetic;
* the fp64 sum of squares may be reassociated and fused (``fastmath={'reassoc', 'contract'}``): the
  compiler keeps several partial sums in vector lanes. The result is the sum of exact squares (a
  float32 or bfloat16 squared in fp64 is exact) with fp64 rounding in an order fixed by the compiled
  code, so the same elements give the same bits on the same machine and build; another CPU's vector
  width may change the last bits (as the GPU's sum does), never the counts or the range.

Integers go through the same loop, their zero mask all of their bits.

The loop runs over blocks of :data:`BLOCK_BYTES` stored bytes from the chunk's start, the size of the
save's sink pieces, so the sink can take the statistics of each piece as it hashes and copies it
(:class:`StatsStream`) and a whole chunk gives the same blocks; the blocks' sums are added in order.
A block keeps a widened copy of 16-bit floats in cache and bounds its memory.

The loop is compiled on first use, once per array type, and cached on disk by numba (``cache=True``):
a process that finds no cache spends about a second compiling, later ones load it in 0.3 s
(:func:`warm_up` does it on a writer's thread while the save plans).
"""

from __future__ import annotations

import math
import struct
import threading
from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np

from gtp_format.dtypes import BOOL, FLOAT, SIGNED, UNSIGNED, DType
from gtp_format.scan import carrier

BLOCK_BYTES = 1 << 20  # stored bytes per kernel call: the sink's piece (a core's L2 here), widened 16-bit floats 2 MiB


@dataclass(frozen=True)
class ChunkStats:
    numel: int
    nan: int
    posinf: int
    neginf: int
    zeros: int
    min: float | None  # over finite values; None when there are none
    max: float | None
    sumsq: float  # fp64 sum of squares of the finite values

    @property
    def nonfinite(self) -> int:
        return self.nan + self.posinf + self.neginf

    def to_json(self) -> dict[str, Any]:
        return {"numel": self.numel, "nan": self.nan, "posinf": self.posinf, "neginf": self.neginf,
                "zeros": self.zeros, "min": self.min, "max": self.max,
                "sumsq": self.sumsq if math.isfinite(self.sumsq) else None}  # None: it overflowed fp64

    def merge(self, other: ChunkStats) -> ChunkStats:
        """The statistics of two chunks together (``inspect --stats`` per key)."""
        lo = [v for v in (self.min, other.min) if v is not None]
        hi = [v for v in (self.max, other.max) if v is not None]
        return ChunkStats(self.numel + other.numel, self.nan + other.nan, self.posinf + other.posinf,
                          self.neginf + other.neginf, self.zeros + other.zeros, min(lo) if lo else None,
                          max(hi) if hi else None, self.sumsq + other.sumsq)


def has_stats(dtype: DType) -> bool:
    return dtype.name in ("float32", "float64", "float16", "bfloat16") or dtype.kind in (SIGNED, UNSIGNED, BOOL)


_KERNEL_LOCK = threading.Lock()


def _kernel() -> Any:
    """The compiled loop, made once per process even when several threads ask at once (a copy's file threads
    and :func:`warm_up`'s: the later ones wait for it rather than each importing numba and loading the loop)."""
    with _KERNEL_LOCK:
        return _compiled()


@cache
def _compiled() -> Any:
    """The compiled loop (numba imported here, on the first statistics of a process: the read-only commands
    never pay its import)."""
    from numba import njit

    def one_pass(x: Any, bits: Any, ubits: Any, consts: Any) -> Any:
        """One pass over a block, read as its numbers and as signed and unsigned integers of its width:
        (sum of squares in fp64, the smallest and largest signed, the largest unsigned, zeros). ``consts[0]``
        (in the integers' own type) masks what makes a zero: a float's bits without the sign bit (``-0.0`` is
        a zero), all of an integer's (``x``, ``bits`` and ``ubits`` are then the same array)."""
        mag = consts[0]
        smin = smax = bits[0]
        umax = ubits[0]
        s = 0.0
        zeros = 0
        for i in range(x.size):
            b = bits[i]
            smin = min(smin, b)
            smax = max(smax, b)
            umax = max(umax, ubits[i])
            d = np.float64(x[i])
            s += d * d
            zeros += (b & mag) == 0
        return s, smin, smax, umax, zeros

    options = {"nogil": True, "boundscheck": False, "fastmath": {"reassoc", "contract"}}
    try:
        return njit(cache=True, **options)(one_pass)
    except RuntimeError:  # no writable cache (a read-only install and home): compiled anew by each process
        return njit(cache=False, **options)(one_pass)


# per float width: the bits as signed and unsigned integers, the mask that drops the sign bit (an array: numba's
# dispatcher types an array from a cache, a numpy scalar on every call), the smallest signed bits of a positive
# NaN or +Inf, the smallest unsigned bits of a negative one
_BITS = {4: (np.int32, np.uint32, np.array([0x7FFFFFFF], np.int32), 0x7F800000, 0xFF800000),
         8: (np.int64, np.uint64, np.array([0x7FFFFFFFFFFFFFFF], np.int64), 0x7FF0000000000000, 0xFFF0000000000000)}


@cache
def _all_ones(dtype: np.dtype) -> np.ndarray:
    """An integer's zero mask for the loop: every bit (``-1`` of a signed type is all ones)."""
    return np.array([-1 if dtype.kind == "i" else np.iinfo(dtype).max], dtype)


def _bits_value(bits: int, itemsize: int) -> float:
    fmt = "<I" if itemsize == 4 else "<Q"
    return struct.unpack("<f" if itemsize == 4 else "<d", struct.pack(fmt, bits % (1 << (8 * itemsize))))[0]


class _Acc:
    """The figures of the blocks so far; the range as (key of the min, key of the max), where a key orders
    floats as IEEE 754's total order does (:func:`_key`), so ``-0.0`` sorts below ``0.0``."""

    def __init__(self) -> None:
        self.nan = self.posinf = self.neginf = self.zeros = 0
        self.sumsq = 0.0
        self.lo: Any = None
        self.hi: Any = None

    def add(self, s: float, lo: Any, hi: Any, zeros: int) -> None:
        self.sumsq += s
        self.zeros += int(zeros)
        self.lo = lo if self.lo is None or lo < self.lo else self.lo
        self.hi = hi if self.hi is None or hi > self.hi else self.hi


def _key(value: float) -> tuple[float, int]:
    """Orders floats like IEEE 754's total order does for non-NaN values: by value, ``-0.0`` below ``0.0``."""
    return value, int(math.copysign(1.0, value) > 0)


def _float_block(x: np.ndarray, acc: _Acc) -> None:
    """One block of float32 or float64 numbers.

    Everything from three integer ranges of the bits (no float compare, so the loop vectorises). A
    non-negative value's bits are a non-negative signed integer that grows with it; a negative value's
    bits, as unsigned, grow with its magnitude. So: a NaN or an infinity is there exactly when the largest
    signed bits reach +Inf's or the largest unsigned bits reach -Inf's. The min is the largest unsigned
    bits when any value is negative (the smallest signed bits are then negative), else the smallest
    signed; the max is the largest signed bits when any value is non-negative, else (all negative) the
    smallest signed, the negative value nearest zero."""
    if not x.size:
        return
    signed, unsigned, consts, pos_bad, neg_bad = _BITS[x.itemsize]
    s, smin, smax, umax, zeros = _kernel()(x, x.view(signed), x.view(unsigned), consts)
    smin, smax, umax = int(smin), int(smax), int(umax)
    if smax >= pos_bad or umax >= neg_bad:  # a NaN or an infinity: the block again, exactly
        _exact_block(x, acc)
        return
    size = x.itemsize
    lo = _bits_value(umax if smin < 0 else smin, size)
    hi = _bits_value(smax if smax >= 0 else smin, size)
    acc.add(s, _key(lo), _key(hi), zeros)  # a float64 sum may overflow: inf


def _exact_block(x: np.ndarray, acc: _Acc) -> None:
    """A block that holds NaN or ±Inf: those counted, the finite rest through the same loop."""
    finite = np.isfinite(x)
    bad = x[~finite]
    acc.nan += int(np.count_nonzero(np.isnan(bad)))
    acc.posinf += int(np.count_nonzero(bad == np.inf))
    acc.neginf += int(np.count_nonzero(bad == -np.inf))
    _float_block(np.ascontiguousarray(x[finite]), acc)


class StatsStream:
    """The statistics of one chunk from its stored bytes, handed in order as they pass: what the save's sink
    does with each piece it hashes and copies (so the statistics read bytes that are in the cache, and no
    pass of their own reads the chunk from memory), and what :func:`element_stats` does with a whole chunk.

    The blocks are :data:`BLOCK_BYTES` of stored bytes from the chunk's start, whatever the runs handed in:
    a run that ends inside a block leaves its tail in a carry buffer that the next run completes. The
    sink's pieces are whole blocks (its ``PIECE`` is this size), so it never copies; either way the same
    bytes give the same blocks, so the same figures to the last bit.
    """

    def __init__(self, dtype: DType) -> None:
        if not has_stats(dtype):
            raise ValueError(f"{dtype} has no statistics")
        self.dtype = dtype
        self._carrier = carrier(dtype)  # the stored (little-endian) elements
        self._acc = _Acc()
        self._numel = 0
        self._carry = np.empty(0, np.uint8)
        self._carried = 0
        self._wide: np.ndarray | None = None

    def update(self, data: Any) -> None:
        """The next stored bytes of the chunk (any bytes-like)."""
        raw = np.frombuffer(data, np.uint8)
        if self._carried:
            take = min(raw.size, BLOCK_BYTES - self._carried)
            self._carry[self._carried:self._carried + take] = raw[:take]
            self._carried += take
            raw = raw[take:]
            if self._carried < BLOCK_BYTES:
                return
            self._block(self._carry)
            self._carried = 0
        whole = raw.size - raw.size % BLOCK_BYTES
        for at in range(0, whole, BLOCK_BYTES):
            self._block(raw[at:at + BLOCK_BYTES])
        if whole < raw.size:
            if not self._carry.size:
                self._carry = np.empty(BLOCK_BYTES, np.uint8)
            self._carried = raw.size - whole
            self._carry[:self._carried] = raw[whole:]

    def result(self) -> ChunkStats:
        """The chunk's statistics (the last, partial block is taken now)."""
        if self._carried:
            if self._carried % self._carrier.itemsize:
                raise ValueError(f"{self._carried} bytes left over: not whole {self.dtype} elements")
            self._block(self._carry[:self._carried])
            self._carried = 0
        a = self._acc
        if self.dtype.kind == FLOAT:
            lo = None if a.lo is None else a.lo[0]
            hi = None if a.hi is None else a.hi[0]
        else:
            lo = None if a.lo is None else float(a.lo)
            hi = None if a.hi is None else float(a.hi)
        return ChunkStats(self._numel, a.nan, a.posinf, a.neginf, a.zeros, lo, hi, a.sumsq)

    def _block(self, raw: np.ndarray) -> None:
        if raw.size % self._carrier.itemsize:
            raise ValueError(f"a block of {raw.size} bytes is not whole {self.dtype} elements")
        x = raw.view(self._carrier)
        if not x.dtype.isnative:  # a big-endian host: the kernels read native numbers
            x = x.astype(x.dtype.newbyteorder("="))
        self._numel += x.size
        if not x.size:
            return
        if self.dtype.kind != FLOAT:
            if self.dtype.kind == BOOL:
                x = x.view(np.uint8)
            s, lo, hi, _, zeros = _kernel()(x, x, x, _all_ones(x.dtype))
            self._acc.add(s, lo, hi, zeros)
            return
        name = self.dtype.name
        if name in ("bfloat16", "float16"):
            if self._wide is None:
                self._wide = np.empty(BLOCK_BYTES // 2, np.uint32 if name == "bfloat16" else np.float32)
            w = self._wide[:x.size]
            if name == "bfloat16":  # the top half of a float32: widen the bits, no rounding
                np.copyto(w, x, casting="unsafe")
                np.left_shift(w, 16, out=w)
                x = w.view(np.float32)
            else:  # exact in float32
                np.copyto(w, x.view(np.float16))
                x = w
        _float_block(x, self._acc)


def warm_up(dtypes: list[DType]) -> None:
    """Load (or compile) the loops ``dtypes`` need now: a writer calls this on a thread of its own before its
    first chunk, so the first save of a process does not wait for it (0.3 s with numba's disk cache, 1 s
    without, on the 2-core machine; numba's import before it another 1.1-1.4 s there under load)."""
    for dtype in {d.name: d for d in dtypes if has_stats(d)}.values():
        element_stats(np.zeros(1, carrier(dtype)), dtype)


def zero_stats(dtype: DType, numel: int) -> ChunkStats | None:
    """The statistics :class:`StatsStream` gives ``numel`` elements whose stored bits are all zero (``+0.0``
    for a float), without reading them: every element a zero, the range ``0.0`` (none if empty), a sum of
    squares ``0.0``. None for a dtype without statistics."""
    if not has_stats(dtype):
        return None
    return ChunkStats(numel, 0, 0, 0, numel, 0.0 if numel else None, 0.0 if numel else None, 0.0)


def element_stats(elements: np.ndarray, dtype: DType) -> ChunkStats | None:
    """Statistics of stored elements viewed through :func:`gtp_format.scan.carrier`; None for other dtypes."""
    if not has_stats(dtype):
        return None
    stream = StatsStream(dtype)
    stream.update(np.ascontiguousarray(elements).reshape(-1).view(np.uint8))
    return stream.result()
