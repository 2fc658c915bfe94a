"""Chunk records written by the runtime's save (real gloo ranks), and what ``verify`` finds with them.

Each checkpoint here is saved by :func:`gtp_runtime.checkpoint.io.save_checkpoint` on 2 gloo ranks
(GTP_remat 2, ``ffn_hidden`` 48 so fc1 has 16 tail-padding rows per TP part). The expectations are
independent of the code under test: digests are recomputed with ``xxhash`` over the byte ranges
the checkpoint's own metadata gives, statistics with numpy over the loaded elements, and damage
is made by flipping one byte of a copy.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash
from damage import flip
from dist_harness import run_ranks
from integrity_ckpts import MODEL, NAN_WEIGHT, PAR, save_all

from gtp_format.check.verify import verify
from gtp_format.integrity.stats import element_stats
from gtp_format.layout.config import ParallelConfig
from gtp_format.names import CHUNK_RECORDS_FILE, parse_optimizer_key
from gtp_format.reader.checkpoint import open_checkpoint
from gtp_format.reader.chunks import load_elements
from gtp_format.views.ours import param_views
from gtp_runtime.checkpoint.chunk_records import device_stats, tensor_stats
from gtp_runtime.checkpoint.io import save_checkpoint
from gtp_runtime.training import TrainConfig, Trainer


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return save_all(tmp_path_factory.mktemp("integrity"))


def _copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / src.parent.name / src.name
    shutil.copytree(src, dst)
    return dst


def _errors(folder: Path, check: str) -> list:
    res = verify(open_checkpoint(folder), data=True)
    return [p for p in res.problems if p.check == check and p.severity == "error"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["dist", "st"])
def test_every_chunk_has_a_record_with_its_bytes_hash_and_stats(saved: dict[str, Path], name: str):
    folder = saved[name]
    ckpt = open_checkpoint(folder)
    body = json.loads((folder / CHUNK_RECORDS_FILE).read_text())
    recs = {(r["key"], tuple(r["offsets"])): r for r in body["chunks"]}
    assert len(recs) == ckpt.chunk_count() == len(body["chunks"])
    assert ckpt.manifest is not None and CHUNK_RECORDS_FILE in (ckpt.manifest.files or {})
    for e in ckpt.entries.values():
        for c in e.chunks:
            r = recs[(e.key, c.offsets)]
            s = c.storage
            assert (r["file"], r["offset"], r["length"]) == (s.file, s.offset, s.length)
            with open(folder / s.file, "rb") as f:
                f.seek(s.offset)
                assert r["xxh3_128"] == xxhash.xxh3_128_hexdigest(f.read(s.length)), (e.key, c.index)
            values = load_elements(ckpt, e, c).reshape(-1).astype(np.float64)  # float32 and int64 keys
            st = r["stats"]
            assert st["numel"] == values.size and st["nan"] == 0 and st["zeros"] == int((values == 0).sum())
            assert st["min"] == values.min() and st["max"] == values.max()
            assert st["sumsq"] == pytest.approx(float((values * values).sum()), rel=1e-12)
    assert verify(ckpt, data=True).ok


def _first_chunk(folder: Path, key_part: str) -> tuple[str, int, dict]:
    body = json.loads((folder / CHUNK_RECORDS_FILE).read_text())
    r = next(r for r in sorted(body["chunks"], key=lambda r: (r["key"], r["offsets"])) if key_part in r["key"])
    ckpt = open_checkpoint(folder)
    c = next(c for c in ckpt.entries[r["key"]].chunks if list(c.offsets) == r["offsets"])
    return r["key"], c.index, r


@pytest.mark.slow
@pytest.mark.parametrize("name,where", [("dist", "payload"), ("dist", "zip header"), ("st", "payload")])
def test_a_flipped_byte_is_named_by_key_chunk_file_and_range(saved: dict[str, Path], tmp_path: Path, name: str,
                                                             where: str):
    folder = _copy(saved[name], tmp_path)
    key, index, r = _first_chunk(folder, ".exp_avg_sq")
    # the torch.save blob of a chunk starts with its zip record headers; the elements are its last part
    pos = r["offset"] + 40 if where == "zip header" else r["offset"] + r["length"] - 300
    flip(folder / r["file"], pos)
    (p,) = _errors(folder, "chunk_hash")
    assert (p.key, p.chunk, p.file) == (key, index, r["file"])
    assert f"[{r['offset']}, {r['offset'] + r['length']})" in p.message


@pytest.mark.slow
def test_a_damaged_record_file_is_named(saved: dict[str, Path], tmp_path: Path):
    folder = _copy(saved["dist"], tmp_path)
    raw = (folder / CHUNK_RECORDS_FILE).read_text()
    (folder / CHUNK_RECORDS_FILE).write_text(raw.replace('"xxh3_128":"', '"xxh3_128":"zz', 1))
    res = verify(open_checkpoint(folder), data=True)
    assert not res.ok
    assert any(p.check == "chunk_records" and "ill-formed" in p.message for p in res.problems)
    assert any(p.check == "checksum" and p.file == CHUNK_RECORDS_FILE for p in res.problems)


@pytest.mark.slow
@pytest.mark.parametrize("data", [False, True])
def test_a_checkpoint_saved_with_nan_is_flagged(saved: dict[str, Path], data: bool):
    res = verify(open_checkpoint(saved["nan"]), data=data)
    found = {(p.key, p.severity) for p in res.problems if p.check == "nonfinite"}
    assert (NAN_WEIGHT, "error") in found
    moments = [k for k, sev in found if (parse_optimizer_key(k) or None) and parse_optimizer_key(k).state ==
               "exp_avg_sq"]
    assert moments and all((k, "warning") in found for k in moments)
    assert not res.ok


def _pad_target(ckpt, state: str) -> tuple[str, int]:
    views = param_views(ckpt.manifest)
    for v in views.values():
        for h in v.holders:
            if h.numel > h.valid_numel:
                return h.ref.key(state), h.start + h.valid_numel
    raise AssertionError("the test model has no tail padding")


@pytest.mark.slow
@pytest.mark.parametrize("state", ["param", "exp_avg"])
def test_non_zero_padding_in_a_copy_is_reported(saved: dict[str, Path], tmp_path: Path, state: str):
    folder = _copy(saved["st"], tmp_path)  # raw elements: an element's bytes are at a computable offset
    ckpt = open_checkpoint(folder)
    assert not [p for p in verify(ckpt, data=True).problems if p.check == "tail_padding"]
    key, elem = _pad_target(ckpt, state)
    c = next(c for c in ckpt.entries[key].chunks if c.offsets[0] <= elem < c.offsets[0] + c.sizes[0])
    with open(folder / c.storage.file, "r+b") as f:
        f.seek(c.storage.offset + 4 * (elem - c.offsets[0]))
        f.write(np.float32(0.5).tobytes())
    (p,) = _errors(folder, "tail_padding")
    assert p.key == key and "1 of" in p.message


@pytest.mark.parametrize("nonfinite", [True, False], ids=["with NaN and Inf (exact path)", "finite (fast path)"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int32,
                                   torch.int64, torch.uint8, torch.bool])
def test_device_stats_agree_with_the_format_packages_numpy(dtype: torch.dtype, nonfinite: bool):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(5000, generator=g) * 100).to(dtype)
    if dtype.is_floating_point and nonfinite:
        x[[3, 17, 99]] = torch.tensor([math.nan, math.inf, -math.inf], dtype=dtype)
    x[[5, 6]] = 0
    want = tensor_stats(x)  # CPU: numpy over the tensor's bytes
    got = device_stats(x)  # the CUDA path, run here on CPU tensors
    assert (got.numel, got.nan, got.posinf, got.neginf, got.zeros, got.min, got.max) == \
        (want.numel, want.nan, want.posinf, want.neginf, want.zeros, want.min, want.max)
    assert got.sumsq == pytest.approx(want.sumsq, rel=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int32])
def test_device_stats_of_an_empty_chunk_and_an_all_zero_chunk(dtype: torch.dtype):
    for x in (torch.empty(0, dtype=dtype), torch.zeros(300, dtype=dtype)):
        want, got = tensor_stats(x), device_stats(x)
        assert got == want  # no range for no values; the sums are exact (0.0) for zeros


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_stats_on_cuda_match_cpu():
    x = torch.randn(1 << 20, dtype=torch.bfloat16)
    x[7] = math.nan
    got, want = device_stats(x.cuda()), tensor_stats(x)
    assert got is not None and want is not None
    assert (got.numel, got.nan, got.zeros, got.min, got.max) == (want.numel, want.nan, want.zeros, want.min, want.max)
    assert got.sumsq == pytest.approx(want.sumsq, rel=1e-12)  # fp64 sums in another order


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_save_of_cuda_chunks_takes_their_statistics_on_the_device(monkeypatch: pytest.MonkeyPatch):
    """The save's dispatch (:func:`start_state_stats`): CUDA chunks are reduced on the GPU before any
    copy (numpy is never called on them) and give the CPU path's figures."""
    import gtp_runtime.checkpoint.chunk_records as chunk_records
    from gtp_runtime.checkpoint.dcp_chunks import Chunks

    g = torch.Generator().manual_seed(2)
    host = {(0,): torch.randn(3000, generator=g), (3000,): torch.zeros(1000)}
    host[(0,)][[1, 2]] = torch.tensor([math.nan, -math.inf])
    c = Chunks((4000,), torch.float32)
    for off, t in host.items():
        c.add(off, t.cuda())
    monkeypatch.setattr(chunk_records, "element_stats", lambda *a: pytest.fail("numpy ran on a CUDA chunk"))
    got = chunk_records.start_state_stats({"w": c})()
    monkeypatch.undo()
    for off, t in host.items():
        want, have = tensor_stats(t), got[("w", off)]
        assert (have.numel, have.nan, have.neginf, have.zeros, have.min, have.max) == \
            (want.numel, want.nan, want.neginf, want.zeros, want.min, want.max)
        assert have.sumsq == pytest.approx(want.sumsq, rel=1e-12)


def _save_with_corrupt_replica(root: str, bad_rank: int) -> str:
    """One rank: a save where ``bad_rank``'s copy of a replicated chunk has one flipped bit."""
    import os

    from gtp_runtime.checkpoint.errors import CheckpointError
    from gtp_runtime.checkpoint.replicas import FAULT_ENV

    os.environ[FAULT_ENV] = str(bad_rank)
    t = Trainer(TrainConfig(par=ParallelConfig(gtp_remat=2, dp=2), model=MODEL, micro_batch=1, bucket_size=100000))
    t.iteration = 1
    try:
        save_checkpoint(t, root)
    except CheckpointError as e:
        return str(e)
    return "saved"


@pytest.mark.slow
@pytest.mark.parametrize("bad_rank", [0, 3])
def test_a_replica_corrupted_on_one_rank_fails_that_save_on_every_rank(tmp_path: Path, bad_rank: int):
    messages = run_ranks(4, _save_with_corrupt_replica, str(tmp_path), bad_rank)
    assert len(set(messages)) == 1, messages  # every rank reaches the same verdict
    (msg,) = set(messages)
    assert msg.startswith("save refused: ") and f"ranks [{bad_rank}] differ" in msg, msg
    key = msg.removeprefix("save refused: ").split(" at offsets")[0]
    assert key.startswith(("decoder.", "embedding.", "output_layer.")), key  # a model parameter (replicated)
    assert not list(tmp_path.glob("iter_*")) and not (tmp_path / "latest_checkpointed_iteration.txt").exists()


def _save_reading_nothing_back(root: str) -> tuple[int, int]:
    """One rank: a torch_dist save with two files per rank; returns how many files were read back and how
    many chunks' statistics were taken from their tensors instead of from the sink as it wrote them."""
    import gtp_runtime.checkpoint.chunk_records as chunk_records

    reads, apart = [], []
    real, real_stats = chunk_records.record_file, chunk_records.tensor_stats
    chunk_records.record_file = lambda *a, **k: (reads.append(a[1]), real(*a, **k))[1]  # type: ignore[assignment]
    chunk_records.tensor_stats = lambda t: (apart.append(t.shape), real_stats(t))[1]  # type: ignore[assignment]
    try:
        t = Trainer(TrainConfig(par=PAR, model=MODEL, micro_batch=1, bucket_size=100000))
        t.iteration = 1
        save_checkpoint(t, root, writer_threads=2)
    finally:
        chunk_records.record_file = real  # type: ignore[assignment]
        chunk_records.tensor_stats = real_stats  # type: ignore[assignment]
    return len(reads), len(apart)


@pytest.mark.slow
def test_records_hashed_as_written_equal_the_read_back_of_the_same_files(tmp_path: Path):
    """The sink's records (hashed on the way out, nothing read back) are bit-identical to the records
    :func:`record_file` computes by reading the committed files, the path every save took before."""
    from torch.distributed.checkpoint import FileSystemReader

    from gtp_format.integrity.record_file import record_file
    from gtp_format.integrity.records import read_records
    from gtp_runtime.checkpoint.chunk_records import _spans

    assert run_ranks(PAR.world_size, _save_reading_nothing_back, str(tmp_path)) == [(0, 0), (0, 0)]
    folder = tmp_path / "iter_0000001"
    ckpt = open_checkpoint(folder)
    saved = read_records(ckpt)
    assert saved is not None and not saved.problems and len(saved.by_chunk) == ckpt.chunk_count()
    files = sorted(p.name for p in folder.glob("__*.distcp"))
    assert len(files) == 2 * PAR.world_size
    stats = {k: r.stats for k, r in saved.by_chunk.items()}  # statistics come from the tensors either way
    metadata = FileSystemReader(folder).read_metadata()
    again = {}
    for rel, spans in _spans(folder, "torch_dist", metadata.storage_data, files, stats).items():
        entry, recs = record_file(folder / rel, rel, spans)
        assert entry == ckpt.manifest.files[rel]  # the CRC-32C computed as written is the file's
        again.update({(r.key, r.offsets): r for r in recs})
    assert again == saved.by_chunk
    # the statistics the sink took piece by piece are, bit for bit, those of the chunk's stored elements
    for e in ckpt.entries.values():
        for c in e.chunks:
            raw = load_elements(ckpt, e, c)
            assert saved.by_chunk[(e.key, c.offsets)].stats == element_stats(raw, e.dtype), (e.key, c.offsets)


def test_the_sink_watches_only_writes_it_can_tell_apart():
    """:class:`SinkStats` knows a chunk's write by its address and length: memory saved under two dtypes (which
    one a write is cannot be told) and non-contiguous or empty chunks are not watched, and every chunk still gets
    its own dtype's statistics from its tensor after the write."""
    from gtp_runtime.checkpoint.chunk_records import SinkStats
    from gtp_runtime.checkpoint.dcp_chunks import Chunks

    buf = torch.arange(8, dtype=torch.float32)
    parts = {"f": (torch.float32, buf), "i": (torch.int32, buf.view(torch.int32)),
             "own": (torch.float32, torch.ones(4)), "t": (torch.float32, torch.ones(3, 2).t()),
             "empty": (torch.float32, torch.empty(0))}
    sd = {}
    for key, (dtype, t) in parts.items():
        sd[key] = Chunks(tuple(t.shape), dtype)
        sd[key].add((0,) * t.dim(), t)
    sink = SinkStats(sd)
    assert [cids for _, cids in sink._want.values()] == [[("own", (0,))]]
    got = sink.collect()
    for key, (_, t) in parts.items():
        assert got[(key, (0,) * t.dim())] == tensor_stats(t), key
