"""Value statistics of one chunk from its stored elements, with numpy, by dtype (bfloat16 included).

Counts of NaN, +Inf, -Inf and zeros (``-0.0`` is a zero), and over the *finite* values the min, the
max and the sum of squares accumulated in fp64. Finite-only, so that one NaN does not erase the
range of everything else, and so ``inspect --stats`` can show both "3 NaN" and the scale of the
rest. Dtypes without a numeric view here (float8, complex, bit containers) get no statistics:
their hash is still recorded.

Why blocks: converting a whole chunk to fp64 would allocate 4x a bf16 chunk; ``BLOCK`` elements
at a time keeps memory flat and the block in cache for the cheap passes (min, max, the zero count,
the fp64 cast, square, sum), each into a buffer reused for every block (:class:`_Scratch`). The
common case has one test for "no NaN/Inf": ``min`` and ``max`` propagate NaN, so both finite means
the block has neither; only a block where one is not takes the exact counting path. The block
size is part of the figures: the fp64 sum of squares is numpy's pairwise sum within a block, the
blocks' sums added in order, so changing ``BLOCK`` would change the last bits of ``sumsq`` (smaller
blocks were not faster either: 2^16 took 81 ms of CPU per 256 MB where 2^18 took 56).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from gtp_format.dtypes import BOOL, FLOAT, SIGNED, UNSIGNED, DType

BLOCK = 1 << 18  # elements per pass: 2 MiB of fp64, inside a core's L2/L3


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


class _Scratch:
    """The buffers one :func:`element_stats` call reuses for every block, so no pass allocates.

    Why (measured, one thread's CPU time per 256 MB of float32, old and new code in one run, 2 shared
    cores): a fresh array per pass (``x == 0`` a bool block, ``astype`` a 2 MiB fp64 block, bfloat16's
    widened copy) cost 75 ms for normal values, buffers allocated once 64 ms (bfloat16 83 and 69).
    Blocks of one sign skip the zero count, and all-zero blocks (zeroed moments, padding) the count
    and the three fp64 passes: 66 ms before, 9 ms now. The values are the same ones, from the same
    numpy calls on the same blocks, so the statistics are bit for bit what the allocating passes gave
    (``tests/format/test_chunk_stats.py``).
    """

    def __init__(self, size: int, dtype: DType) -> None:
        self.f64 = np.empty(size, np.float64)
        self.hits = np.empty(size, np.bool_)
        self.wide = np.empty(size, np.uint32) if dtype.name == "bfloat16" else None
        self.half = np.empty(size, np.float32) if dtype.name == "float16" else None

    def numbers(self, block: np.ndarray, dtype: DType) -> tuple[np.ndarray, np.ndarray | None]:
        """A block of stored elements (the :func:`gtp_format.scan.carrier` view) as numpy numbers, and for
        float16 the block as float16 too (:meth:`range`).

        float16 is widened to float32 (exact) because numpy has no vector loops for float16 here: the
        min of 64 M elements took 422 ms of CPU (float32: 4.4 ms), the widening 155 ms; a float16
        chunk's statistics 513 ms per 32 M elements before, 115 ms widened (one run, one thread).
        """
        if self.wide is not None:  # bfloat16: the top half of a float32: widen the bits, no rounding
            wide = self.wide[:block.size]
            np.copyto(wide, block, casting="unsafe")
            np.left_shift(wide, 16, out=wide)
            return wide.view(np.float32), None
        if self.half is not None:
            native = block.view("<f2")
            half = self.half[:block.size]
            np.copyto(half, native)
            return half, native
        return block, None

    @staticmethod
    def range(x: np.ndarray, native: np.ndarray | None) -> tuple[float, float]:
        """``x``'s min and max (NaN if it holds one). A zero result is taken again from ``native`` (the
        same elements as float16): which of ``0.0`` and ``-0.0`` a min or max returns depends on the
        loop that compares them, and the figure recorded is float16's own loop's."""
        lo, hi = float(x.min()), float(x.max())
        if native is not None and (lo == 0 or hi == 0):
            lo, hi = (float(native.min()) if lo == 0 else lo), (float(native.max()) if hi == 0 else hi)
        return lo, hi

    def zeros(self, x: np.ndarray, lo: float, hi: float) -> int:
        """How many of the (finite) ``x`` are zero (``-0.0`` included), given their min and max: none
        when all have one sign, all when both are zero, else counted (one comparison, one count)."""
        if lo > 0 or hi < 0:
            return 0
        if lo == 0 and hi == 0:
            return int(x.size)
        # same count as size - count_nonzero(x); 7 ms not 30 per 256 MB fp32
        return int(np.count_nonzero(np.equal(x, 0, out=self.hits[:x.size])))

    def sumsq(self, x: np.ndarray, lo: float, hi: float) -> float:
        """The fp64 sum of squares of the (finite) ``x``: numpy's pairwise sum of the block's squares.

        Summed without BLAS: a BLAS dot spawns threads, which on a loaded machine (ranks sharing cores
        with torch's own threads) made it 60x slower than this, measured on the save; and a BLAS dot
        adds in another order, so the figure would change with the library. All zeros: 0.0, as the
        sum gives, without the passes.
        """
        if lo == 0 and hi == 0:
            return 0.0
        y = self.f64[:x.size]
        np.copyto(y, x, casting="unsafe")  # what astype(float64) gives, into the buffer
        with np.errstate(over="ignore"):  # float64 data can overflow fp64: the sum is then inf ("overflow")
            np.square(y, out=y)
            return float(y.sum())


def element_stats(elements: np.ndarray, dtype: DType) -> ChunkStats | None:
    """Statistics of stored elements viewed through :func:`gtp_format.scan.carrier`; None for other dtypes."""
    if not has_stats(dtype):
        return None
    flat = elements.reshape(-1)
    floating = dtype.kind == FLOAT
    nan = posinf = neginf = zeros = 0
    lo, hi, sumsq = math.inf, -math.inf, 0.0
    scratch = _Scratch(min(BLOCK, flat.size), dtype)
    for i in range(0, flat.size, BLOCK):
        x, native = scratch.numbers(flat[i:i + BLOCK], dtype)
        if x.size == 0:
            continue
        b_lo, b_hi = scratch.range(x, native)  # min and max propagate NaN: finite both means no NaN/Inf
        if floating and not (math.isfinite(b_lo) and math.isfinite(b_hi)):
            finite = np.isfinite(x)
            bad = x[~finite]
            nan += int(np.count_nonzero(np.isnan(bad)))
            posinf += int(np.count_nonzero(bad == np.inf))
            neginf += int(np.count_nonzero(bad == -np.inf))
            x = x[finite]
            if not x.size:
                continue
            b_lo, b_hi = scratch.range(x, None if native is None else native[finite])
        zeros += scratch.zeros(x, b_lo, b_hi)
        lo, hi = min(lo, b_lo), max(hi, b_hi)
        sumsq += scratch.sumsq(x, b_lo, b_hi)
    some = lo <= hi
    return ChunkStats(int(flat.size), nan, posinf, neginf, zeros, lo if some else None, hi if some else None, sumsq)
