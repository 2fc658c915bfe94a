"""``ckpt migrate-aliased`` on the real aliased fixture (fixtures/gtp/aliased_cp2_g2_dp2).

The fixture is the pre-fix writer's save of the same run as fixtures/gtp/fold_cp2_g2_dp2 (same
init, data and steps), so the correct checkpoint is the ground truth for what was lost: surviving
and rebuilt chunks must match it bit for bit, reset moments must be zero. Every test migrates a
copy under tmp_path; SRC is hashed before and after.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from cli_helpers import assert_error_line, cli, snapshot

from gtp_format.layout.config import ParallelConfig
from gtp_format.layout.topology import Topology
from gtp_format.model import Checkpoint
from gtp_format.names import STATES, distcp_writer_rank, parse_optimizer_key
from gtp_format.reader.checkpoint import open_checkpoint
from gtp_format.reader.chunks import load_chunk

ROOT = Path(__file__).resolve().parents[2]
ALIASED = ROOT / "fixtures" / "gtp" / "aliased_cp2_g2_dp2"
CORRECT = ROOT / "fixtures" / "gtp" / "fold_cp2_g2_dp2"
ITER = "iter_0000002"
PAR = ParallelConfig(cp=2, gtp_remat=2, dp=2, fold_cp=True)
MODEL_FLAGS = ["--hidden", "32", "--num-layers", "2", "--num-heads", "4", "--ffn-hidden", "64", "--seq-length", "16",
               "--vocab-size", "128", "--micro-batch", "1", "--bucket-size", "4000"]

pytestmark = pytest.mark.skipif(not (ALIASED / ITER).is_dir() or not (CORRECT / ITER).is_dir(),
                                reason="run python fixtures/make_fixtures.py to generate fixtures/gtp")


def _copy(dst: Path) -> Path:
    shutil.copytree(ALIASED, dst, symlinks=True)
    return dst


def _aliased_keys(ckpt: Checkpoint) -> list[str]:
    return [k for k in ckpt.entries if (o := parse_optimizer_key(k)) is not None and o.cp_rank is None
            and o.gbuf_idx == 0]


def _expected_survivors(ckpt: Checkpoint) -> dict[tuple[str, tuple[int, ...]], int]:
    """(aliased key, offsets) -> CP rank of the writer, worked out here independently of ckpt_tool."""
    grid = Topology(PAR)
    out = {}
    for key in _aliased_keys(ckpt):
        for c in ckpt.entries[key].chunks:
            out[(key, c.offsets)] = grid.coords(distcp_writer_rank(c.storage.file)).cp
    return out


@pytest.fixture(scope="module")
def migrated(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """One migration of the fixture (parent form), shared by the read-only checks below."""
    tmp = tmp_path_factory.mktemp("migrate")
    src = _copy(tmp / "src")
    before = snapshot(src)
    result = cli("migrate-aliased", src, tmp / "dst", "--reset-lost-moments", "--format", "json")
    assert result.exit_code == 0, (result.stdout[-3000:], result.stderr)
    return SimpleNamespace(src=src, dst=tmp / "dst", doc=json.loads(result.stdout), before=before,
                           after=snapshot(src), stderr=result.stderr)


def test_help_has_examples():
    result = cli("migrate-aliased", "--help")
    assert result.exit_code == 0
    for needle in ("Examples", "--format", "--reset-lost-moments", "--in-place", "--dry-run", "pre-migrate"):
        assert needle in result.stdout, needle


def test_verify_reports_the_fixture_as_aliased():
    result = cli("verify", ALIASED, "--format", "json")
    assert_error_line(result, 1, "verify failed", "no cp_rank")
    src = open_checkpoint(ALIASED)
    flagged = {p["key"] for p in json.loads(result.stdout)["problems"] if p["check"] == "aliasing"}
    assert flagged == set(_aliased_keys(src)) and len(flagged) == 12


def test_renames_to_the_writers_cp_rank(migrated):
    src, dst = open_checkpoint(migrated.src), open_checkpoint(migrated.dst)
    assert migrated.doc["written"] and migrated.doc["destination"] == str(migrated.dst / ITER)
    survivors = _expected_survivors(src)
    old = _aliased_keys(src)
    assert not set(old) & set(dst.entries)
    new = {o.with_cp_rank(j) for o in map(parse_optimizer_key, old) for j in range(PAR.cp)}
    assert set(dst.entries) == (set(src.entries) - set(old)) | new
    for (key, offsets), cp in survivors.items():
        target = dst.entries[parse_optimizer_key(key).with_cp_rank(cp)]
        got = {c.offsets: c.storage for c in target.chunks}[offsets]
        want = {c.offsets: c.storage for c in src.entries[key].chunks}[offsets]
        assert got == want  # same file, byte offset and length: the data was not touched
    for key in set(src.entries) - set(old):  # everything else is byte-for-byte where it was
        assert [c.storage for c in dst.entries[key].chunks] == [c.storage for c in src.entries[key].chunks]


def test_lost_list_is_exact(migrated):
    survivors = _expected_survivors(open_checkpoint(migrated.src))
    want = {(parse_optimizer_key(k).with_cp_rank(1 - cp), off) for (k, off), cp in survivors.items()}
    lost = migrated.doc["lost"]
    assert {(x["key"], tuple(x["offsets"])) for x in lost} == want and len(lost) == len(want) == 54
    for x in lost:
        assert x["action"] == ("rebuilt_from_weights" if x["state"] == "param" else "reset_to_zero")
        assert x["kept_cp_rank"] == 1 - x["cp_rank"]
    counts = migrated.doc["counts"]
    assert (counts["rebuilt_param_chunks"], counts["reset_moment_chunks"], counts["kept_chunks"]) == (18, 36, 54)


def test_result_verifies_and_records_the_migration(migrated):
    result = cli("verify", migrated.dst, "--data", "--format", "json")
    assert result.exit_code == 0, result.stdout[-3000:]
    assert json.loads(result.stdout)["warnings"] == 0
    manifest = json.loads((migrated.dst / ITER / "gtp_manifest.json").read_text())
    assert any("ckpt migrate-aliased" in n and "reset to zero" in n for n in manifest["notes"])
    record = manifest["migration"]
    assert record["param_rebuild"] == "exact" and record["counts"]["reset_moment_chunks"] == 36
    assert len(record["lost_chunks"]) == 54 and record["new_data_file"] == "__8_0.distcp"
    inspect = json.loads(cli("inspect", migrated.dst, "--format", "json").stdout)
    assert inspect["aliasing"]["status"] == "ok"


def test_src_untouched_and_data_hard_linked(migrated):
    assert migrated.after == migrated.before
    src_iter, dst_iter = migrated.src / ITER, migrated.dst / ITER
    for f in src_iter.iterdir():
        if f.name in (".metadata", "gtp_manifest.json"):
            assert f.read_bytes() != (dst_iter / f.name).read_bytes()
            continue
        assert os.stat(f).st_ino == os.stat(dst_iter / f.name).st_ino and os.stat(f).st_nlink > 1, f.name
    assert migrated.doc["files"]["copied"] == 0 and migrated.doc["files"]["linked"] == 9
    assert (migrated.dst / "latest_checkpointed_iteration.txt").read_text() == "2\n"
    assert sorted(p.name for p in migrated.dst.parent.iterdir()) == ["dst", "src"]  # no temp folder left


def test_ground_truth_against_the_correct_save(migrated):
    dst, good = open_checkpoint(migrated.dst), open_checkpoint(CORRECT)
    weights = [k for k in good.entries if parse_optimizer_key(k) is None and "per_bucket" not in k]
    for k in weights:  # both fixtures must come from the same code, or the comparison means nothing
        assert all(torch.equal(load_chunk(dst, dst.entries[k], a), load_chunk(good, good.entries[k], b))
                   for a, b in zip(dst.entries[k].chunks, good.entries[k].chunks)), \
            f"{k} differs: regenerate both fixtures with python fixtures/make_fixtures.py"
    assert set(dst.entries) == set(good.entries)
    lost = {(x["key"], tuple(x["offsets"])): x["action"] for x in migrated.doc["lost"]}
    seen = {"kept": 0, "rebuilt_from_weights": 0, "reset_to_zero": 0}
    for key, entry in dst.entries.items():
        truth = {c.offsets: c for c in good.entries[key].chunks}
        for c in entry.chunks:
            got = load_chunk(dst, entry, c)
            action = lost.get((key, c.offsets), "kept")
            seen[action] += 1
            if action == "reset_to_zero":
                assert parse_optimizer_key(key).state in STATES[1:]
                assert not got.any(), (key, c.offsets)
            else:
                want = load_chunk(good, good.entries[key], truth[c.offsets])
                assert got.dtype == want.dtype and torch.equal(got.view(torch.uint8), want.view(torch.uint8)), \
                    (key, c.offsets, action)
    assert seen["rebuilt_from_weights"] == 18 and seen["reset_to_zero"] == 36


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_reader_loads_the_result(migrated):
    import torch.distributed.checkpoint as dcp

    ckpt = open_checkpoint(migrated.dst)
    keys = [k for k, e in ckpt.entries.items() if e.kind == "tensor" and k.endswith(".cp_rank_1")]
    sd = {k: torch.full(ckpt.entries[k].shape, float("nan")) for k in keys}
    dcp.load(sd, storage_reader=dcp.FileSystemReader(migrated.dst / ITER), no_dist=True)
    for k in keys:
        e = ckpt.entries[k]
        want = torch.cat([load_chunk(ckpt, e, c) for c in sorted(e.chunks, key=lambda c: c.offsets)])
        assert torch.equal(sd[k], want), k


def test_refused_without_reset_flag_writes_nothing(tmp_path: Path):
    src = _copy(tmp_path / "src")
    before = snapshot(src)
    result = cli("migrate-aliased", src, tmp_path / "dst", "--format", "json")
    assert_error_line(result, 1, "--reset-lost-moments", "36 Adam moment chunks", "nothing was written")
    doc = json.loads(result.stdout)
    assert doc["written"] is False and doc["counts"]["unrecoverable_moment_chunks"] == 36
    assert {x["action"] for x in doc["lost"]} == {"lost", "rebuilt_from_weights"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
    assert snapshot(src) == before


def test_dry_run_writes_nothing(tmp_path: Path):
    src = _copy(tmp_path / "src")
    before = snapshot(src)
    result = cli("migrate-aliased", src, tmp_path / "dst", "--dry-run", "--reset-lost-moments", "--format", "json")
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["mode"] == "dry_run" and doc["written"] is False and doc["counts"]["lost_chunks"] == 54
    assert_error_line(cli("migrate-aliased", src, tmp_path / "dst", "--dry-run"), 1, "(dry run)")
    table = cli("migrate-aliased", src, "--in-place", "--dry-run", "--reset-lost-moments")
    assert table.exit_code == 0 and "Lost CP-peer chunks" in table.stdout and "dry run" in table.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
    assert snapshot(src) == before


def test_dst_exists_is_refused(tmp_path: Path):
    src, dst = _copy(tmp_path / "src"), tmp_path / "dst"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    before_src, before_dst = snapshot(src), snapshot(dst)
    assert_error_line(cli("migrate-aliased", src, dst, "--reset-lost-moments"), 2, str(dst), "already exists")
    assert snapshot(src) == before_src and snapshot(dst) == before_dst
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst", "src"]


def test_in_place_keeps_a_backup_and_swaps(tmp_path: Path):
    src = _copy(tmp_path / "run")
    before = snapshot(src / ITER)
    result = cli("migrate-aliased", src, "--in-place", "--reset-lost-moments")
    assert result.exit_code == 0, result.stderr
    backups = [p for p in src.iterdir() if p.name.startswith(f"{ITER}.pre-migrate-")]
    assert len(backups) == 1 and str(backups[0]) in result.stdout
    assert snapshot(backups[0]) == before  # the original, byte for byte (and untouched mtimes)
    assert cli("verify", src).exit_code == 0  # follows latest to the migrated folder
    assert json.loads((src / ITER / "gtp_manifest.json").read_text())["migration"]["counts"]["lost_chunks"] == 54
    assert sorted(p.name for p in src.iterdir()) == sorted([ITER, backups[0].name, "latest_checkpointed_iteration.txt"])


def test_iteration_folder_and_copy_fallback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    src = _copy(tmp_path / "src")

    def no_links(*args, **kwargs):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(os, "link", no_links)
    result = cli("migrate-aliased", src / ITER, tmp_path / "fixed", "--reset-lost-moments", "--cp-size", "2",
                 "--format", "json")
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["files"]["linked"] == 0 and doc["files"]["copied"] == 9
    assert (tmp_path / "fixed" / ".metadata").is_file()  # an iteration folder in, an iteration folder out
    assert os.stat(tmp_path / "fixed" / "__0_0.distcp").st_nlink == 1
    assert cli("verify", tmp_path / "fixed", "--data").exit_code == 0


def test_bad_invocations(tmp_path: Path):
    src = _copy(tmp_path / "src")
    assert_error_line(cli("migrate-aliased", src, "--reset-lost-moments"), 2, "missing DST")
    assert_error_line(cli("migrate-aliased", src, tmp_path / "d", "--in-place"), 2, "takes no DST")
    assert_error_line(cli("migrate-aliased", src, tmp_path / "d", "--cp-size", "4"), 2, "--cp-size 4", "cp=2")
    assert_error_line(cli("migrate-aliased", src, tmp_path / "no" / "d"), 2, "does not exist")
    assert_error_line(cli("migrate-aliased", src, src / "inside"), 2, "inside SRC")
    (src / ITER / "gtp_manifest.json").unlink()
    assert_error_line(cli("migrate-aliased", src, tmp_path / "d", "--cp-size", "2"), 2,
                      "gtp_manifest.json", "gbuf_idx [0, 1]")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_correct_checkpoint_is_left_alone(tmp_path: Path):
    result = cli("migrate-aliased", CORRECT, tmp_path / "dst", "--format", "json")
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["status"] == "not_aliased" and doc["written"] is False and not (tmp_path / "dst").exists()


@pytest.mark.parametrize("algorithm", ["crc32", "crc32c"])
def test_zero_blobs_are_sparse_and_checksummed(tmp_path: Path, algorithm: str):
    """The writer path for big zero chunks (holes + CRC shift), which the small fixture never reaches."""
    import io

    from ckpt_tool.migrate.write import HOLE_MIN, CountingWriter, ZeroBlobs
    from gtp_format.hashing import CRCS, HASHERS, gf2_times

    crc = CRCS[algorithm]

    def whole(data: bytes) -> int:  # the hashlib-style path, independent of update's chaining
        h = HASHERS[algorithm]()
        h.update(data)
        return int(h.hexdigest(), 16)

    a, b = os.urandom(1000), os.urandom(70_000)
    assert gf2_times(crc.shift(len(b)), whole(a)) ^ whole(b) == whole(a + b)
    for n in (0, 1, 3, 4096, 70_001):
        c = os.urandom(n)
        assert crc.combine(whole(a), whole(c), n) == whole(a + c)
    zeros, path, spans = ZeroBlobs(crc), tmp_path / "__2_0.distcp", []
    with open(path, "wb") as f:
        w = CountingWriter(f, crc)
        for i, n in enumerate([300_000, 10, 300_000, 70_000]):
            start = w.pos
            if i == 1:
                torch.save(torch.arange(n, dtype=torch.float32), w)
            else:
                assert i == 0 or zeros.get((n,)).zeros[1] - zeros.get((n,)).zeros[0] >= HOLE_MIN
                w.write_blob(zeros.get((n,)))
            spans.append((start, w.pos - start, n))
        w.close_out()
    data = path.read_bytes()
    assert len(data) == w.pos and whole(data) == w.crc
    for i, (start, length, n) in enumerate(spans):
        t = torch.load(io.BytesIO(data[start:start + length]), weights_only=True)
        assert t.shape == (n,) and (torch.equal(t, torch.arange(n, dtype=torch.float32)) if i == 1 else not t.any())


@pytest.mark.slow
def test_runtime_resumes_from_the_migrated_checkpoint(migrated):
    cmd = [sys.executable, "-m", "gtp_runtime.train", "--nproc-per-node", "8", "--cp", "2", "--gtp-remat", "2",
           "--dp", "2", "--fold-cp", *MODEL_FLAGS, "--steps", "3", "--load", str(migrated.dst)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "at iteration 2" in proc.stdout and "step    3" in proc.stdout


def test_output_matches_the_recorded_output_of_the_single_module_version(migrated):
    """migrate's output is the same as before it became a package: every file, chunk and record."""
    from migrate_golden import summarize

    golden = json.loads((Path(__file__).parent / "golden" / "migrate_aliased.json").read_text())
    got = json.loads(json.dumps(summarize(migrated.dst / ITER)))
    for part in golden:
        assert got[part] == golden[part], part


def test_metadata_is_read_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The plan's reader keeps the .metadata records; the rewrite starts from them, not from the file again."""
    from ckpt_tool.migrate.plan import plan_migration
    from ckpt_tool.migrate.write import build_migrated
    from gtp_format.reader import allow_list

    unpickled: list[str] = []

    class Counting(allow_list.AllowListUnpickler):
        def __init__(self, data: bytes, source: str, resolve) -> None:
            unpickled.append(source)
            super().__init__(data, source, resolve)

    monkeypatch.setattr(allow_list, "AllowListUnpickler", Counting)
    src = _copy(tmp_path / "src")
    plan = plan_migration(src, None, True)
    assert plan.ckpt.raw_metadata is not None
    from gtp_format.writer.checkpoint import CheckpointWriter

    with CheckpointWriter(tmp_path / "out") as writer:
        build_migrated(plan, writer, tmp_path / "out", lambda n: None)
        writer.commit()
    # the source's once; the writer reads its own output's back once more, before the commit
    assert [u for u in unpickled if not u.startswith(str(tmp_path / ".tmp.out."))] == [str(src / ITER / ".metadata")]
    assert (tmp_path / "out" / "__8_0.distcp").is_file()
