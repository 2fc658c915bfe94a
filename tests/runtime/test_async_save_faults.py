"""Faults during ``--async-save`` on real gloo ranks through the launcher: SIGKILL of one rank, of the
whole process group and of the launcher, SIGTERM of the launcher, each at every phase of the save
(the staging copy, the background write, the commit on the training thread), plus kills at random
moments and a disk that fills during the background write.

The phases are reached by the runtime's fault hook (``GTP_FAULT_INJECT=point:rank:signal``,
:func:`gtp_runtime.checkpoint.io._fault`): ``staging`` and ``staged`` (before and after the copy to
host memory; the work folder exists), ``during_write`` (inside DCP's write on the background
thread), ``after_write`` (every file of that rank fsynced), ``before_rename`` and ``before_latest``
(rank 0's commit: before the folder is renamed, and between that rename and the latest marker),
and an iteration saved again (``mid_exchange``: the old folder just exchanged for the new one, still under the
work folder's name; ``after_exchange``: moved aside, not yet removed).
The random cases kill from outside after a seeded random delay once a save has started, so they
land wherever the save is.

After each: no process the launcher started outlives it; ``latest`` names a complete iteration that
``ckpt verify --data`` accepts (and so does every ``iter_*`` folder there); nothing the tool did not
create is gone (a user's file, and a folder merely named like a work folder); what work folders are
left are proven dead writers', and the next save removes them; a resume from ``latest`` ends bit for
bit where an uninterrupted run did (losses, gradient norms and every data file of the last save).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import launcher_cases as lc
import pytest
from cli_helpers import cli
from test_launcher_lifetime import _alive, _descendants

from gtp_format import work
from gtp_format.names import LATEST_FILE

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the process tree (Linux)")]

TOPO = ["--nproc-per-node", "2", "--cp", "2", "--fold-cp", "--device", "cpu", "--hidden", "32", "--ffn-hidden", "64",
        "--seq-length", "16", "--micro-batch", "1", "--save-interval", "1", "--async-save"]
STEPS = 5
START = 2  # every faulty run resumes the reference's iteration 2 and dies saving iteration 3
STOP_WITHIN_S = 20.0


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(lc.REPO), "OMP_NUM_THREADS": "1", **extra}


def _manifest_files(folder: Path) -> dict:
    files = json.loads((folder / "gtp_manifest.json").read_text())["files"]
    return {k: v for k, v in files.items() if k.endswith(".distcp")}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted run: every iteration saved (asynchronously), its losses logged."""
    out = tmp_path_factory.mktemp("reference")
    r = subprocess.run([*lc.LAUNCHER, *TOPO, "--steps", str(STEPS), "--save", str(out / "run"),
                        "--log-json", str(out / "log.json")], cwd=lc.REPO, env=_env(), capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def _rows(log: Path) -> list[tuple[float, float]]:
    return [(x["loss"], x["grad_norm"]) for x in json.loads(log.read_text())["rows"]]


def _user_things(root: Path) -> dict[Path, str]:
    """What a user keeps in the save folder: a file, and a folder named like a dead writer's work folder
    (no ownership token: nothing proves the tool made it)."""
    mine = root / f".tmp.iter_0000003.w{work._host_id()}{work._boot_id()}-999999-1-abcdef"
    mine.mkdir()
    things = {root / "notes.txt": "keep me", mine / "partial.distcp": "mine"}
    for p, text in things.items():
        p.write_text(text)
    return things


def _start(reference: Path, root: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    """The faulty run: resume the reference's iteration 2 into ``root`` (a copy of it), in a session
    of its own (the launcher leads its process group)."""
    shutil.copytree(reference / "run" / f"iter_{START:07d}", root / f"iter_{START:07d}")
    (root / LATEST_FILE).write_text(f"{START}\n")
    return subprocess.Popen([*lc.LAUNCHER, *TOPO, "--steps", str(STEPS), "--load", str(root), "--save", str(root)],
                            cwd=lc.REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


class _Tree:
    """Every process below the launcher, sampled while it runs (a killed launcher's children are
    re-parented, so they can only be found while it lives)."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc, self.seen, self._stop = proc, {}, threading.Event()
        self._t = threading.Thread(target=self._watch, daemon=True)
        self._t.start()

    def _watch(self) -> None:
        while not self._stop.is_set() and self.proc.poll() is None:
            self.seen.update(_descendants(self.proc.pid))
            time.sleep(0.05)

    def ranks(self) -> list[int]:
        """The ranks: grandchildren of the launcher (children of its fork server)."""
        children = set(_descendants_depth(self.proc.pid, 1))
        return [p for p in _descendants_depth(self.proc.pid, 2) if p not in children]

    def stop(self) -> None:
        self._stop.set()
        self._t.join(10)


def _descendants_depth(root: int, depth: int) -> list[int]:
    level = [root]
    out: list[int] = []
    for _ in range(depth):
        level = [c for p in level for c in _children(p)]
        out += level
    return out


def _children(pid: int) -> list[int]:
    try:
        tasks = Path(f"/proc/{pid}/task").iterdir()
        return [int(c) for t in tasks for c in (t / "children").read_text().split()]
    except OSError:
        return []


def _finish(proc: subprocess.Popen[str], tree: _Tree) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # the session this test started
            proc.wait(30)
    tree.stop()
    gone_by = time.monotonic() + STOP_WITHIN_S
    while _alive(tree.seen):
        assert time.monotonic() < gone_by, f"alive {STOP_WITHIN_S:.0f} s after the launcher ended: {_alive(tree.seen)}"
        time.sleep(0.1)
    return proc.returncode, out, err


def _check_after(reference: Path, root: Path, things: dict[Path, str], tmp_path: Path, what: str) -> None:
    """The invariants after a fault, then the resume that must end where the reference did."""
    latest = int((root / LATEST_FILE).read_text())
    assert START <= latest <= STEPS, (what, latest)
    v = cli("verify", "--data", str(root))
    assert v.exit_code == 0 and f"iter_{latest:07d}" in v.stdout, (what, v.stdout, v.stderr)
    for it in root.glob("iter_*"):  # nothing looks complete without being complete
        assert cli("verify", "--data", str(it)).exit_code == 0, (what, it.name)
    for p, text in things.items():
        assert p.read_text() == text, (what, p)
    mine = next(p.parent for p in things if p.name == "partial.distcp")
    left = [w for w in work.leftovers(root) if w.path != mine]
    assert all(w.state == "dead" and work.proven(w) for w in left), (what, left)
    # the resume: from latest, saving into the same folder, to the reference's last step
    log = tmp_path / "resumed.json"
    r = subprocess.run([*lc.LAUNCHER, *TOPO, "--steps", str(STEPS), "--load", str(root), "--save", str(root),
                        "--log-json", str(log)], cwd=lc.REPO, env=_env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (what, r.stderr[-3000:])
    assert f"iteration {latest}" in r.stdout, (what, r.stdout[-2000:])
    # a kill after the last save committed leaves nothing to train: the resume logs no row (and may write no log)
    assert (_rows(log) if log.exists() or latest < STEPS else []) == _rows(reference / "log.json")[latest:], what
    assert int((root / LATEST_FILE).read_text()) == STEPS
    last = f"iter_{STEPS:07d}"
    assert _manifest_files(root / last) == _manifest_files(reference / "run" / last), what
    assert [w.path for w in work.leftovers(root)] == [mine], f"{what}: the next save removed the dead writer's"
    for p, text in things.items():
        assert p.read_text() == text, (what, p)


# Every phase with every way to die at least once (one rank's SIGKILL where only that rank is there:
# the commit runs on rank 0).
ALL_HOOKED = [
    "staging:1:sigkill", "staging:0:killpg", "staged:0:launcher", "staged:1:sigterm",
    "during_write:1:sigkill", "during_write:0:killpg", "during_write:1:launcher", "during_write:0:sigterm",
    "after_write:0:sigkill", "after_write:1:launcher",
    "before_rename:0:sigkill", "before_rename:0:killpg", "before_rename:0:sigterm",
    "before_latest:0:sigkill", "before_latest:0:launcher", "before_latest:0:killpg",
]
# Every phase and every kill mode at least once in the default suite (each case is about 15 s of two ranks
# and a launcher on 2 cores); CKPT_FULL_FAULTS=1 runs the whole matrix and six random moments.
FULL = os.environ.get("CKPT_FULL_FAULTS") == "1"
HOOKED = ALL_HOOKED if FULL else [
    "staging:1:sigkill", "staged:0:launcher", "staged:1:sigterm", "during_write:0:killpg",
    "during_write:1:launcher", "after_write:0:sigkill", "before_rename:0:sigterm", "before_latest:0:killpg",
]


@pytest.mark.parametrize("fault", HOOKED)
def test_a_kill_at_each_phase_of_an_async_save(reference: Path, tmp_path: Path, fault: str) -> None:
    root = tmp_path / "run"
    root.mkdir()
    things = _user_things(root)
    proc = _start(reference, root, _env(GTP_FAULT_INJECT=fault))
    rc, _, err = _finish(proc, _Tree(proc))
    assert rc != 0, (fault, err[-2000:])
    if fault.endswith(("killpg", "launcher")):
        assert rc == -signal.SIGKILL, (fault, rc)
    if fault.endswith("sigterm"):
        assert rc == 143 and "terminated (SIGTERM)" in err and "Traceback" not in err, (fault, rc, err[-2000:])
    if fault.endswith(":sigkill"):  # the launcher names the rank that died, in one line
        assert "rank" in err and "Traceback" not in err, err[-2000:]
    _check_after(reference, root, things, tmp_path, fault)


@pytest.mark.parametrize("fault", ["before_rename:0:sigkill", "mid_exchange:0:sigkill", "after_exchange:0:sigkill",
                                   "before_latest:0:killpg"])
def test_a_kill_while_an_iteration_is_saved_again(reference: Path, tmp_path: Path, fault: str) -> None:
    """Iteration 3 is there (committed, latest still 2, as a kill at ``before_latest`` leaves it) and is
    saved again: killed before the old folder is exchanged for the new one, right after the exchange
    (``mid_exchange``: the old copy under the work folder's name, proven by the work folder's token), between
    the exchange and the removal of the old copy (``after_exchange``: the old copy, moved aside, is proven
    this writer's and the next save removes it), and after."""
    root = tmp_path / "run"
    root.mkdir()
    things = _user_things(root)
    shutil.copytree(reference / "run" / "iter_0000003", root / "iter_0000003")
    proc = _start(reference, root, _env(GTP_FAULT_INJECT=fault))
    rc, _, err = _finish(proc, _Tree(proc))
    assert rc != 0, err[-2000:]
    _check_after(reference, root, things, tmp_path, f"saved again, {fault}")


@pytest.mark.parametrize("seed", range(6) if FULL else range(2))
def test_a_kill_at_a_random_moment_of_an_async_save(reference: Path, tmp_path: Path, seed: int) -> None:
    """From outside, as an operator or the OOM killer does: once iteration 3's save has started, after
    a random delay, SIGKILL of the process group, of the launcher or of one rank (seeded: rerun a
    failure with its seed)."""
    rnd = random.Random(seed)
    how = ["killpg", "launcher", "rank"][seed % 3]
    delay = rnd.uniform(0.0, 1.5)
    root = tmp_path / "run"
    root.mkdir()
    things = _user_things(root)
    proc = _start(reference, root, _env())
    tree = _Tree(proc)
    assert proc.stdout is not None
    for line in proc.stdout:
        if "iter_0000003 in the background" in line:
            break
    time.sleep(delay)
    ranks = tree.ranks()
    killed = proc.poll() is None and (how != "rank" or bool(ranks))  # ranks gone already: the run is ending
    if killed:
        try:
            if how == "killpg":
                os.killpg(proc.pid, signal.SIGKILL)
            elif how == "launcher":
                proc.send_signal(signal.SIGKILL)
            else:
                os.kill(rnd.choice(ranks), signal.SIGKILL)
        except ProcessLookupError:  # it exited between the look and the kill
            killed = False
    rc, _, err = _finish(proc, tree)
    what = f"seed {seed}: {how} after {delay:.2f} s"
    assert rc != 0 or not killed, (what, err[-2000:])
    _check_after(reference, root, things, tmp_path, what)


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a small tmpfs (root only)")
def test_a_disk_that_fills_during_the_background_write(reference: Path, tmp_path: Path) -> None:
    """A real full disk (a tmpfs with room for iteration 2's copy and half of another: iteration 3's
    background write fills it): one line naming the folder and the cause, exit 1, the work folder
    removed, latest still 2."""
    disk = tmp_path / "disk"
    disk.mkdir()
    one = sum(-(-p.stat().st_size // 4096) * 4096 for p in (reference / "run" / "iter_0000002").iterdir())
    size_k = (one + one // 2 + 64 * 4096) // 1024
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_k}k", "tmpfs", str(disk)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        root = disk / "run"
        root.mkdir()
        (root / "notes.txt").write_text("keep me")
        proc = _start(reference, root, _env())
        rc, _, err = _finish(proc, _Tree(proc))
        lines = [x for x in err.splitlines() if x.strip()]
        assert rc == 1 and len(lines) == 1, err[-3000:]
        assert "No space left on device" in lines[0] and str(root / "iter_0000003") in lines[0], lines[0]
        assert "latest checkpoint is still iteration 2" in lines[0], lines[0]
        assert sorted(p.name for p in root.iterdir()) == ["iter_0000002", LATEST_FILE, "notes.txt"]
        assert cli("verify", "--data", str(root)).exit_code == 0
        # the resume, on a disk with room: the copy of what the full one held
        again = tmp_path / "again"
        shutil.copytree(root, again)
        _check_after(reference, again, {again / "notes.txt": "keep me"} | _user_things(again), tmp_path, "full")
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)
