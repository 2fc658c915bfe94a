"""The reshard writers' one pass over each chunk's bytes, against brute force.

* ``write_distcp``/``write_safetensors`` hash, count and stage each chunk in the sink's pieces: the
  file must hold exactly the blobs ``tensor_blob`` makes of the same elements, and each record its
  bytes' hash and the statistics :func:`element_stats` gives (chunks across pieces, NaN, bf16, int64);
* a CRC-32 the caller passes (a chunk copied unchanged) is the one written, and when it is the bytes'
  own the file is the same;
* ``Source.copied_crc`` answers only for a box that is a stored chunk's whole payload, and then with
  the CRC-32 of exactly the bytes the copy returned;
* more writer threads than workers leave every output file the same (same files, same bytes);
* the read-ahead of an export's file hands every chunk in order, never refills a buffer still in use,
  raises a read's error where its chunk is asked for, stays within the budget, changes no byte.
"""

from __future__ import annotations

import json
import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from ckpt_tool.copying import ahead as ahead_mod
from ckpt_tool.copying import engine
from ckpt_tool.copying.ahead import ReadAhead, ahead_depth
from ckpt_tool.copying.engine import chunk_data, copied_crc, write_threads
from ckpt_tool.copying.plan import OutChunk, plan_target
from ckpt_tool.copying.source import Buffers, open_source
from ckpt_tool.copying.writers import write_distcp, write_safetensors
from ckpt_tool.export import engine as export_mod
from ckpt_tool.export.engine import export
from ckpt_tool.reshard.engine import reshard, target_manifest
from gtp_format.dtypes import by_name
from gtp_format.errors import FormatError
from gtp_format.integrity.hash import chunk_digest
from gtp_format.integrity.stats import element_stats
from gtp_format.layout.config import ParallelConfig as P
from gtp_format.scan import carrier
from gtp_format.views.ours import param_views
from gtp_format.writer import torch_blob
from gtp_format.writer.sink import PIECE
from gtp_format.writer.torch_blob import tensor_blob

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "gtp"
SID = "7" * 40


@pytest.fixture
def fixed_sid(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch_blob, "new_serialization_id", lambda: SID)


def _chunks(empty: bool = False) -> list[tuple[OutChunk, np.ndarray]]:
    """Chunks across pieces, with NaN, Inf and -0.0, bf16 bits, int64; ``empty``: a 0-element one too
    (safetensors only: torch.save writes no data record for it)."""
    rng = np.random.default_rng(5)
    f32 = rng.standard_normal(PIECE // 4 * 3 + 77).astype(np.float32)  # across three pieces, a partial one
    f32[10], f32[PIECE // 4 + 3], f32[-1] = np.nan, np.inf, -0.0
    bf16 = rng.integers(0, 1 << 16, size=(300, 7), dtype=np.uint16)
    i64 = rng.integers(-(1 << 40), 1 << 40, size=PIECE // 8 + 5, dtype=np.int64)
    zero = np.zeros((0, 4), dtype=np.float32)
    out = []
    cases = ((f32, "float32"), (bf16, "bfloat16"), (i64, "int64"), (zero, "float32"))
    for i, (arr, name) in enumerate(cases[:4 if empty else 3]):
        dt = by_name(name)
        out.append((OutChunk(f"k{i}", (0,) * arr.ndim, arr.shape, dt), arr.view(carrier(dt))))
    return out


def test_distcp_is_the_blobs_and_records_are_the_bytes(tmp_path: Path, fixed_sid: None) -> None:
    chunks = _chunks()
    data = {c.key: a for c, a in chunks}
    records: list = []
    path = tmp_path / "__0_0.distcp"
    entry, placed = write_distcp(path, [c for c, _ in chunks], lambda c: data[c.key], lambda n: None, 3 << 20, records)
    blobs = [tensor_blob(c.dtype, c.sizes, a.reshape(-1).view(np.uint8), SID) for c, a in chunks]
    raw = path.read_bytes()
    assert raw == b"".join(blobs)
    assert entry.size == len(raw)
    pos = 0
    for (c, a), blob, (pc, off, length), rec in zip(chunks, blobs, placed, records):
        assert (pc, off, length) == (c, pos, len(blob))
        assert (rec.key, rec.offset, rec.length, rec.digest) == (c.key, pos, len(blob), chunk_digest(blob))
        assert rec.stats == element_stats(a, c.dtype)
        pos += len(blob)


def test_safetensors_records_are_the_bytes(tmp_path: Path) -> None:
    chunks = _chunks(empty=True)
    data = {c.key: a for c, a in chunks}
    records: list = []
    path = tmp_path / "__0_0.safetensors"
    write_safetensors(path, [c for c, _ in chunks], lambda c: data[c.key], lambda n: None, 3 << 20, records)
    raw = path.read_bytes()
    for (c, a), rec in zip(chunks, records):
        body = a.reshape(-1).view(np.uint8).tobytes()
        assert raw[rec.offset:rec.offset + rec.length] == body
        assert rec.digest == chunk_digest(body)
        assert rec.stats == element_stats(a, c.dtype)


def test_a_known_crc_is_the_one_written(tmp_path: Path, fixed_sid: None) -> None:
    chunks = _chunks()
    data = {c.key: a for c, a in chunks}
    own = {c.key: zlib.crc32(a.reshape(-1).view(np.uint8)) for c, a in chunks}
    ref, same, other = tmp_path / "ref", tmp_path / "same", tmp_path / "other"
    write_distcp(ref, [c for c, _ in chunks], lambda c: data[c.key], lambda n: None)
    write_distcp(same, [c for c, _ in chunks], lambda c: data[c.key], lambda n: None, known_crc=lambda c: own[c.key])
    assert same.read_bytes() == ref.read_bytes()
    write_distcp(other, [c for c, _ in chunks], lambda c: data[c.key], lambda n: None,
                 known_crc=lambda c: own[c.key] ^ 1)
    assert other.read_bytes() != ref.read_bytes()  # it is used, not computed again


@pytest.mark.parametrize("fixture", ["fold_cp2_g2_dp2", "fold_cp2_g2_dp2_st"])
def test_copied_crc_is_the_crc_of_what_was_copied(fixture: str) -> None:
    source = open_source(FIXTURES / fixture)
    target = source.manifest
    for par in (P(cp=2, gtp_remat=2, dp=2), P(cp=2, gtp_remat=2, fold_cp=True)):
        target = target_manifest(source.manifest, par, "torch_dist")
        plan = plan_target(target, 1 << 16, param_views(target))
        bufs, answered, total = Buffers(), 0, 0
        for c in plan.chunks:
            arr = np.ascontiguousarray(chunk_data(source, c, bufs))
            got = copied_crc(source, c)
            total += c.param is not None
            if got is not None:
                answered += 1
                assert got == zlib.crc32(arr.reshape(-1).view(np.uint8)), c
        if fixture.endswith("_st"):
            assert answered == 0  # safetensors chunks have no zip record
        else:
            assert 0 < answered < total
    source.verify_reads()
    source.reader.close()


def _cores(monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    """This process runs on ``n`` CPUs (``engine.cores``: the affinity, at most ``os.cpu_count``)."""
    monkeypatch.setattr(os, "cpu_count", lambda: n)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(n)), raising=False)


def test_cores_follow_the_affinity(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under ``taskset -c 0,1`` on a 16-CPU host a copy sizes its threads for 2 cores, not 16."""
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert engine.cores() == 2 and engine.default_workers() == 2
    assert write_threads(2, 1 << 20, 1 << 30) == 2
    assert ahead_depth(2 << 30, engine.default_workers(), 64 << 20, engine.cores()) == 0


def test_more_threads_than_workers_write_the_same_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        fixed_sid: None) -> None:
    src = FIXTURES / "fold_cp2_g2_dp2"
    outs = []
    for cores in (1, 16):
        _cores(monkeypatch, cores)
        assert write_threads(2, 1 << 20, 1 << 30) == (2 if cores == 1 else 4)
        dst = tmp_path / f"c{cores}"
        reshard(src, dst, P(cp=2, gtp_remat=2, dp=2), "torch_dist", workers=2)
        outs.append({p.relative_to(dst): p.read_bytes() for p in sorted(dst.rglob("*")) if p.is_file()})
    assert outs[0].keys() == outs[1].keys() and len([k for k in outs[0] if k.suffix == ".distcp"]) == 4
    per_run = ("metadata.json", "gtp_attestation.json", "gtp_manifest.json")  # times and the writer's lineage
    assert all(outs[0][k] == outs[1][k] for k in outs[0] if k.name not in per_run), \
        [k for k in outs[0] if outs[0][k] != outs[1][k]]
    manifests = [json.loads(o[next(k for k in o if k.name == "gtp_manifest.json")]) for o in outs]
    for m in manifests:
        m.get("extra", {}).pop("lineage", None)
        m.pop("lineage", None)
        for name in per_run:
            m.get("files", {}).pop(name, None)
    assert manifests[0] == manifests[1]


def test_threads_stay_within_the_memory_budget() -> None:
    # four chunks a thread: at 16 MiB chunks, 256 MiB holds 4 threads whatever the cores
    assert write_threads(4, 16 << 20, 256 << 20) <= max(4, (256 << 20) // (4 * (16 << 20)))
    assert write_threads(4, 64 << 20, 2 << 30) <= 8


def test_read_ahead_hands_each_chunk_in_order_and_never_overwrites_one_in_use() -> None:
    chunks = [OutChunk(f"k{i}", (0,), (4,), by_name("float32")) for i in range(7)]

    def fill(c: OutChunk, slot: object) -> np.ndarray:
        arr = slot.out.get(16).view(np.float32)  # type: ignore[attr-defined]
        arr[:] = int(c.key[1:])
        return arr

    with ThreadPoolExecutor(3) as pool:
        for depth in (0, 1, 2):
            ahead = ReadAhead(pool, fill, chunks, depth)
            for i, c in enumerate(chunks):
                arr = ahead(c)
                for f in list(ahead.pending):
                    f.result()  # every read started ahead has landed: none of them in this chunk's buffer
                assert (arr == i).all(), (depth, i)
            with pytest.raises(AssertionError):
                ahead(chunks[0])


def test_read_ahead_raises_a_read_error_where_its_chunk_is_asked_for() -> None:
    chunks = [OutChunk(f"k{i}", (0,), (4,), by_name("float32")) for i in range(3)]

    def fill(c: OutChunk, slot: object) -> np.ndarray:
        if c.key == "k1":
            raise FormatError("k1: damaged")
        return np.zeros(4, np.float32)

    with ThreadPoolExecutor(2) as pool:
        ahead = ReadAhead(pool, fill, chunks, 1)
        ahead(chunks[0])
        with pytest.raises(FormatError, match="k1: damaged"):
            ahead(chunks[1])


def test_read_ahead_only_where_the_budget_has_room() -> None:
    assert ahead_depth(4 * 2 * (16 << 20), 2, 16 << 20, 16) == 0  # the budget's own four chunks a worker
    assert ahead_depth(2 << 30, 4, 64 << 20, 16) == 1
    assert ahead_depth(2 << 30, 4, 64 << 20, 8) == 0  # no core left: each file has two threads already
    assert ahead_depth(2 << 30, 16, 32 << 20, 64) == 0  # 4 chunks a worker: no room


def test_export_hf_with_and_without_read_ahead_writes_the_same_files(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    outs, asked = [], []

    class Counted(ReadAhead):
        def __call__(self, c: OutChunk) -> np.ndarray:
            asked.append(c.key)
            return super().__call__(c)

    monkeypatch.setattr(export_mod, "ReadAhead", Counted)
    _cores(monkeypatch, 16)
    for depth in (0, 1):
        monkeypatch.setattr(ahead_mod, "MAX_AHEAD", depth)
        dst = tmp_path / f"d{depth}"
        export(FIXTURES / "fold_cp2_g2_dp2", dst, "hf", optimizer=True, workers=2)  # default budget: room for one
        outs.append({p.name: p.read_bytes() for p in sorted(dst.iterdir())})
        assert bool(asked) == bool(depth)
    assert outs[0] == outs[1]
