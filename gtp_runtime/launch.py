"""Run one function on N local gloo ranks (spawned CPU processes) and collect what each returns.

Used by ``ckpt verify-roundtrip``. Each call starts fresh processes with a new process group on a
new port. The failure modes are the point of this module:

* a rank that raises reports ``type: message`` and the parent names that rank;
* a rank that dies without reporting (a crash, ``os._exit``) is named with its exit code and the
  last line of its log;
* peers left waiting in a collective fail on the gloo timeout (``init_process_group(timeout=)``,
  also the collective timeout) or are terminated by the parent a few seconds after the first
  failure, so a failing rank never turns into a hang, and no process outlives the call.

Children write stdout and stderr to a log file per rank in the work folder, so the parent's
stdout (a JSON document, perhaps) never carries their output.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from gtp_format.commit import write_atomic

TIMEOUT_ENV = "GTP_ROUNDTRIP_TIMEOUT"
DEFAULT_TIMEOUT_S = 300.0
GRACE_S = 10.0  # how long peers of a failed rank may take to report before they are terminated
# Ranks are forked from a fork server that imported torch once (a clean, single-threaded process
# started like a spawn child, with no process group): every rank is still a fresh process, but
# starting 8 of them takes about a second instead of a minute of 8 parallel ``import torch`` on a
# small machine. Where there is no fork server (Windows), ranks are spawned.
START_METHOD = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
# Errors a rank sees because a peer went away (gloo transport, store or collective timeouts).
_PEER_ERROR = re.compile(r"Connection (reset|closed) by peer|Broken pipe|Socket Timeout|Timed out|timed out|"
                         r"gloo/transport|ProcessGroupGloo|recvBytes|Connection refused", re.IGNORECASE)
PRELOAD = ("torch", "torch.distributed", "torch.distributed.checkpoint", "gtp_runtime.training",
           "gtp_runtime.checkpoint.io", "gtp_runtime.roundtrip")


@dataclass
class RankFailure(Exception):
    """A rank failed; ``kind`` is the exception type name (or ``exit`` for a silent death)."""

    rank: int
    kind: str
    message: str
    clean: bool  # the rank raised a known, user-facing error (config or checkpoint), not a crash

    def __str__(self) -> str:
        return f"rank {self.rank}: {self.kind}: {self.message}" if self.kind != "exit" else \
            f"rank {self.rank} {self.message}"


def timeout_s() -> float:
    raw = os.environ.get(TIMEOUT_ENV)
    try:
        return float(raw) if raw else DEFAULT_TIMEOUT_S
    except ValueError:
        return DEFAULT_TIMEOUT_S


def _known_error(e: BaseException) -> bool:
    from gtp_format.layout.config import ConfigError
    from gtp_runtime.checkpoint.io import CheckpointError

    return isinstance(e, (CheckpointError, ConfigError))


def _entry(rank: int, world: int, port: int, workdir: str, tag: str, timeout: float, env: dict[str, str],
           fn: Callable[..., Any], args: tuple) -> None:
    """Body of one spawned rank: redirect output, join the group, run ``fn``, report, leave."""
    # A forkserver child starts with the server's environment, not the caller's current one.
    os.environ.clear()
    os.environ.update(env)
    log = open(os.path.join(workdir, f"{tag}.rank{rank}.log"), "w")  # noqa: SIM115 - lives as long as the process
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    report: dict[str, Any]
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=timeout))
        report = {"status": "ok", "value": fn(*args)}
    except BaseException as e:  # noqa: BLE001 - every failure goes to the parent
        traceback.print_exc()
        msg = " ".join(str(e).split()) or type(e).__name__
        report = {"status": "error", "type": type(e).__name__, "message": msg[:2000], "clean": _known_error(e)}
    out = Path(workdir) / f"{tag}.rank{rank}.json"
    write_atomic(out, json.dumps(report), durable=False)
    sys.stdout.flush()
    sys.stderr.flush()
    log.flush()
    if report["status"] == "ok" and dist.is_initialized():
        dist.destroy_process_group()
    # A failed rank leaves without tearing the group down: its peers may be stuck in a collective
    # and the parent terminates them; a collective teardown here could wait for them.
    os._exit(0 if report["status"] == "ok" else 1)


def _last_log_line(workdir: Path, tag: str, rank: int) -> str:
    try:
        lines = [x for x in (workdir / f"{tag}.rank{rank}.log").read_text(errors="replace").splitlines() if x.strip()]
    except OSError:
        return ""
    return lines[-1].strip()[:300] if lines else ""


def run_local_ranks(world: int, fn: Callable[..., Any], args: tuple, workdir: str | os.PathLike, tag: str,
                    timeout: float | None = None) -> list[Any]:
    """``fn(*args)`` on ``world`` fresh local ranks; the returned values (JSON-able), in rank order.

    Raises :class:`RankFailure` for the rank whose failure looks like the root cause (a config or
    checkpoint error, another exception, a silent death, in that order; peers that only lost their
    connection to a failed rank come last). ``fn`` must be a
    module-level function and ``args`` picklable.
    """
    import torch.multiprocessing as mp

    from gtp_runtime.train import free_port

    workdir = Path(workdir)
    timeout = timeout_s() if timeout is None else timeout
    ctx = mp.get_context(START_METHOD)
    if START_METHOD == "forkserver":
        ctx.set_forkserver_preload(list(PRELOAD))
    port = free_port()
    env = dict(os.environ)
    procs = [ctx.Process(target=_entry, args=(r, world, port, str(workdir), tag, timeout, env, fn, args),
                         daemon=True) for r in range(world)]
    failed_at: float | None = None
    seen: list[int] = []  # failed ranks, in the order their exit was noticed
    stopped: set[int] = set()  # ranks this function terminated
    deadline = time.monotonic() + 4 * timeout + 60
    try:
        for p in procs:
            p.start()
        while any(p.is_alive() for p in procs):
            for r, p in enumerate(procs):
                if not p.is_alive() and p.exitcode != 0 and r not in seen:
                    seen.append(r)
                    failed_at = failed_at or time.monotonic()
            now = time.monotonic()
            if (failed_at is not None and now - failed_at > GRACE_S) or now > deadline:
                break
            procs[0].join(0.1) if procs[0].is_alive() else time.sleep(0.1)
        timed_out = failed_at is None and any(p.is_alive() for p in procs)
    finally:
        for r, p in enumerate(procs):
            if p.is_alive():
                stopped.add(r)
                p.terminate()
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)
    seen += [r for r, p in enumerate(procs) if p.exitcode not in (0, None) and r not in seen]
    reports: dict[int, dict[str, Any]] = {}
    for r in range(world):
        path = workdir / f"{tag}.rank{r}.json"
        if path.exists():
            reports[r] = json.loads(path.read_text())  # written by our own child, in our own temp folder
    if timed_out:
        raise RankFailure(min(stopped, default=0), "exit",
                          f"did not finish within {4 * timeout + 60:.0f} s ({TIMEOUT_ENV}={timeout:.0f}); "
                          "terminated every rank", False)
    ranked: list[tuple[int, int, RankFailure]] = []
    for i, r in enumerate(seen):
        rep = reports.get(r)
        if rep is not None and rep.get("status") == "error":
            f = RankFailure(r, rep["type"], rep["message"], bool(rep["clean"]))
            priority = 0 if f.clean else (3 if _PEER_ERROR.search(f.message) else 1)
        elif r in stopped:
            f = RankFailure(r, "exit", f"was terminated (exit {procs[r].exitcode}) after a peer failed", False)
            priority = 4
        else:
            last = _last_log_line(workdir, tag, r)
            f = RankFailure(r, "exit", f"exited with code {procs[r].exitcode} without reporting"
                            + (f"; its log ends: {last}" if last else ""), False)
            priority = 2
        ranked.append((priority, i, f))
    if ranked:
        # The root cause, not its echo: a config/checkpoint error first, then any other error, then
        # a rank that died silently, then peers that only lost their connection to it.
        raise min(ranked, key=lambda x: (x[0], x[1]))[2]
    missing = [r for r in range(world) if reports.get(r, {}).get("status") != "ok"]
    if missing:
        raise RankFailure(missing[0], "exit", "finished without reporting a result", False)
    return [reports[r]["value"] for r in range(world)]
