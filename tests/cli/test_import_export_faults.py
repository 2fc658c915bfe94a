"""Faults on the write paths of ``import --from hf`` and ``export`` to a folder: a writer killed
(SIGKILL) or terminated (SIGTERM) mid-write, a full disk, a DST that appears mid-run.

After each: DST is absent or exactly what another process put there; nothing the tool did not create
is gone; the next writer into the same folder removes the killed writer's work folder (it proves its
owner by its token) and leaves a user's folder named like one; what it writes passes ``verify --data``.
The commands run in fresh interpreters with one function slowed (``test_writer_faults.SLOW_CKPT``), so
the test acts while they write.
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import REPO, cli, snapshot
from hf_folder import hf_folder
from test_writer_faults import SLOW_CKPT, _slow

from gtp_format import work

FOLD = REPO / "fixtures" / "gtp" / "fold_cp2_g2_dp2"
IMPORT_AT = "ckpt_tool.hf.importer:_fp32"  # once per fp32 master-weight chunk the import writes
EXPORT_HF_AT = "ckpt_tool.copying.engine:chunk_data"
EXPORT_TORCH_AT = "ckpt_tool.export.to_torch:_write_piece"  # once per row slice written


def _command(kind: str, src: Path, dst: Path) -> list[str | Path]:
    if kind == "import":
        return ["import", src, dst, "--from", "hf", "--workers", "1"]
    return ["export", src, dst, "--to", kind, "--workers", "1"]


def _setup(tmp_path: Path, kind: str) -> tuple[Path, Path, str]:
    src = hf_folder(tmp_path / "hf") if kind == "import" else FOLD
    out = tmp_path / "out"
    out.mkdir()
    return src, out, {"import": IMPORT_AT, "torch": EXPORT_TORCH_AT}.get(kind, EXPORT_HF_AT)


def _writing(p: subprocess.Popen[str]) -> None:
    assert p.stdout is not None and p.stdout.readline().strip() == "writing", p.communicate()


@pytest.mark.parametrize("kind", ["import", "hf", "fully_reshardable", "torch"])
def test_a_killed_writer_leaves_only_its_proven_work_folder_which_the_next_one_removes(tmp_path: Path,
                                                                                      kind: str) -> None:
    src, out, at = _setup(tmp_path, kind)
    before = snapshot(src)
    mine = out / f".tmp.mine.w{work._host_id()}{work._boot_id()}-1-1-abcdef"  # a user's, named like one
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    p = _slow(*_command(kind, src, out / "dst"), slow=2.0, at=at)
    _writing(p)
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=60)
    left = [w for w in work.leftovers(out) if w.path != mine]
    assert len(left) == 1 and left[0].state == "dead" and work.proven(left[0]), left
    assert not (out / "dst").exists()
    r = cli(*_command(kind, src, out / "dst2"))
    assert r.exit_code == 0, r.stderr
    made = ["dst2", "dst2.gtp_attestation.json"] if kind == "torch" else ["dst2"]  # a file's attestation lies beside it
    assert sorted(os.listdir(out)) == sorted([*made, mine.name]) and (mine / "notes.txt").read_text() == "keep"
    if kind != "torch":
        assert cli("verify", out / "dst2", "--data").exit_code == 0
    assert snapshot(src) == before


@pytest.mark.parametrize("kind", ["import", "hf"])
def test_sigterm_mid_write_removes_the_partial_output(tmp_path: Path, kind: str) -> None:
    src, out, at = _setup(tmp_path, kind)
    p = _slow(*_command(kind, src, out / "dst"), slow=2.0, at=at)
    _writing(p)
    p.send_signal(signal.SIGTERM)
    rc = p.wait(timeout=120)
    err = (p.stderr.read() if p.stderr else "").strip().splitlines()
    assert rc == 143 and len(err) == 1 and "terminated (SIGTERM)" in err[0], (rc, err)
    assert os.listdir(out) == []


def test_sigterm_mid_write_of_a_fully_reshardable_saves_optimizer_files(tmp_path: Path) -> None:
    """``export --to hf --optimizer`` of megatron-core's fully_reshardable save (its states read from per-parameter
    keys), terminated while its optimizer file is being written: one line, exit 143, nothing left, the source
    unchanged; the next run writes what the dp_reshardable save of the same state exports."""
    import time

    src = REPO / "fixtures" / "megatron" / "pair_llama_tp2_dp2_dp_reshardable_fully_reshardable"
    before = snapshot(src)
    out = tmp_path / "out"
    out.mkdir()
    argv = ["export", src, out / "dst", "--to", "hf", "--optimizer", "--workers", "1"]
    p = _slow(*argv, slow=0.5, at=EXPORT_HF_AT)
    _writing(p)
    deadline = time.monotonic() + 120
    while not any(f.name.startswith("optimizer") and f.suffix == ".safetensors" for f in out.rglob("*")):
        assert p.poll() is None and time.monotonic() < deadline, "the export ended before its optimizer file"
        time.sleep(0.05)
    p.send_signal(signal.SIGTERM)
    rc = p.wait(timeout=120)
    err = (p.stderr.read() if p.stderr else "").strip().splitlines()
    assert rc == 143 and len(err) == 1 and "terminated (SIGTERM)" in err[0], (rc, err)
    assert os.listdir(out) == [] and snapshot(src) == before
    assert cli(*argv[:2], out / "dst", *argv[3:]).exit_code == 0
    assert cli("export", src.with_name(src.name.removesuffix("_fully_reshardable")), tmp_path / "dp", "--to", "hf",
               "--optimizer").exit_code == 0
    for f in ("model.safetensors", "optimizer.safetensors"):
        assert (out / "dst" / f).read_bytes() == (tmp_path / "dp" / f).read_bytes(), f


def test_an_import_dst_that_appears_mid_run_is_refused_and_left_alone(tmp_path: Path) -> None:
    src, out, at = _setup(tmp_path, "import")
    dst = out / "dst"
    p = _slow(*_command("import", src, dst), slow=0.5, at=at)
    _writing(p)
    dst.mkdir()
    (dst / "theirs").write_text("keep")
    rc = p.wait(timeout=300)
    err = (p.stderr.read() if p.stderr else "").strip().splitlines()
    assert rc == 2 and len(err) == 1 and "appeared while" in err[0] and "nothing there was replaced" in err[0], err
    assert os.listdir(out) == ["dst"] and os.listdir(dst) == ["theirs"] and (dst / "theirs").read_text() == "keep"


def _limit_file_size() -> None:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))


@pytest.mark.parametrize("kind", ["import", "hf", "fully_reshardable"])
def test_a_full_disk_names_dst_and_leaves_nothing(tmp_path: Path, kind: str) -> None:
    src, out, _ = _setup(tmp_path, kind)
    env = {**os.environ, "PYTHONPATH": str(REPO), "GTP_TEST_SLOW": "0"}
    r = subprocess.run([sys.executable, "-c", SLOW_CKPT, *map(str, _command(kind, src, out / "dst"))],
                       capture_output=True, text=True, env=env, preexec_fn=_limit_file_size, timeout=300)
    assert r.returncode == 2, (r.stdout[-1000:], r.stderr[-2000:])
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "File too large" in lines[0] and str(out) in lines[0], lines
    assert "Traceback" not in r.stderr and os.listdir(out) == []


def test_the_import_of_a_fault_free_run_verifies(tmp_path: Path) -> None:
    """The baseline the cases above are measured against: the same import, undisturbed."""
    src, out, _ = _setup(tmp_path, "import")
    assert cli(*_command("import", src, out / "dst")).exit_code == 0
    assert cli("verify", out / "dst", "--data").exit_code == 0
