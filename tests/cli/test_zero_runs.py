"""Writers that produce long zero runs, and the readers that follow them, agree on holes.

``migrate-aliased --reset-lost-moments`` leaves zeroed Adam moments as holes (runs of 64 KiB and
more), ``cp -r`` keeps them, and a compressing filesystem reports fewer blocks for good data. Holes
are not damage: the readers go through a bounded multiple of what a file stores and let the
checksums and chunk hashes judge. The checkpoints here are the size where that matters (tens of
MB, zero runs of megabytes): the migrate fixture elsewhere is too small to hold one 64 KiB run, which
is how a migration that its own ``verify --data`` refused went unseen.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "helpers"))
sys.path.insert(0, str(REPO / "benchmarks"))

from cli_helpers import cli  # noqa: E402

from gtp_format.reader.storage import stored_bytes  # noqa: E402


def _aliased(out: Path) -> None:
    import bench_migrate

    args = bench_migrate.parse_args(["--hidden", "384", "--ffn-hidden", "1536", "--num-heads", "4",
                                     "--bucket-size", "10000000"])
    bench_migrate.generate(args, 2, out)  # 2 gloo ranks, CP 2 folded, one step, the pre-fix save


@pytest.fixture(scope="module")
def migrated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("zero_runs")
    _aliased(root / "src")
    result = cli("migrate-aliased", root / "src", root / "dst", "--reset-lost-moments")
    assert result.exit_code == 0, result.stderr
    return root / "dst"


def _holes(folder: Path) -> int:
    """Bytes of the folder's data files that are holes (size less stored blocks)."""
    return sum(max(0, p.stat().st_size - stored_bytes(p.stat())) for p in folder.rglob("*.distcp"))


def _verify_data_ok(path: Path, *extra: str) -> None:
    result = cli("verify", "--data", path, *extra)
    assert result.exit_code == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "OK: 0 errors" in result.stdout


def test_migration_writes_holes_that_verify_data_accepts(migrated: Path) -> None:
    assert _holes(migrated) >= 8 << 20  # megabytes of zeroed moments left as holes: the case is real
    _verify_data_ok(migrated)
    _verify_data_ok(migrated, "--cp-size", "2")


def test_a_cp_r_copy_keeps_the_holes_and_verifies(migrated: Path, tmp_path: Path) -> None:
    subprocess.run(["cp", "-r", str(migrated), str(tmp_path / "copy")], check=True)
    _verify_data_ok(tmp_path / "copy")


def test_holes_are_judged_by_checksums_not_trusted(migrated: Path, tmp_path: Path) -> None:
    """A hole punched where data was reads back as zeros: the chunk hashes refuse it (exit 1)."""
    copy = tmp_path / "copy"
    shutil.copytree(migrated, copy)
    it = next(copy.glob("iter_*"))
    target = max(it.glob("*.distcp"), key=lambda p: stored_bytes(p.stat()))  # a linked file with real data
    data = bytearray(target.read_bytes())
    mid = len(data) // 2
    data[mid:mid + (1 << 20)] = bytes(1 << 20)
    target.unlink()
    target.write_bytes(bytes(data))
    result = cli("verify", "--data", copy)
    assert result.exit_code == 1 and target.name in result.stdout + result.stderr


@pytest.mark.parametrize("cmd", ["reshard", "export-torch", "hf-round-trip"])
def test_writers_of_zero_moments_verify(migrated: Path, tmp_path: Path, cmd: str) -> None:
    """Reshard and export of a checkpoint whose moments are zero, and an import with a fresh optimizer."""
    out = tmp_path / "out"
    if cmd == "reshard":
        result = cli("reshard", migrated, out, "--cp", "1", "--dp", "2")
    elif cmd == "export-torch":
        result = cli("export", migrated, tmp_path / "m.pt", "--to", "torch")
        assert result.exit_code == 0, result.stderr
        return
    else:
        hf = tmp_path / "hf"
        result = cli("export", migrated, hf, "--to", "hf")
        assert result.exit_code == 0, result.stderr
        result = cli("import", hf, out, "--from", "hf", "--dp", "2")  # a fresh optimizer: zero moments
    assert result.exit_code == 0, result.stderr
    _verify_data_ok(out)
    subprocess.run(["cp", "-r", str(out), str(tmp_path / "copy")], check=True)
    _verify_data_ok(tmp_path / "copy")


def test_migration_self_check_reads_what_it_wrote(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The self-check runs verify --data's pass over the new data file: a byte damaged after the
    build (as a bad disk would) stops the commit; nothing appears at DST and SRC is untouched."""
    from ckpt_tool.migrate import commit
    from ckpt_tool.migrate.plan import plan_migration
    from gtp_format.errors import FormatError

    src = tmp_path / "src"
    _aliased(src)
    before = {p: p.read_bytes() for p in src.rglob("*") if p.is_file()}
    build = commit.build_migrated

    def damaged(plan, writer, where, progress):  # type: ignore[no-untyped-def]
        outcome = build(plan, writer, where, progress)
        path = Path(writer.folder) / outcome.new_data_file
        with open(path, "r+b") as f:
            f.seek(os.path.getsize(path) // 3)
            b = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([b[0] ^ 0x40]))
        return outcome

    monkeypatch.setattr(commit, "build_migrated", damaged)
    with pytest.raises(FormatError, match="fails verify"):
        commit.migrate_to(plan_migration(src, None, True), tmp_path / "dst", lambda n: None)
    assert not (tmp_path / "dst").exists()
    assert not [p for p in tmp_path.iterdir() if p.name not in ("src",)]
    assert before == {p: p.read_bytes() for p in src.rglob("*") if p.is_file()}
