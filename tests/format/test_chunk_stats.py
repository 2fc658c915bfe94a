"""The chunk statistics are bit for bit what they were before the buffers were reused (issue 26).

Why bit for bit: a record's statistics are compared across saves and writers (``ckpt diff`` shows
them, the replica and export tests compare records of the same state), so a faster
:func:`element_stats` must give the same JSON for the same elements, the sign of a zero minimum
and the last bit of the fp64 sum of squares included. The reference is the computation as it was
(one allocating numpy pass each, per block of ``BLOCK`` elements), written out here, and a plain
Python loop checks the counts and the range of both; over every dtype with statistics, NaN, both
infinities, both zeros, denormals, empty chunks, and blocks cut at several sizes so that a chunk
spans many blocks, partial ones included.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gtp_format.dtypes import FLOAT, DType, by_name
from gtp_format.integrity import stats as stats_mod
from gtp_format.integrity.stats import ChunkStats, element_stats
from gtp_format.scan import carrier

FLOATS = {"float32": np.float32, "float64": np.float64, "float16": np.float16}
INTS = ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"]
SPECIAL = [0.0, -0.0, math.nan, -math.nan, math.inf, -math.inf, 1.0, -1.0, 3e38, -3e38, 1e300,
           1e-45, -1e-45, 1e-40, 5e-324, -5e-324, 6e-8, -6e-8, 65504.0, 7e4]


def _numbers(block: np.ndarray, dtype: DType) -> np.ndarray:
    if dtype.name == "bfloat16":
        return (block.astype(np.uint32) << 16).view(np.float32)
    if dtype.name == "float16":
        return block.view("<f2")
    return block


def _before(elements: np.ndarray, dtype: DType, block: int) -> ChunkStats:
    """The statistics as defined before: per block, the non-finite counted and dropped, then numpy's min,
    max, zero count and pairwise fp64 sum of squares over what is left, each its own allocating pass."""
    flat = elements.reshape(-1)
    counts = [0, 0, 0, 0]  # nan, +inf, -inf, zeros
    lows: list[float] = []
    highs: list[float] = []
    sumsq = 0.0
    for i in range(0, flat.size, block):
        x = _numbers(flat[i:i + block], dtype)
        if dtype.kind == FLOAT and not np.isfinite(x).all():
            counts[0] += int(np.isnan(x).sum())
            counts[1] += int(np.isposinf(x).sum())
            counts[2] += int(np.isneginf(x).sum())
            x = x[np.isfinite(x)]
        if x.size:
            lows.append(float(x.min()))
            highs.append(float(x.max()))
            counts[3] += int((x == 0).sum())
            with np.errstate(over="ignore"):
                sumsq += float(np.square(x.astype(np.float64)).sum())
    lo = hi = None
    for v in lows:  # Python's min and max keep the first of equal values, as the blocks' merge does
        lo = v if lo is None else min(lo, v)
    for v in highs:
        hi = v if hi is None else max(hi, v)
    return ChunkStats(int(flat.size), *counts, lo, hi, sumsq)


def _loop(values: list[float]) -> tuple[int, int, int, int, int, float | None, float | None, float]:
    """Counts, range and (exact, then rounded) sum of squares, element by element in Python."""
    finite = [v for v in values if math.isfinite(v)]
    return (len(values), sum(math.isnan(v) for v in values), sum(v == math.inf for v in values),
            sum(v == -math.inf for v in values), sum(v == 0 for v in values),
            min(finite) if finite else None, max(finite) if finite else None, math.fsum(v * v for v in finite))


def _stored(dtype: DType, draw_values: list[float], ints: list[int]) -> np.ndarray:
    """The stored elements (carrier view) of a chunk of ``dtype`` built from the drawn values (past a
    dtype's range: its infinities, as a real cast gives; bfloat16 by truncation of the float32 bits)."""
    if dtype.name in FLOATS or dtype.name == "bfloat16":
        with np.errstate(over="ignore", invalid="ignore"):
            wide = np.array(draw_values, dtype=np.float64)
            if dtype.name == "bfloat16":
                return (wide.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
            return wide.astype(FLOATS[dtype.name]).view(carrier(dtype))
    if dtype.name == "bool":
        return np.array([i % 2 == 1 for i in ints], dtype=np.bool_)
    info = np.iinfo(carrier(dtype))
    return np.array([info.min + (i % (int(info.max) - int(info.min) + 1)) for i in ints], dtype=carrier(dtype))


def _same(got: ChunkStats, want: ChunkStats) -> None:
    """The same record: JSON text equal (so -0.0 against 0.0 differs) and the sum's bits equal."""
    assert json.dumps(got.to_json()) == json.dumps(want.to_json())
    assert got.sumsq.hex() == want.sumsq.hex()


values_st = st.lists(st.one_of(st.sampled_from(SPECIAL), st.floats(allow_nan=True, allow_infinity=True),
                               st.floats(-1e3, 1e3)), max_size=400)
ints_st = st.lists(st.integers(0, 2**64 - 1), max_size=400)
dtype_st = st.sampled_from(["float32", "float64", "float16", "bfloat16", "bool", *INTS])


@settings(max_examples=400, deadline=None)
@given(name=dtype_st, values=values_st, ints=ints_st, block=st.sampled_from([1, 2, 7, 64, 1 << 18]),
       zero_run=st.integers(0, 200), at=st.integers(0, 400))
def test_statistics_are_bit_identical_to_the_allocating_passes(name: str, values: list[float], ints: list[int],
                                                               block: int, zero_run: int, at: int):
    dtype = by_name(name)
    stored = _stored(dtype, values, ints)
    # a run of (signed) zeros somewhere: whole blocks of zeros take their own path
    zeros = _stored(dtype, [(-0.0 if k % 3 == 0 else 0.0) for k in range(zero_run)], [0] * zero_run)
    stored = np.concatenate([stored[:at], zeros, stored[at:]])
    old = stats_mod.BLOCK
    stats_mod.BLOCK = block
    try:
        got = element_stats(stored, dtype)
    finally:
        stats_mod.BLOCK = old
    want = _before(stored, dtype, block)
    assert got is not None
    _same(got, want)
    held = [float(v) for v in _numbers(stored, dtype)] if dtype.kind == FLOAT else [float(v) for v in stored]
    n, nan, posinf, neginf, zero, lo, hi, exact = _loop(held)
    assert (got.numel, got.nan, got.posinf, got.neginf, got.zeros, got.min, got.max) == \
        (n, nan, posinf, neginf, zero, lo, hi)
    if math.isfinite(exact):
        assert got.sumsq == pytest.approx(exact, rel=1e-9, abs=1e-300)


@pytest.mark.parametrize("name", ["float32", "bfloat16", "float16", "float64", "int64"])
def test_many_full_blocks_with_zero_and_one_signed_blocks(name: str):
    """Real ``BLOCK`` size, several blocks: random, all zero (both signs), one sign, NaN and Inf, a tail."""
    dtype = by_name(name)
    b = stats_mod.BLOCK
    rng = np.random.default_rng(3)
    parts = [rng.standard_normal(b) * 50, np.zeros(b), np.where(np.arange(b) % 2 == 0, -0.0, 0.0),
             np.abs(rng.standard_normal(b)) + 0.5, -np.abs(rng.standard_normal(b)) - 0.5,
             rng.standard_normal(b), rng.standard_normal(12345)]
    parts[5][[7, 70_000]] = [math.nan, math.inf]
    values = np.concatenate(parts)
    if dtype.kind == FLOAT:
        stored = _stored(dtype, values.tolist(), [])
    else:
        stored = np.nan_to_num(values * 1000, posinf=5, nan=3).astype(np.int64)
    got = element_stats(stored, dtype)
    assert got is not None
    _same(got, _before(stored, dtype, b))


def test_an_empty_chunk_has_counts_and_no_range():
    for name in ["float32", "bfloat16", "int32", "bool"]:
        dtype = by_name(name)
        assert element_stats(np.zeros(0, carrier(dtype)), dtype) == ChunkStats(0, 0, 0, 0, 0, None, None, 0.0)
