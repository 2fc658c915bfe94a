"""Chunk statistics against a brute-force reference, the writers' hash hook, and the side file's parser.

Why brute force: the statistics take a fast path (the bits decide "no NaN/Inf")
and blocks; a plain Python loop over every element, with the same finite-only definitions, is
what they must equal for any mix of values, zeros, NaN and infinities, bfloat16 included.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from gtp_format.dtypes import by_name
from gtp_format.integrity import stats as stats_mod
from gtp_format.integrity.record_file import Span, record_file
from gtp_format.integrity.records import ChunkRecord, _record, write_records
from gtp_format.integrity.stats import ChunkStats, element_stats
from gtp_format.scan import carrier

SPECIAL = [0.0, -0.0, math.nan, math.inf, -math.inf, 1.5, -2.25, 3e38, -1e-30]


def _reference(values: list[float]) -> ChunkStats:
    finite = [v for v in values if math.isfinite(v)]
    return ChunkStats(len(values), sum(math.isnan(v) for v in values), sum(v == math.inf for v in values),
                      sum(v == -math.inf for v in values), sum(v == 0 for v in values),
                      min(finite) if finite else None, max(finite) if finite else None,
                      math.fsum(v * v for v in finite))


def _bf16_bits(values: list[float]) -> np.ndarray:
    """Round-toward-zero bf16 bit patterns (the top 16 bits of each float32), and the values they hold."""
    return (np.array(values, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)


def _close(got: ChunkStats, want: ChunkStats) -> None:
    assert (got.numel, got.nan, got.posinf, got.neginf, got.zeros) == \
        (want.numel, want.nan, want.posinf, want.neginf, want.zeros)
    assert got.min == want.min and got.max == want.max
    assert got.sumsq == pytest.approx(want.sumsq, rel=1e-12, abs=1e-300)


float32s = st.floats(-1e30, 1e30).map(lambda v: float(np.float32(v)))
values_st = st.lists(st.one_of(st.sampled_from(SPECIAL), float32s), max_size=300)


@settings(max_examples=150, deadline=None)
@given(values=values_st, block=st.sampled_from([8, 56, 1 << 20]))
def test_float32_and_float64_stats_match_brute_force(values, block):
    old = stats_mod.BLOCK_BYTES
    stats_mod.BLOCK_BYTES = block
    try:
        for name, np_type in (("float32", np.float32), ("float64", np.float64)):
            arr = np.array(values, dtype=np_type)
            ref = _reference([float(v) for v in arr])
            _close(element_stats(arr.view(carrier(by_name(name))), by_name(name)), ref)
    finally:
        stats_mod.BLOCK_BYTES = old


@settings(max_examples=150, deadline=None)
@given(values=values_st)
def test_bfloat16_and_float16_stats_match_brute_force(values):
    bits = _bf16_bits(values)
    held = [float(v) for v in (bits.astype(np.uint32) << 16).view(np.float32)]
    _close(element_stats(bits, by_name("bfloat16")), _reference(held))
    with np.errstate(over="ignore"):  # values past float16's range become its infinities, as on a real cast
        half = np.array(values, dtype=np.float32).astype(np.float16)
    _close(element_stats(half.view(np.uint16), by_name("float16")), _reference([float(v) for v in half]))


def test_integer_stats_and_unsupported_dtypes():
    ints = np.array([0, -3, 7, 0], dtype=np.int64)
    assert element_stats(ints, by_name("int64")) == ChunkStats(4, 0, 0, 0, 2, -3.0, 7.0, 58.0)
    assert element_stats(np.zeros(4, np.uint8), by_name("float8_e4m3fn")) is None


def test_merge_keeps_counts_and_range():
    a = ChunkStats(2, 1, 0, 0, 0, -1.0, 2.0, 5.0)
    b = ChunkStats(3, 0, 1, 1, 1, None, None, 0.0)
    assert a.merge(b) == ChunkStats(5, 1, 1, 1, 1, -1.0, 2.0, 5.0)


def test_record_file_hashes_each_span_and_the_file(tmp_path: Path):
    import google_crc32c

    data = np.random.default_rng(0).bytes(3 * (8 << 20) + 12345)  # several read blocks, spans across them
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    spans = [Span("a", (0,), 0, 10, None), Span("b", (4, 0), (8 << 20) - 5, (8 << 20) + 9, None),
             Span("c", (1,), 100, 3 * (8 << 20), None), Span("d", (2,), len(data) - 1, 1, None),
             Span("e", (3,), 50, 0, None)]
    entry, recs = record_file(path, "f.bin", spans)
    assert entry.size == len(data) and entry.checksums == {"crc32c": f"{google_crc32c.value(data):08x}"}
    for s, r in zip(spans, recs):
        assert r.digest == xxhash.xxh3_128_hexdigest(data[s.offset:s.offset + s.length]), s.key
        assert (r.key, r.offsets, r.file, r.offset, r.length) == (s.key, s.offsets, "f.bin", s.offset, s.length)
    with pytest.raises(ValueError, match="past the file"):
        record_file(path, "f.bin", [Span("z", (0,), len(data) - 1, 2, None)])


def test_side_file_round_trip_and_refusals(tmp_path: Path):
    rec = ChunkRecord("w", (0, 4), "__0_0.distcp", 7, 9, "0" * 31 + "a",
                      ChunkStats(3, 1, 0, 0, 1, -1.0, 1.0, math.inf))
    write_records(tmp_path, [rec])
    (raw,) = json.loads((tmp_path / "gtp_chunks.json").read_text())["chunks"]
    assert raw["stats"]["sumsq"] is None  # an overflowed fp64 sum is not written as a non-JSON Infinity
    assert _record(raw) == rec
    for broken in ({**raw, "xxh3_128": "zz"}, {**raw, "offset": -1}, {**raw, "offsets": "0"},
                   {**raw, "stats": {**raw["stats"], "nan": 1.5}}, {**raw, "stats": {**raw["stats"], "min": None}},
                   {**raw, "key": 3}, [raw], {**raw, "length": struct.unpack("<q", b"\xff" * 8)[0]}):
        assert _record(broken) is None, broken
