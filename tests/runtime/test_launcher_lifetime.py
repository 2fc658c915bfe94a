"""No child outlives the launcher (issue 22, class 10), and a taken rendezvous port costs a retry.

The launcher is killed mid-training, with SIGKILL and with SIGTERM; within a bounded time no process
it started (ranks, fork server, resource tracker: every descendant seen before the kill) may be
alive, and no iteration may be saved after they are gone.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import launch_jobs as jobs
import launcher_cases as lc
import pytest

from gtp_runtime import launch

STOP_WITHIN_S = 20.0  # a rank's lifeline thread and the parent-death signal act within milliseconds


def _proc_stat(pid: int) -> tuple[int, str, int] | None:
    """(ppid, state, start time) of ``pid`` from /proc, or None if it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()
    return int(fields[1]), fields[0], int(fields[19])


def _descendants(root: int) -> dict[int, int]:
    """Every live descendant of ``root``: pid -> start time (so a reused pid is not mistaken for it)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (st := _proc_stat(int(entry))) is not None:
            children.setdefault(st[0], []).append(int(entry))
    found: dict[int, int] = {}
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found and (st := _proc_stat(child)) is not None:
                found[child] = st[2]
                todo.append(child)
    return found


def _alive(procs: dict[int, int]) -> list[int]:
    return [pid for pid, start in procs.items()
            if (st := _proc_stat(pid)) is not None and st[2] == start and st[1] not in ("Z", "X")]


def _iterations(save: Path) -> set[str]:
    return {p.name for p in save.glob("iter_*")}


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the process tree from /proc (Linux)")
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["sigkill", "sigterm"])
def test_killing_the_launcher_stops_every_child(tmp_path: Path, sig: signal.Signals) -> None:
    save = tmp_path / "run"
    cmd = [*lc.LAUNCHER, "--nproc-per-node", "2", "--cp", "2", "--fold-cp", "--device", "cpu", "--steps", "100000",
           "--save", str(save), "--save-interval", "1"]
    proc = subprocess.Popen(cmd, cwd=lc.REPO, env={**os.environ, "PYTHONPATH": str(lc.REPO)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while len(_iterations(save)) < 2:  # mid-training: saving every iteration
            assert proc.poll() is None, f"the launcher ended early: {proc.stderr.read() if proc.stderr else ''}"
            assert time.monotonic() < deadline, "no iteration saved within 240 s"
            time.sleep(0.2)
        children = _descendants(proc.pid)
        # the two ranks, forked from the launcher (one thread, gloo: launch.start_method)
        assert len(children) >= 2, f"expected the ranks under the launcher, got {children}"
        before = _iterations(save)
        proc.send_signal(sig)
        killed_at = time.monotonic()
        while _alive(children):
            assert time.monotonic() - killed_at < STOP_WITHIN_S, \
                f"still alive {STOP_WITHIN_S:.0f} s after {sig.name} of the launcher: {_alive(children)}"
            time.sleep(0.1)
        after = _iterations(save)
        # A save already under way at the kill may have committed in the milliseconds before the
        # ranks noticed; nothing later may appear.
        assert len(after - before) <= 1, f"training went on after the launcher was killed: {sorted(after - before)}"
        time.sleep(3)
        assert _iterations(save) == after, "an iteration was saved after every child was gone"
        code = proc.wait(30)
        if sig == signal.SIGTERM:
            err = proc.stderr.read() if proc.stderr else ""
            assert code == 143, err
            assert "terminated (SIGTERM): stopped every rank" in err and "Traceback" not in err, err
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # the session this test started
            proc.wait(30)


def test_the_rendezvous_port_is_held_from_before_the_ranks_start() -> None:
    """The launcher binds and listens on the store's port before any rank exists (no other process can
    take it in between, as one launch in 20 lost a probed port on a busy machine), and a rank that
    connects before the store serves the socket is answered once it does."""
    from datetime import timedelta

    import torch.distributed as dist

    sock = launch.rendezvous_socket()
    port = sock.getsockname()[1]
    with socket.socket() as other, pytest.raises(OSError):
        other.bind(("127.0.0.1", port))  # taken from the start
    early = socket.create_connection(("127.0.0.1", port), timeout=5)  # queued by the kernel: no store yet
    early.close()
    store = launch.rendezvous_store(sock, 30)
    client = dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=30))
    client.set("k", "v")
    assert store.get("k") == b"v" and sock.fileno() == -1  # the store took the socket over
    out = launch.run_local_ranks(2, jobs.whoami, ("x",), timeout=60)
    assert [o[:3] for o in out] == [(0, 3, "x"), (1, 3, "x")]


def test_a_launcher_with_one_thread_forks_its_gloo_ranks_and_one_with_threads_does_not() -> None:
    import threading

    assert launch.start_method("nccl") == launch.START_METHOD
    # a fresh launcher (this test's process may run threads of its own: xdist's, a store client's)
    probe = "import gtp_runtime.launch as launch; print(launch.start_method('gloo'))"
    fresh = subprocess.run([sys.executable, "-c", probe], cwd=lc.REPO, env={**os.environ, "PYTHONPATH": str(lc.REPO)},
                           capture_output=True, text=True, timeout=120)
    assert fresh.stdout.strip() == "fork", fresh.stderr[-2000:]
    stop = threading.Event()
    t = threading.Thread(target=stop.wait)
    t.start()
    try:
        assert launch.start_method("gloo") == launch.START_METHOD
    finally:
        stop.set()
        t.join()
