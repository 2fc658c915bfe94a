"""The chunk statistics against a brute-force reference, and the same bits for the same bytes however they arrive.

Why brute force: :func:`element_stats` is one compiled loop that reads each element's bits as integers
for the range and the NaN/Inf test, and sums squares in an order the compiler picks. A plain Python loop
over every element, with the same finite-only definitions (the range in IEEE 754's total order, so a
``-0.0`` is below ``0.0``; the sum of squares exact with ``math.fsum``) is what the counts and the range
must equal exactly and the sum must equal to fp64 rounding, for any mix of values, zeros, NaN and
infinities, over every dtype with statistics, in blocks cut at several sizes so that a chunk spans many
blocks, partial ones included.

Why the same bits: a record's statistics are compared across saves and writers (the save's sink takes
them piece by piece as it writes; reshard, export and the read-back reference take them from whole
chunks), so the same stored bytes must give the same record, the last bit of the sum included,
whatever runs they are handed in and wherever they sit in memory.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from gtp_format.dtypes import FLOAT, DType, by_name
from gtp_format.integrity import stats as stats_mod
from gtp_format.integrity.stats import ChunkStats, StatsStream, element_stats
from gtp_format.scan import carrier

FLOATS = {"float32": np.float32, "float64": np.float64, "float16": np.float16}
INTS = ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"]
SPECIAL = [0.0, -0.0, math.nan, -math.nan, math.inf, -math.inf, 1.0, -1.0, 3e38, -3e38, 1e300,
           1e-45, -1e-45, 1e-40, 5e-324, -5e-324, 6e-8, -6e-8, 65504.0, 7e4]


def _numbers(stored: np.ndarray, dtype: DType) -> np.ndarray:
    if dtype.name == "bfloat16":
        return (stored.astype(np.uint32) << 16).view(np.float32)
    if dtype.name == "float16":
        return stored.view("<f2")
    return stored


def _total_order(v: float) -> tuple[float, bool]:
    return v, math.copysign(1.0, v) > 0


def _loop(values: list[float]) -> ChunkStats:
    """Counts, range (total order) and exact sum of squares, element by element in Python."""
    finite = [v for v in values if math.isfinite(v)]
    return ChunkStats(len(values), sum(math.isnan(v) for v in values), sum(v == math.inf for v in values),
                      sum(v == -math.inf for v in values), sum(v == 0 for v in finite),
                      min(finite, key=_total_order) if finite else None,
                      max(finite, key=_total_order) if finite else None, math.fsum(v * v for v in finite))


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


def _held(stored: np.ndarray, dtype: DType) -> list[float]:
    return [float(v) for v in _numbers(stored, dtype)] if dtype.kind == FLOAT else [float(v) for v in stored]


def _check(got: ChunkStats, want: ChunkStats) -> None:
    """Counts exact; the range exact, the sign of a zero included; the sum to fp64 rounding (or both past it)."""
    assert (got.numel, got.nan, got.posinf, got.neginf, got.zeros) == \
        (want.numel, want.nan, want.posinf, want.neginf, want.zeros)
    for a, b in ((got.min, want.min), (got.max, want.max)):
        assert (a is None) == (b is None)
        if a is not None:
            assert a == b and math.copysign(1.0, a) == math.copysign(1.0, b), (got, want)
    if math.isfinite(want.sumsq) and want.sumsq < 1e307:
        assert got.sumsq == pytest.approx(want.sumsq, rel=1e-12, abs=1e-300)
    else:  # past fp64: the record says "overflowed"
        assert got.sumsq == math.inf and got.to_json()["sumsq"] is None


def _same_bits(a: ChunkStats, b: ChunkStats) -> None:
    assert json.dumps(a.to_json()) == json.dumps(b.to_json())
    assert a.sumsq.hex() == b.sumsq.hex()


values_st = st.lists(st.one_of(st.sampled_from(SPECIAL), st.floats(allow_nan=True, allow_infinity=True),
                               st.floats(-1e3, 1e3)), max_size=400)
ints_st = st.lists(st.integers(0, 2**64 - 1), max_size=400)
dtype_st = st.sampled_from(["float32", "float64", "float16", "bfloat16", "bool", *INTS])


@settings(max_examples=400, deadline=None)
@given(name=dtype_st, values=values_st, ints=ints_st, block=st.sampled_from([8, 16, 24, 512, 1 << 20]),
       zero_run=st.integers(0, 200), at=st.integers(0, 400))
@example(name="float32", values=[-0.0, 0.0], ints=[], block=8, zero_run=0, at=0)
@example(name="float64", values=[1e300, -1e300, 2.0], ints=[], block=8, zero_run=0, at=0)
def test_statistics_match_a_python_loop(name: str, values: list[float], ints: list[int], block: int,
                                        zero_run: int, at: int):
    dtype = by_name(name)
    stored = _stored(dtype, values, ints)
    # a run of (signed) zeros somewhere: whole blocks of zeros, both signs
    zeros = _stored(dtype, [(-0.0 if k % 3 == 0 else 0.0) for k in range(zero_run)], [0] * zero_run)
    stored = np.concatenate([stored[:at], zeros, stored[at:]])
    old = stats_mod.BLOCK_BYTES
    stats_mod.BLOCK_BYTES = block
    try:
        got = element_stats(stored, dtype)
    finally:
        stats_mod.BLOCK_BYTES = old
    assert got is not None
    _check(got, _loop(_held(stored, dtype)))


@settings(max_examples=150, deadline=None)
@given(name=dtype_st, values=values_st, ints=ints_st, cuts=st.lists(st.integers(0, 3200), max_size=12),
       shift=st.integers(0, 15), block=st.sampled_from([64, 1 << 20]))
def test_the_same_bytes_give_the_same_bits_in_any_runs_and_at_any_address(name: str, values: list[float],
                                                                         ints: list[int], cuts: list[int],
                                                                         shift: int, block: int):
    """The sink hands a chunk's bytes as it writes them; reshard hands whole chunks: one record."""
    dtype = by_name(name)
    stored = np.ascontiguousarray(_stored(dtype, values, ints))
    raw = stored.view(np.uint8)
    old = stats_mod.BLOCK_BYTES
    stats_mod.BLOCK_BYTES = block
    try:
        whole = element_stats(stored, dtype)
        stream = StatsStream(dtype)
        edges = sorted({0, raw.size, *(c % (raw.size + 1) for c in cuts)})
        for lo, hi in zip(edges, edges[1:]):  # runs of any length, elements cut in two included
            stream.update(raw[lo:hi])
        moved = np.empty(raw.size + 16, np.uint8)[shift:shift + raw.size]  # the bytes at another alignment
        moved[:] = raw
        elsewhere = element_stats(moved.view(stored.dtype), dtype)
    finally:
        stats_mod.BLOCK_BYTES = old
    assert whole is not None and elsewhere is not None
    _same_bits(stream.result(), whole)
    _same_bits(elsewhere, whole)


@pytest.mark.parametrize("name", ["float32", "bfloat16", "float16", "float64", "int64"])
def test_many_full_blocks_with_zero_and_one_signed_blocks(name: str):
    """Real block size, several blocks: random, all zero (both signs), one sign, NaN and Inf, a tail."""
    dtype = by_name(name)
    b = stats_mod.BLOCK_BYTES // 2
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
    want = _loop(_held(stored, dtype))
    _check(ChunkStats(got.numel, got.nan, got.posinf, got.neginf, got.zeros, got.min, got.max, want.sumsq), want)
    assert got.sumsq == pytest.approx(want.sumsq, rel=1e-10)  # 2 M terms: fp64 rounding, summed in lanes


def test_an_empty_chunk_has_counts_and_no_range():
    for name in ["float32", "bfloat16", "int32", "bool"]:
        dtype = by_name(name)
        assert element_stats(np.zeros(0, carrier(dtype)), dtype) == ChunkStats(0, 0, 0, 0, 0, None, None, 0.0)


def test_a_chunk_that_is_not_whole_elements_is_refused():
    stream = StatsStream(by_name("float32"))
    stream.update(b"\x00" * 6)
    with pytest.raises(ValueError, match="not whole"):
        stream.result()
    with pytest.raises(ValueError, match="no statistics"):
        StatsStream(by_name("float8_e4m3fn"))


def test_without_a_writable_cache_the_loop_is_compiled_and_gives_the_same_figures(monkeypatch):
    """numba's ``cache=True`` raises where no cache folder is writable (a read-only install and home); the loop is
    then compiled without one, with the same figures."""
    import numba

    stored = np.array([0.5, -2.0, 0.0, 3.0], np.float32)
    want = element_stats(stored, by_name("float32"))
    real = numba.njit

    def no_cache(*a, **k):
        if k.get("cache"):
            raise RuntimeError("cannot cache function 'one_pass': no locator available for file 'stats.py'")
        return real(*a, **k)

    monkeypatch.setattr(numba, "njit", no_cache)
    stats_mod._compiled.cache_clear()
    try:
        assert element_stats(stored, by_name("float32")) == want
    finally:
        stats_mod._compiled.cache_clear()
