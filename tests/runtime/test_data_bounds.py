"""The data reader's arrays are bounded by bytes the files really store (issue 22, class 3).

Three crafted inputs made per-sequence, per-document and per-sample arrays of gigabytes: a sparse
``.idx`` declaring 3e8 sequences, a 16 TiB sparse flat ``.bin``, and sequences that overlap (each
in bounds, together a million times the ``.bin``). Each is now one :class:`DataError` line naming
the file, before any array is built; genuine datasets and unordered but disjoint indexes still
read (checked against a brute-force overlap test with hypothesis).
"""

from __future__ import annotations

import os
import resource
import struct
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sparse_files import grow_sparse

from gtp_runtime.data.indexed import HEADER_BYTES, INDEX_HEADER, DataError, open_dataset, read_index
from gtp_runtime.data.sampler import GPTSamples
from gtp_runtime.data.writer import write_dataset


def _index(path: Path, lengths: list[int], pointers: list[int], docs: list[int], code: int = 8) -> None:
    head = INDEX_HEADER + struct.pack("<QBQQ", 1, code, len(lengths), len(docs))
    path.write_bytes(head + np.array(lengths, np.int32).tobytes() + np.array(pointers, np.int64).tobytes()
                     + np.array(docs, np.int64).tobytes())


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def test_sparse_idx_declaring_3e8_sequences(tmp_path: Path) -> None:
    n = 300_000_000
    with open(tmp_path / "d.idx", "wb") as f:
        f.write(INDEX_HEADER + struct.pack("<QBQQ", 1, 8, n, 2))
        f.truncate(HEADER_BYTES + 12 * n + 16)  # the declared size, all holes
    (tmp_path / "d.bin").write_bytes(b"\0" * 64)
    before, t0 = _rss_mb(), time.monotonic()
    with pytest.raises(DataError) as info:
        read_index(tmp_path / "d")
    assert time.monotonic() - t0 < 5 and _rss_mb() - before < 100
    assert "d.idx" in str(info.value) and "sparse" in str(info.value) and "\n" not in str(info.value)


def test_sparse_flat_bin_of_16_tib(tmp_path: Path) -> None:
    path = tmp_path / "tokens.bin"
    assert grow_sparse(path, 16 << 40) > 1 << 40
    before = _rss_mb()
    with pytest.raises(DataError) as info:
        open_dataset(path)
    assert _rss_mb() - before < 100
    assert "tokens.bin" in str(info.value) and "sparse" in str(info.value)


def test_overlapping_sequences_are_refused(tmp_path: Path) -> None:
    n = 100_000  # each names the whole 64 KiB .bin: an epoch would be 100,000 times the file
    (tmp_path / "d.bin").write_bytes(np.arange(32768, dtype=np.uint16).tobytes())
    _index(tmp_path / "d.idx", [32768] * n, [0] * n, [0, n])
    with pytest.raises(DataError) as info:
        read_index(tmp_path / "d")
    assert "overlap" in str(info.value) and "d.idx" in str(info.value)


def test_disjoint_out_of_order_sequences_still_read(tmp_path: Path) -> None:
    (tmp_path / "d.bin").write_bytes(np.arange(30, dtype=np.uint16).tobytes())
    _index(tmp_path / "d.idx", [10, 10, 10], [40, 0, 20], [0, 3])
    ds = read_index(tmp_path / "d")
    assert ds.starts.tolist() == [20, 0, 10]
    samples = GPTSamples(ds, 0, 1, 4, seed=0)
    assert samples.tokens_per_epoch == 30


def test_genuine_dataset_still_reads(tmp_path: Path) -> None:
    write_dataset(tmp_path / "g", [np.arange(n, dtype=np.uint16) for n in (5, 0, 7, 3)], np.uint16)
    assert read_index(tmp_path / "g").lengths.tolist() == [5, 0, 7, 3]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 8)), min_size=1, max_size=12))
def test_overlap_check_matches_brute_force(tmp_path_factory: pytest.TempPathFactory,
                                           seqs: list[tuple[int, int]]) -> None:
    folder = tmp_path_factory.mktemp("ov")
    (folder / "d.bin").write_bytes(bytes(2 * 48))  # 48 uint16 tokens: every sequence is in bounds
    pointers, lengths = [2 * p for p, _ in seqs], [n for _, n in seqs]
    _index(folder / "d.idx", lengths, pointers, [0, len(seqs)])
    owner: dict[int, int] = {}
    overlap = False
    for i, (p, n) in enumerate(seqs):
        for tok in range(p, p + n):
            overlap |= tok in owner
            owner[tok] = i
    if overlap:
        with pytest.raises(DataError, match="overlap"):
            read_index(folder / "d")
    else:
        assert read_index(folder / "d").lengths.tolist() == lengths


def test_sparse_check_spares_small_and_dense_files(tmp_path: Path) -> None:
    path = tmp_path / "small.bin"
    with open(path, "wb") as f:
        f.truncate(512 << 10)  # under the 1 MiB slack: holes in a small file cost nothing
    assert open_dataset(path).num_tokens == 256 << 10
    os.remove(path)


def test_a_bin_that_shrinks_under_the_reader_is_one_line_not_sigbus(tmp_path: Path) -> None:
    """The ``.bin`` truncated after it was opened (a dataset rewritten under a running job): a memory map
    killed the process with SIGBUS at the first batch past the new end; ``pread`` comes back short."""
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 50_000, int(n), dtype=np.uint16) for n in rng.integers(10, 400, 200)]
    write_dataset(tmp_path / "d", docs, np.uint16)
    ds = read_index(tmp_path / "d")
    samples = GPTSamples(ds, 0, ds.num_documents, 16, seed=0)
    whole = np.asarray(ds.tokens).astype(np.int64)
    first = samples.batch(0, 64)
    # the batch equals a gather from every token read whole (the runs of neighbouring elements are right)
    flat = np.concatenate([whole[s : s + n] for s, n in zip(ds.starts, ds.lengths)])
    assert first.shape == (64, 17) and np.isin(first, flat).all()
    assert np.array_equal(ds.tokens[np.array([[5, 3, 900], [4000, 6, 5]])], whole[[[5, 3, 900], [4000, 6, 5]]])
    assert np.array_equal(ds.tokens[10:20], whole[10:20]) and ds.tokens[7] == whole[7]
    os.truncate(tmp_path / "d.bin", 64)
    with pytest.raises(DataError) as info:
        samples.batch(0, samples.samples_per_epoch)
    msg = str(info.value)
    assert "d.bin" in msg and "shrank" in msg and "\n" not in msg, msg
