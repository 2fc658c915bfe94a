"""The indexed-dataset reader against genuine megatron-core files, hostile indexes, and the sampler
against a brute-force token stream."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gtp_runtime.data.indexed import (
    FLAT_DOC_TOKENS,
    HEADER_BYTES,
    DataError,
    TokenFile,
    open_dataset,
    read_flat,
    read_index,
)
from gtp_runtime.data.sampler import GPTSamples, split_documents
from gtp_runtime.data.writer import write_dataset

FIX = Path(__file__).resolve().parents[2] / "fixtures" / "megatron" / "indexed"
EXPECTED = json.loads((FIX / "expected.json").read_text())["datasets"]


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_reads_what_megatron_core_wrote(name):
    e = EXPECTED[name]
    ds = read_index(FIX / name)
    assert str(ds.tokens.dtype) == e["dtype"]
    assert ds.lengths.tolist() == e["sequence_lengths"]
    assert ds.doc_index.tolist() == e["document_indices"]
    assert (ds.starts * ds.tokens.dtype.itemsize).tolist() == e["sequence_pointers"]
    assert [ds.tokens[s : s + n].tolist() for s, n in zip(ds.starts, ds.lengths)] == e["sequences"]
    assert isinstance(ds.tokens, TokenFile)  # read on demand, not copied (nor mapped)


@pytest.mark.parametrize("name", ["bytes_uint8", "tokens_int32"])  # one sequence per document
def test_writer_matches_megatron_core_byte_for_byte(name, tmp_path):
    e = EXPECTED[name]
    write_dataset(tmp_path / name, [np.array(s) for s in e["sequences"]], np.dtype(e["dtype"]).type)
    for ext in (".bin", ".idx"):
        assert (tmp_path / (name + ext)).read_bytes() == (FIX / (name + ext)).read_bytes()


def _copy(tmp_path, name="tokens_uint16") -> Path:
    for ext in (".bin", ".idx"):
        (tmp_path / (name + ext)).write_bytes((FIX / (name + ext)).read_bytes())
    return tmp_path / name


def _patch(prefix: Path, offset: int, data: bytes) -> None:
    raw = bytearray((prefix.parent / (prefix.name + ".idx")).read_bytes())
    raw[offset : offset + len(data)] = data
    (prefix.parent / (prefix.name + ".idx")).write_bytes(bytes(raw))


def _refused(prefix: Path, *words: str) -> str:
    with pytest.raises(DataError) as ei:
        read_index(prefix)
    msg = str(ei.value)
    assert "\n" not in msg and str(prefix.name) in msg
    for w in words:
        assert w in msg, msg
    return msg


N_SEQ = len(EXPECTED["tokens_uint16"]["sequence_lengths"])
LENGTHS_AT, POINTERS_AT = HEADER_BYTES, HEADER_BYTES + 4 * N_SEQ
DOCS_AT = HEADER_BYTES + 12 * N_SEQ


@pytest.mark.parametrize("offset,data,words", [
    (0, b"MMIDIDY", ["not a Megatron indexed dataset"]),
    (9, struct.pack("<Q", 2), ["version 2"]),
    (17, b"\x00", ["unknown dtype code 0"]),
    (17, b"\x09", ["unknown dtype code 9"]),
    (17, b"\x06", ["float64", "cannot hold token ids"]),
    (18, struct.pack("<Q", 2**63), ["declares", "truncated"]),  # overlong sequence count
    (26, struct.pack("<Q", 2**40), ["declares"]),  # overlong document count
    (LENGTHS_AT + 4 * 3, struct.pack("<i", 10**9), ["sequence 3", "outside"]),  # overlong size
    (LENGTHS_AT, struct.pack("<i", -1), ["sequence 0", "outside"]),
    (POINTERS_AT + 8 * 5, struct.pack("<q", 10**12), ["sequence 5", "outside"]),  # pointer past the end
    (POINTERS_AT + 8 * 5, struct.pack("<q", -2), ["sequence 5"]),
    (POINTERS_AT + 8 * 5, struct.pack("<q", 3), ["sequence 5"]),  # not on a token boundary
    (DOCS_AT, struct.pack("<q", 1), ["document indices must run from 0"]),
    (DOCS_AT + 8 * 3, struct.pack("<q", 10**6), ["document indices"]),
])
def test_hostile_index_is_refused(tmp_path, offset, data, words):
    prefix = _copy(tmp_path)
    _patch(prefix, offset, data)
    _refused(prefix, *words)


def test_truncated_files_are_refused_at_every_length(tmp_path):
    prefix = _copy(tmp_path)
    raw = (FIX / "tokens_uint16.idx").read_bytes()
    for cut in range(len(raw)):
        (tmp_path / "tokens_uint16.idx").write_bytes(raw[:cut])
        _refused(prefix)
    (tmp_path / "tokens_uint16.idx").write_bytes(raw)
    binary = (FIX / "tokens_uint16.bin").read_bytes()
    (tmp_path / "tokens_uint16.bin").write_bytes(binary[:-2])  # last sequence runs past the end
    _refused(prefix, "outside")
    (tmp_path / "tokens_uint16.bin").write_bytes(binary + b"\x00")  # half a token
    _refused(prefix, "whole number")


def test_missing_and_irregular_files(tmp_path):
    prefix = _copy(tmp_path)
    (tmp_path / "tokens_uint16.bin").unlink()
    (tmp_path / "tokens_uint16.bin").mkdir()
    _refused(prefix, "not a regular file")
    (tmp_path / "tokens_uint16.bin").rmdir()
    _refused(prefix, "cannot read")
    with pytest.raises(DataError, match="neither"):
        open_dataset(tmp_path / "nothing")


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 700), st.integers(0, 255)), min_size=1, max_size=6))
def test_random_corruption_is_refused_or_stays_in_bounds(tmp_path_factory, edits):
    """Whatever bytes an index holds, the reader refuses it or every sequence lies inside .bin."""
    tmp = tmp_path_factory.mktemp("fuzz")
    prefix = _copy(tmp)
    raw = bytearray((FIX / "tokens_uint16.idx").read_bytes())
    for pos, val in edits:
        raw[pos % len(raw)] = val
    (tmp / "tokens_uint16.idx").write_bytes(bytes(raw))
    try:
        ds = read_index(prefix)
    except DataError as e:
        assert "\n" not in str(e)
        return
    ends = ds.starts + ds.lengths.astype(np.int64)
    assert (ds.starts >= 0).all() and (ends <= len(ds.tokens)).all()
    assert ds.doc_index[0] == 0 and ds.doc_index[-1] == len(ds.lengths) and (np.diff(ds.doc_index) >= 0).all()


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_flat_token_file(tmp_path, dtype):
    tokens = np.arange(FLAT_DOC_TOKENS * 2 + 77, dtype=dtype) % 50_000
    (tmp_path / "flat.bin").write_bytes(tokens.tobytes())
    ds = open_dataset(tmp_path / "flat.bin", dtype)
    assert ds.num_documents == 3 and ds.lengths.tolist() == [FLAT_DOC_TOKENS, FLAT_DOC_TOKENS, 77]
    assert np.array_equal(np.asarray(ds.tokens), tokens)
    (tmp_path / "odd.bin").write_bytes(tokens.tobytes()[:-1])
    with pytest.raises(DataError, match="whole number"):
        read_flat(tmp_path / "odd.bin", dtype)
    (tmp_path / "empty.bin").write_bytes(b"")
    with pytest.raises(DataError, match="empty"):
        read_flat(tmp_path / "empty.bin", dtype)


def _brute_stream(ds, lo, hi, order):
    seqs = [s for d in range(lo, hi) for s in range(ds.doc_index[d], ds.doc_index[d + 1])]
    seqs = [s for s in seqs if ds.lengths[s] > 0]
    out: list[int] = []
    for i in order:
        s = seqs[i]
        out += ds.tokens[ds.starts[s] : ds.starts[s] + ds.lengths[s]].tolist()
    return out


@settings(max_examples=40, deadline=None)
@given(seq_length=st.integers(1, 40), seed=st.integers(0, 2**31), shuffle=st.booleans())
def test_samples_match_brute_force_stream(seq_length, seed, shuffle):
    ds = read_index(FIX / "tokens_uint16")
    s = GPTSamples(ds, 0, ds.num_documents, seq_length, seed, shuffle=shuffle)
    n = s.samples_per_epoch
    assert n == (sum(EXPECTED["tokens_uint16"]["sequence_lengths"]) - 1) // seq_length
    for k in list(range(min(n, 5))) + [n, n + 1, 2 * n + 3]:  # across epochs too
        epoch, j = divmod(k, n)
        order, _, samples = s._epoch_index(epoch)
        stream = _brute_stream(ds, 0, ds.num_documents, order)
        start = int(samples[j]) * seq_length
        assert s.sample(k).tolist() == stream[start : start + seq_length + 1]
    if shuffle:
        other = GPTSamples(ds, 0, ds.num_documents, seq_length, seed + 1)
        assert any(not np.array_equal(other.sample(k), s.sample(k)) for k in range(min(n, 8)))


def test_same_seed_same_samples_and_splits_are_disjoint():
    ds = read_index(FIX / "tokens_uint16")
    (t0, t1), (v0, v1) = split_documents(ds.num_documents, (3, 1))
    assert (t0, t1, v0, v1) == (0, 12, 12, 16)
    a, b = GPTSamples(ds, t0, t1, 8, 5), GPTSamples(ds, t0, t1, 8, 5)
    assert np.array_equal(a.batch(0, 10), b.batch(0, 10))
    assert np.array_equal(a.batch(3, 4), a.batch(0, 10)[3:7])  # a batch is its samples, wherever it starts
    train_tokens = set(_brute_stream(ds, t0, t1, range(t1 - t0)))
    valid = GPTSamples(ds, v0, v1, 8, 0, shuffle=False)
    valid_stream = _brute_stream(ds, v0, v1, range(ds.doc_index[v1] - ds.doc_index[v0]))
    assert valid.sample(0).tolist() == valid_stream[:9]
    assert not set(valid_stream) <= train_tokens  # other documents (random tokens of 50,000 ids)


def test_too_little_data_is_one_line():
    ds = read_index(FIX / "bytes_uint8")
    with pytest.raises(DataError, match="fewer than one sample"):
        GPTSamples(ds, 0, 1, 64, 0)
