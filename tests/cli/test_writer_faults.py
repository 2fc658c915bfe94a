"""Faults around the one checkpoint writer, on the commands that write: a DST that appears mid-run,
two writers to one DST, SIGTERM, leftovers of dead writers, a full disk during migrate, and what the
reader makes of what a crash left (issue 22 classes 1, 9, 11, 13, 14)."""

from __future__ import annotations

import hashlib
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from cli_helpers import REPO, assert_error_line, cli, snapshot

from gtp_format import work
from gtp_format.errors import FormatError
from gtp_format.names import LATEST_FILE

FIXTURES = REPO / "fixtures" / "gtp"
FOLD = FIXTURES / "fold_cp2_g2_dp2"
ALIASED = FIXTURES / "aliased_cp2_g2_dp2"
ITER = "iter_0000002"

# ``ckpt ARGS`` in a fresh interpreter whose every chunk takes ``GTP_TEST_SLOW`` seconds to produce, so
# that a test can act while the command is writing; it prints "writing" when the first chunk starts.
# ckpt with one function slowed (GTP_TEST_SLOW_AT, module:function; default the reshard's chunk reads): it
# prints "writing" on the first call, then sleeps GTP_TEST_SLOW seconds before each
SLOW_CKPT = """
import importlib, os, sys, time
mod_name, fn = os.environ.get("GTP_TEST_SLOW_AT", "ckpt_tool.copying.engine:chunk_data").split(":")
mod = importlib.import_module(mod_name)
real, first = getattr(mod, fn), [True]
def slow(*a, **k):
    if first[0]:
        first[0] = False
        print("writing", flush=True)
    time.sleep(float(os.environ["GTP_TEST_SLOW"]))
    return real(*a, **k)
setattr(mod, fn, slow)
if os.environ.get("GTP_TEST_NO_LINK"):
    def no_link(*a, **k):
        raise OSError(18, "Invalid cross-device link")
    os.link = no_link
from ckpt_tool.cli import run
sys.exit(run(sys.argv[1:]))
"""


def _slow(*args: str | Path, slow: float = 0.3, at: str = "ckpt_tool.copying.engine:chunk_data",
          **kw: object) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "GTP_TEST_SLOW": str(slow), "GTP_TEST_SLOW_AT": at}
    return subprocess.Popen([sys.executable, "-c", SLOW_CKPT, *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, **kw)  # type: ignore[call-overload]


def _appear(dst: Path):  # noqa: ANN202 - a progress factory
    """A progress factory that creates DST (with a file of its own) when the first chunk is written."""
    def factory(total: int):  # noqa: ANN202
        def advance(n: int) -> None:
            if not dst.exists():
                dst.mkdir()
                (dst / "theirs").write_text("keep")
        return advance
    return factory


@pytest.mark.parametrize("command", ["reshard", "hf", "fully_reshardable"])
def test_a_dst_created_mid_run_is_refused_and_left_alone(tmp_path: Path, command: str) -> None:
    from ckpt_tool.export.engine import export
    from ckpt_tool.reshard.engine import reshard, target_topology

    out = tmp_path / "out"
    out.mkdir()
    dst = out / "dst"
    with pytest.raises(FormatError, match="appeared while") as e:
        if command == "reshard":
            reshard(FOLD, dst, target_topology(FOLD, None, dp=1), progress=_appear(dst))
        else:
            export(FOLD, dst, command, progress=_appear(dst))
    assert e.value.exit_code == 2 and str(dst) in e.value.message
    assert os.listdir(out) == ["dst"] and os.listdir(dst) == ["theirs"]  # nothing deleted, no work folder left
    assert (dst / "theirs").read_text() == "keep"


def test_export_torch_never_replaces_a_file_that_appeared(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import ckpt_tool.export.to_torch as export_torch
    from ckpt_tool.export.engine import export

    out = tmp_path / "out"
    out.mkdir()
    dst, real = out / "state.pt", export_torch.TorchStateFile.finish

    def finish(self: object) -> None:  # another process writes DST while the file is written
        dst.write_text("theirs")
        real(self)  # type: ignore[arg-type]

    monkeypatch.setattr(export_torch.TorchStateFile, "finish", finish)
    with pytest.raises(FormatError, match="appeared while"):
        export(FOLD, dst, "torch")
    assert os.listdir(out) == ["state.pt"] and dst.read_text() == "theirs"


@pytest.mark.parametrize("command", [("reshard", "--dp", "1"), ("export", "--to", "fully_reshardable")])
def test_an_iteration_no_latest_marker_can_name_is_refused_before_writing(tmp_path: Path,
                                                                          command: tuple[str, ...]) -> None:
    src = tmp_path / "src"
    shutil.copytree(FOLD, src)
    (src / LATEST_FILE).unlink()
    manifest = src / ITER / "gtp_manifest.json"
    doc = json.loads(manifest.read_text())
    doc["iteration"] = 2**62  # the manifest allows it; a latest marker holds at most 12 digits
    manifest.write_text(json.dumps(doc))
    out = tmp_path / "out"
    out.mkdir()
    assert_error_line(cli(command[0], src / ITER, out / "dst", *command[1:]), 2, "cannot be named by", LATEST_FILE)
    assert os.listdir(out) == []


def test_two_reshards_to_one_dst_exactly_one_wins(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    dst = out / "dst"
    procs = [_slow("reshard", FOLD, dst, "--dp", "1", "--workers", "1", slow=0.05) for _ in range(2)]
    for p in procs:  # both are writing before either commits
        assert p.stdout is not None and p.stdout.readline().strip() == "writing"
    results = [(p.wait(timeout=300), p.stderr.read() if p.stderr else "") for p in procs]
    codes = sorted(rc for rc, _ in results)
    assert codes == [0, 2], results
    loser = next(err for rc, err in results if rc == 2).strip().splitlines()
    assert len(loser) == 1 and "appeared while" in loser[0] and "nothing there was replaced" in loser[0], loser
    assert os.listdir(out) == ["dst"]
    assert cli("verify", dst, "--data").exit_code == 0


@pytest.mark.parametrize(("argv", "at"), [
    (("reshard", "{src}", "{out}/dst", "--dp", "1", "--workers", "2"), "ckpt_tool.copying.engine:chunk_data"),
    # --to torch writes its one file as the slices come (gtp_format/writer/torch_file.py)
    (("export", "{src}", "{out}/model.pt", "--to", "torch"), "ckpt_tool.export.to_torch:_write_piece"),
], ids=["reshard", "export-torch"])
def test_sigterm_removes_the_work_folder(tmp_path: Path, argv: tuple[str, ...], at: str) -> None:
    out = tmp_path / "out"
    out.mkdir()
    p = _slow(*(a.format(src=FOLD, out=out) for a in argv), slow=1.0, at=at)
    assert p.stdout is not None and p.stdout.readline().strip() == "writing"
    assert [w.state for w in work.leftovers(out)] == ["live"]
    t0 = time.monotonic()
    p.send_signal(signal.SIGTERM)
    rc = p.wait(timeout=120)
    err = p.stderr.read() if p.stderr else ""
    assert rc == 143 and err.strip().splitlines() == [
        "ckpt: error: terminated (SIGTERM); nothing was written, the partial output was removed"], (rc, err)
    assert time.monotonic() - t0 < 30  # within a chunk or two, not the whole file
    assert os.listdir(out) == []


def _work_copy(parent: Path, target: str, pid: int, start: int, tag: str = "tmp", token: str = "ab" * 16) -> Path:
    """A hidden work folder as the writer makes them, owned by ``pid`` started at ``start``: the owner in
    its name, the ownership token inside (``token=None``: none, a folder merely named like one)."""
    nonce = hashlib.sha256((token or "").encode()).hexdigest()[:6]
    path = parent / f".{tag}.{target}.w{work._host_id()}{work._boot_id()}-{pid}-{start}-{nonce}"
    shutil.copytree(FOLD / ITER, path)
    if token is not None:
        (path / work.TOKEN_FILE).write_text(token + "\n")
    return path


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_an_unfinished_work_folder_never_verifies(tmp_path: Path) -> None:
    """Killed after .metadata, before the manifest: pointed at directly, it is not a checkpoint."""
    killed = _work_copy(tmp_path, ITER, _dead_pid(), 1)
    (killed / "gtp_manifest.json").unlink()
    (killed / "metadata.json").unlink()
    assert_error_line(cli("verify", killed), 2, "never finished", str(killed))
    legacy = tmp_path / f".tmp.{ITER}.0123abcd"  # written before owners were recorded
    killed.rename(legacy)
    assert_error_line(cli("verify", legacy, "--data"), 2, "never finished")
    live = _work_copy(tmp_path, ITER, os.getppid(), work.start_ticks(os.getppid()) or 0)
    (live / "metadata.json").unlink()
    (live / "gtp_manifest.json").unlink()
    assert_error_line(cli("inspect", live), 2, "still writing")


def test_a_missing_iteration_is_recovered_from_its_finished_hidden_copy(tmp_path: Path) -> None:
    """A crash between the two renames of a portable replace: latest names iter_2, which is missing."""
    run = tmp_path / "run"
    run.mkdir()
    (run / LATEST_FILE).write_text("2\n")
    new = _work_copy(run, ITER, _dead_pid(), 1)
    _work_copy(run, ITER, _dead_pid(), 1, tag="old")
    unfinished = _work_copy(run, ITER, _dead_pid(), 1, tag="migrate")
    (unfinished / "metadata.json").unlink()
    before = snapshot(run)
    r = cli("verify", run, "--data", "--format", "json")
    assert r.exit_code == 0, r.stdout[-2000:]
    doc = json.loads(cli("inspect", run, "--format", "json").stdout)
    assert doc["path"] == str(new) and doc["iteration"] == 2
    assert any(n["check"] == "recovered" and ITER in n["message"] for n in doc["notes"])
    assert {w["owner"] for w in doc["leftovers"]} == {"dead"} and len(doc["leftovers"]) == 2
    assert snapshot(run) == before  # the reader only reads


def test_leftovers_are_listed_and_the_next_writer_there_cleans_only_the_dead_ones(tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(FOLD, run)  # a run directory: the latest marker and iter_0000002
    stale = _work_copy(run, "dst_old", _dead_pid(), 1)
    me = os.getpid()
    live = _work_copy(run, "other", me, work.start_ticks(me) or 0)
    doc = json.loads(cli("inspect", run, "--format", "json").stdout)
    assert {Path(w["path"]).name: w["owner"] for w in doc["leftovers"]} == {stale.name: "dead", live.name: "live"}
    table = cli("inspect", run)
    assert table.exit_code == 0 and "Leftovers of unfinished writes" in table.stdout and "stale" in table.stdout
    # the next writer into this folder (from another SRC: a DST inside its own SRC is refused, see
    # tests/s3/test_nesting.py) cleans the dead writer's copy and leaves the live one's
    r = cli("reshard", FOLD, run / "dst", "--dp", "1")
    assert r.exit_code == 0, r.stderr
    assert sorted(os.listdir(run)) == sorted([ITER, LATEST_FILE, "dst", live.name]) and not stale.exists()


def _limit_file_size() -> None:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))


def test_full_disk_during_migrate_names_the_destination_file(tmp_path: Path) -> None:
    """Hard links impossible, so SRC's files are copied, and the copy hits the size limit (a full disk):
    the line names the file being written in DST, not the SRC file ``shutil.copyfile`` reports."""
    src = tmp_path / "src"
    shutil.copytree(ALIASED, src)
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO), "GTP_TEST_SLOW": "0", "GTP_TEST_NO_LINK": "1"}
    r = subprocess.run([sys.executable, "-c", SLOW_CKPT, "migrate-aliased", str(src), str(out / "fixed"),
                        "--reset-lost-moments", "--cp-size", "2"], capture_output=True, text=True, env=env,
                       preexec_fn=_limit_file_size, timeout=300)
    assert r.returncode == 2, (r.stdout[-1000:], r.stderr[-2000:])
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "File too large" in lines[0], lines
    assert str(out) in lines[0] and str(src) not in lines[0], lines[0]
    assert os.listdir(out) == []


def test_reshard_and_export_never_import_the_runtime() -> None:
    """They write through the format package's writer; the runtime is for training."""
    probe = ("import sys, ckpt_tool.reshard.engine, ckpt_tool.export.engine, ckpt_tool.commands.reshard, "
             "ckpt_tool.commands.export; print(sorted(m for m in sys.modules if m.startswith('gtp_runtime')))")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0 and r.stdout.strip() == "[]", (r.stdout, r.stderr[-2000:])


@pytest.mark.slow
def test_sigterm_during_verify_roundtrip_removes_its_temporary_folder(request: pytest.FixtureRequest) -> None:
    """verify-roundtrip saves into a temporary folder of its own; SIGTERM removes it as an error does."""
    # A short TMPDIR: the forkserver's AF_UNIX socket lives there, and a path over 107 bytes (an
    # xdist worker's tmp_path is that deep) refuses it before any rank starts.
    scratch = Path(tempfile.mkdtemp(prefix="rt-", dir="/tmp"))
    request.addfinalizer(lambda: shutil.rmtree(scratch, ignore_errors=True))
    env = {**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(scratch)}
    p = subprocess.Popen([sys.executable, "-m", "ckpt_tool.cli", "verify-roundtrip", "--cp", "2", "--gtp-remat", "1",
                          "--dp", "1"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 240
    while not list(scratch.glob("ckpt-roundtrip-*/checkpoints")):  # the ranks run and save
        assert time.monotonic() < deadline and p.poll() is None, p.communicate()
        time.sleep(0.05)
    p.send_signal(signal.SIGTERM)
    rc = p.wait(timeout=120)
    err = (p.stderr.read() if p.stderr else "").strip().splitlines()
    assert rc == 143 and len(err) == 1 and "terminated (SIGTERM)" in err[0], (rc, err)
    time.sleep(1)  # a rank that outlived the launcher would write here now
    assert not [n for n in os.listdir(scratch) if n.startswith("ckpt-roundtrip-")], os.listdir(scratch)
