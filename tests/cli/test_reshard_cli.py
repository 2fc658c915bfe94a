"""``ckpt reshard`` and ``ckpt inspect --params`` as commands: output, refusals, atomicity.

Each refusal is one line with exit 2 and leaves nothing behind next to DST; SRC is never modified.
"""

from __future__ import annotations

import json
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from cli_helpers import assert_error_line, cli, snapshot

from gtp_format.manifest import read_manifest
from gtp_format.reader.locate import locate

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "gtp"
FOLD = FIXTURES / "fold_cp2_g2_dp2"


def _nothing_left(parent: Path) -> None:
    assert [p.name for p in parent.iterdir()] == [], list(parent.iterdir())


def test_inspect_params_lists_every_parameter_with_its_place() -> None:
    r = cli("inspect", FOLD, "--params", "--format", "json")
    assert r.exit_code == 0, r.stderr
    rows = {row["name"]: row for row in json.loads(r.stdout)["params"]}
    manifest = read_manifest(locate(FOLD).folder)
    assert manifest.buffers is not None
    for buf in manifest.buffers:
        for b in buf.buckets:
            for p in b.params:
                row = rows.pop(p.name)
                assert (row["gbuf_idx"], row["bucket_idx"], row["offset"]) == (buf.gbuf_idx, b.bucket_idx, p.start)
                # folded buffers: one copy per (gtp, cp) position; replicated ones: one per gtp lane
                assert len(row["holders"]) == (4 if buf.excludes_cp else 2)
                assert row["cp_ranks"] == ([0, 1] if buf.excludes_cp else [])
                assert set(row["ranks"]) <= set(range(8)) and row["ranks"]
    assert not rows
    table = cli("inspect", FOLD, "--params")
    assert table.exit_code == 0 and "Parameters" in table.stdout and "output_layer.weight" in table.stdout


def test_reshard_json_summary_and_src_untouched(tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(FOLD, src)
    before = snapshot(src)
    r = cli("reshard", src, tmp_path / "dst", "--cp", "1", "--dp", "4", "--layout", "safetensors", "--format", "json")
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["ok"] and doc["target_topology"] == "tp1-cp1-g2-dp4-nofold" and doc["layout"] == "safetensors"
    assert doc["peak_rss_bytes"] > 0 and doc["bytes_written"] > 0
    assert snapshot(src) == before
    assert (tmp_path / "dst" / "latest_checkpointed_iteration.txt").read_text() == "2\n"
    m = read_manifest(tmp_path / "dst" / "iter_0000002")
    assert m.topology is not None and m.topology.describe() == "tp1-cp1-g2-dp4-nofold"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst", "src"]  # no temporary left
    assert "Examples" in cli("reshard", "--help").stdout


def test_refusals_are_one_line_and_leave_nothing(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    r = cli("reshard", FIXTURES / "aliased_cp2_g2_dp2", out / "x", "--cp", "1")
    assert_error_line(r, 2, "aliased", "migrate-aliased")
    r = cli("reshard", FOLD, out / "x", "--tp", "3")
    assert_error_line(r, 2, "impossible target topology", "--num-heads")
    r = cli("reshard", FOLD, out / "x", "--cp", "3")
    assert_error_line(r, 2, "impossible target topology")
    _nothing_left(out)
    (out / "exists").mkdir()
    r = cli("reshard", FOLD, out / "exists", "--dp", "1")
    assert_error_line(r, 2, "already exists")
    r = cli("reshard", FOLD, tmp_path / "no" / "dst", "--dp", "1")
    assert_error_line(r, 2, "no such folder")
    r = cli("reshard", FOLD, out / "x", "--layout", "zip")
    assert_error_line(r, 2, "--layout")
    assert [p.name for p in out.iterdir()] == ["exists"]


def test_incomplete_source_is_refused(tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(FOLD, src)
    victim = sorted((src / "iter_0000002").glob("*.distcp"))[0]
    victim.write_bytes(victim.read_bytes()[:100])
    out = tmp_path / "out"
    out.mkdir()
    r = cli("reshard", src, out / "dst", "--dp", "1")
    assert_error_line(r, 2, "incomplete", "ckpt verify")
    _nothing_left(out)


def _limit_file_size() -> None:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))


def test_full_disk_leaves_nothing_behind(tmp_path: Path) -> None:
    """A write that fails part-way (RLIMIT_FSIZE stands in for a full disk) removes the partial DST."""
    out = tmp_path / "out"
    out.mkdir()
    r = subprocess.run([sys.executable, "-m", "ckpt_tool.cli", "reshard", str(FOLD), str(out / "dst"), "--dp", "1"],
                       capture_output=True, text=True, preexec_fn=_limit_file_size, timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "while writing" in lines[0] and "nothing was left behind" in lines[0], r.stderr
    _nothing_left(out)
