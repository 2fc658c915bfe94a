"""The one way this project starts local ranks: ``fn(*args)`` on N fresh processes, one result each.

Used by the ``train`` launcher, ``ckpt verify-roundtrip``, the test harness, the benchmarks and the
fixture scripts (before this module there were six copies, each failing differently: some joined
forever, some printed every rank's traceback, one lost the failing rank's name).

Each call starts fresh processes with a new process group (gloo, or NCCL with one GPU per rank) on a
new port. The rendezvous store is served by this process (:func:`rendezvous_store`) on a socket this
process bound and listens on before any rank starts (:func:`rendezvous_socket`), so no other launch
can take the port between finding it and serving it (probing a free port and binding it later failed
about one launch in 20 on a busy machine). The ranks only connect to it. The failure modes are the
point of this module:

* a rank that raises reports ``type: message`` and the parent names that rank in one line; its full
  traceback goes to that rank's log file, never to the console;
* a rank that dies without reporting (a crash, ``os._exit``) is named with its exit code and the
  last line of its log;
* peers left waiting in a collective fail on the process-group timeout
  (``init_process_group(timeout=)``, also the collective timeout) or are terminated by the parent
  ``GRACE_S`` seconds after the first failure, so a failing rank never turns into a hang, and no
  process outlives the call. With a ``deadline``, a run that never finishes is stopped too;
* no rank outlives the caller, even one killed by SIGKILL: see :mod:`gtp_runtime.lifeline` (the
  parent-death signal, a pipe the ranks watch, SIGTERM stopping the ranks as SIGINT does).

Children write stderr (and, unless ``stdout="inherit"``, stdout) to ``{workdir}/{tag}.rank{r}.log``,
so the parent's stdout (a JSON document, perhaps) carries only what the caller chose. Results come
back through a pipe per rank, pickled: they are our own children's values.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection as mpc
import os
import pickle
import re
import shutil
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import numpy  # noqa: F401 - its BLAS thread pool starts at import: counted in the baseline below

from gtp_format.work import sigterm_raises
from gtp_runtime.lifeline import watch_lifeline


def _native_threads() -> int | None:
    """This process's threads as the kernel counts them (Linux), Python's or not; None where unknown."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return None


# The threads every process importing this module has anyway (numpy's BLAS pool, which resets
# itself in a forked child). A thread started later, by a library this process has used since
# (an object store client's runtime, torch's intra-op pool), makes forking unsafe: a forked rank
# that loaded a checkpoint from a bucket hung in the store client, whose threads it did not have.
THREADS_AT_IMPORT = _native_threads()

TIMEOUT_ENV = "GTP_ROUNDTRIP_TIMEOUT"
DEFAULT_TIMEOUT_S = 300.0
GRACE_S = 10.0  # how long peers of a failed rank may take to report before they are terminated
# How ranks start (:func:`start_method`). Where the caller is a launcher with one thread, on gloo,
# ranks are forked from it, after it imported what they need: a one-step, 4-rank CPU run took 3.6 s
# of CPU instead of 6.8 s, most of the difference being ``import torch`` done again by a fork server.
# Elsewhere (a caller with threads of its own, CUDA ranks) they are forked from a fork server that
# imported torch once (a clean, single-threaded process started like a spawn child, with no process
# group and no CUDA context): starting 8 of them takes about a second instead of a minute of 8
# parallel ``import torch`` on a small machine. Where there is neither (Windows), ranks are spawned.
START_METHOD = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
# Errors a rank sees because a peer went away (gloo transport, store or collective timeouts).
_PEER_ERROR = re.compile(r"Connection (reset|closed) by peer|Broken pipe|Socket Timeout|Timed out|timed out|"
                         r"gloo/transport|ProcessGroupGloo|recvBytes|Connection refused|NCCL", re.IGNORECASE)
PRELOAD = ("torch", "torch.distributed", "torch.distributed.checkpoint", "gtp_runtime.training",
           "gtp_runtime.checkpoint.io", "gtp_runtime.roundtrip",
           "torch.nn.attention.bias")  # CP attention on CPU; it imports torch._dynamo (0.9 s), once here, not per rank
AUTO = "auto"


class LaunchError(Exception):
    """The ranks could not be started at all (no rank ran): one line naming the cause and the fix."""


def _start(procs: list[Any]) -> None:
    """Start every rank; the fork server's socket path that AF_UNIX cannot hold is named as TMPDIR.

    The fork server listens on a socket under ``TMPDIR`` (``$TMPDIR/pymp-XXXXXXXX/listener-XXXXXXXX``);
    AF_UNIX paths hold 107 bytes, so a TMPDIR longer than about 70 bytes failed the first
    ``start()`` with a bare ``OSError: AF_UNIX path too long`` and a traceback.
    """
    try:
        for p in procs:
            p.start()
    except OSError as e:
        if "AF_UNIX path too long" not in str(e):
            raise
        tmp = tempfile.gettempdir()
        raise LaunchError(f"cannot start the ranks: TMPDIR={tmp} ({len(os.fsencode(tmp))} bytes) is too long for the "
                          "fork server's socket path (AF_UNIX allows 107 bytes); set TMPDIR to a shorter folder, "
                          "e.g. TMPDIR=/tmp") from None


@dataclass
class RankFailure(Exception):
    """A rank failed; ``kind`` is the exception type name (or ``exit`` for a silent death)."""

    rank: int
    kind: str
    message: str
    clean: bool  # the rank raised a known, user-facing error (config or checkpoint), not a crash
    log: str | None = None  # that rank's log (its traceback), when the caller keeps the work folder

    def __str__(self) -> str:
        return f"rank {self.rank}: {self.kind}: {self.message}" if self.kind != "exit" else \
            f"rank {self.rank} {self.message}"

    def line(self) -> str:
        """One line for a console: a known error as its message, anything else with its log's path."""
        if self.clean:
            return f"rank {self.rank}: {self.message}"
        return str(self) + (f" (full log: {self.log})" if self.log else "")


MAX_TIMEOUT_S = 7 * 86400.0


def timeout_s() -> float:
    """``$GTP_ROUNDTRIP_TIMEOUT`` in seconds (ASCII, finite, in (0, a week]); a bad value is a
    :class:`LaunchError` naming it (it was read as the default, or as any script's digits)."""
    from gtp_format.numbers import NumberError, env_float

    try:
        value = env_float(TIMEOUT_ENV, DEFAULT_TIMEOUT_S, 0.0, MAX_TIMEOUT_S)
    except NumberError as e:
        raise LaunchError(f"{e}; set it to a number of seconds, e.g. 300") from None
    if value <= 0:
        raise LaunchError(f"{TIMEOUT_ENV}={value:g} is not a positive number of seconds; set it to e.g. 300")
    return value


MAX_LOCAL_RANKS = 4096  # local processes; a machine has at most a few hundred cores and 8-16 GPUs
FDS_PER_RANK = 4  # what this process holds per rank: its pipe's read end, its sentinel, the store's socket, a log


def max_local_ranks() -> int:
    """How many ranks :func:`run_local_ranks` may start: :data:`MAX_LOCAL_RANKS`, and no more than the
    open-file limit leaves descriptors for (64 kept for the rest of the process)."""
    import resource

    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        return MAX_LOCAL_RANKS
    return max(1, min(MAX_LOCAL_RANKS, (soft - 64) // FDS_PER_RANK))


def rendezvous_socket() -> socket.socket:
    """A socket listening on a local port the kernel chose, bound here and held until the store serves it."""
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", 0))
        s.listen(socket.SOMAXCONN)
    except OSError:
        s.close()
        raise
    return s


def rendezvous_store(sock: socket.socket, timeout: float) -> Any:
    """A ``TCPStore`` served by this process on ``sock`` (:func:`rendezvous_socket`), which it takes over.

    Made after the ranks start: a forked rank must not inherit the store's server thread.
    """
    import torch.distributed as dist

    port = sock.getsockname()[1]
    return dist.TCPStore("127.0.0.1", port, None, True, timedelta(seconds=timeout), wait_for_workers=False,
                         master_listen_fd=sock.detach())  # the store closes it


def start_method(backend: str) -> str:
    """``fork`` where forking this process is safe and cheaper, else :data:`START_METHOD`.

    Safe: gloo ranks (CUDA cannot be used in a child forked after its parent touched it), no
    Python thread but this one (a lock another thread held at the fork would stay held in the
    child), and no native thread but those of :data:`THREADS_AT_IMPORT` (a library's runtime
    threads do not exist in a forked child, which then waits for them forever).
    """
    if backend != "gloo" or "fork" not in multiprocessing.get_all_start_methods() or threading.active_count() != 1:
        return START_METHOD
    if THREADS_AT_IMPORT is None or _native_threads() != THREADS_AT_IMPORT:
        return START_METHOD
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return START_METHOD
    return "fork"


# User-facing errors (bad flags, a bad checkpoint): reported as their message, not as a crash.
# Matched by name so that a failing rank need not import the runtime to classify its error.
KNOWN_ERRORS = frozenset({"gtp_runtime.checkpoint.errors.CheckpointError", "gtp_format.layout.config.ConfigError",
                          "gtp_format.errors.FormatError", "gtp_runtime.data.indexed.DataError"})


def _known_error(e: BaseException) -> bool:
    return any(f"{c.__module__}.{c.__qualname__}" in KNOWN_ERRORS for c in type(e).__mro__)


def log_path(workdir: str | os.PathLike, tag: str, rank: int) -> Path:
    return Path(workdir) / f"{tag}.rank{rank}.log"


def _entry(rank: int, world: int, port: int, workdir: str, tag: str, timeout: float, env: dict[str, str],
           backend: str, stdout: str, conn: Any, lifeline: Any, fn: Callable[..., Any], args: tuple,
           inherited: tuple = ()) -> None:
    """Body of one rank: tie it to the launcher, redirect output, join the group, run ``fn``, report, leave.

    ``inherited``: what a forked rank holds of the launcher's and must let go, the lifeline's write
    end first (while a rank held it, the launcher's death would never reach the ranks) and the other
    ranks' pipe ends (a peer's death is seen as the end of its pipe).
    """
    if inherited:  # forked from the launcher: its SIGTERM handler and descriptors are not this rank's
        import signal

        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for c in inherited:
            c.close()
    watch_lifeline(lifeline)
    # A forkserver child starts with the server's environment, not the caller's current one.
    os.environ.clear()
    os.environ.update(env)
    log = open(log_path(workdir, tag, rank), "w")  # noqa: SIM115 - lives as long as the process
    if stdout != "inherit":
        os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    if inherited:  # the launcher's sys.stdout may be anything (a capture, a notebook's): write to the fds
        sys.stdout = open(1, "w", closefd=False, errors="backslashreplace")  # noqa: SIM115
        sys.stderr = open(2, "w", buffering=1, closefd=False, errors="backslashreplace")  # noqa: SIM115
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    report: dict[str, Any]
    try:
        device = None
        if backend == "nccl":
            if os.environ.get("GTP_BIND_CPUS") == "1":  # opt-in: see gtp_runtime/affinity.py
                from gtp_runtime.affinity import bind_rank, pci_bus_ids

                bind_rank(rank, world, pci_bus_ids(min(world, torch.cuda.device_count())))
            torch.cuda.set_device(rank)
            device = torch.device("cuda", rank)  # binds the communicator to this rank's GPU
        else:
            torch.set_num_threads(1)
        store = dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=timeout))  # the launcher's
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timedelta(seconds=timeout),
                                device_id=device)
        report = {"status": "ok", "value": fn(*args)}
    except BaseException as e:  # noqa: BLE001 - every failure goes to the parent
        traceback.print_exc()
        from gtp_runtime.last_resort import describe, root_cause  # escaped, bounded, never raises

        cause = root_cause(e)
        msg = describe(cause, 2000) or type(cause).__name__
        report = {"status": "error", "type": type(cause).__name__, "message": msg, "clean": _known_error(cause)}
    try:
        # Plain pickle, not the pipe's own (torch's ForkingPickler would hand tensors over as
        # shared-memory handles that die with this process, which exits right after).
        payload = pickle.dumps(report, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:  # noqa: BLE001 - an unpicklable result is this rank's failure
        traceback.print_exc()
        report = {"status": "error", "type": type(e).__name__, "message": f"cannot return the result: {e}"[:2000],
                  "clean": False}
        payload = pickle.dumps(report)
    conn.send_bytes(payload)
    conn.close()
    sys.stdout.flush()
    sys.stderr.flush()
    log.flush()
    if report["status"] == "ok" and dist.is_initialized():
        dist.destroy_process_group()
    # A failed rank leaves without tearing the group down: its peers may be stuck in a collective
    # and the parent terminates them; a collective teardown here could wait for them.
    os._exit(0 if report["status"] == "ok" else 1)


def _last_log_line(path: Path) -> str:
    try:
        lines = [x for x in path.read_text(errors="replace").splitlines() if x.strip()]
    except OSError:
        return ""
    return lines[-1].strip()[:300] if lines else ""


class _Ranks:
    """The running processes and what each has reported so far."""

    def __init__(self, procs: list[Any], conns: list[Any]) -> None:
        self.procs, self.conns = procs, conns
        self.reports: dict[int, dict[str, Any] | None] = {}  # None: the pipe closed without a report
        self.failed: list[int] = []  # in the order each failure was noticed
        self.stopped: set[int] = set()  # ranks this module terminated

    def drain(self) -> None:
        for r, conn in enumerate(self.conns):
            if r not in self.reports and conn.poll():
                try:
                    self.reports[r] = pickle.loads(conn.recv_bytes())  # our own child's report
                except (EOFError, OSError):
                    self.reports[r] = None

    def status(self, r: int) -> str | None:
        rep = self.reports.get(r)
        return rep.get("status") if rep else None

    def note_failures(self) -> None:
        for r, p in enumerate(self.procs):
            ok = self.status(r) == "ok"
            if r not in self.failed and not ok and (self.status(r) == "error" or
                                                     (not p.is_alive() and p.exitcode != 0)):
                self.failed.append(r)

    def waitables(self) -> list[Any]:
        return [p.sentinel for p in self.procs if p.is_alive()] + \
            [c for r, c in enumerate(self.conns) if r not in self.reports]

    def stop(self) -> None:
        started = [p for p in self.procs if p.pid is not None]  # a start that raised leaves the rest unstarted
        for r, p in enumerate(self.procs):
            if p.pid is not None and p.is_alive():
                self.stopped.add(r)
                p.terminate()
        for p in started:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)


def _watch(ranks: _Ranks, deadline: float | None) -> bool:
    """Wait until every rank is done, a failure's grace period ends or the deadline; True on timeout."""
    start = time.monotonic()
    first_failure: float | None = None
    all_ok_at: float | None = None
    world = len(ranks.procs)
    while True:
        ranks.drain()
        ranks.note_failures()
        now = time.monotonic()
        if ranks.failed and first_failure is None:
            first_failure = now
        if all(ranks.status(r) == "ok" for r in range(world)) and all_ok_at is None:
            all_ok_at = now  # only teardown is left; a rank stuck in it is stopped after the grace
        if not any(p.is_alive() for p in ranks.procs):
            return False
        if any(t is not None and now - t > GRACE_S for t in (first_failure, all_ok_at)):
            return False
        if deadline is not None and now - start > deadline:
            return True
        mpc.wait(ranks.waitables(), timeout=0.5)


def _root_cause(ranks: _Ranks, workdir: Path, tag: str, keep_logs: bool) -> RankFailure | None:
    """The failure that explains the others: a config/checkpoint error first, then any other error,
    then a rank that died silently, then ranks terminated here, then peers that only lost a peer."""
    ranked: list[tuple[int, int, RankFailure]] = []
    for i, r in enumerate(ranks.failed):
        rep = ranks.reports.get(r)
        log = str(log_path(workdir, tag, r)) if keep_logs else None
        code = ranks.procs[r].exitcode
        if rep is not None and rep.get("status") == "error":
            f = RankFailure(r, rep["type"], rep["message"], bool(rep["clean"]), log)
            priority = 0 if f.clean else (3 if _PEER_ERROR.search(f.message) else 1)
        elif r in ranks.stopped:
            f = RankFailure(r, "exit", f"was terminated (exit {code}) after a peer failed", False, log)
            priority = 4
        else:
            last = _last_log_line(log_path(workdir, tag, r))
            f = RankFailure(r, "exit", f"exited with code {code} without reporting"
                            + (f"; its log ends: {last}" if last else ""), False, log)
            priority = 2
        ranked.append((priority, i, f))
    return min(ranked, key=lambda x: (x[0], x[1]))[2] if ranked else None


def run_local_ranks(world: int, fn: Callable[..., Any], args: Sequence[Any] = (),
                    workdir: str | os.PathLike | None = None, tag: str = "rank", timeout: float | None = None, *,
                    deadline: float | None | Literal["auto"] = AUTO, env: dict[str, str] | None = None,
                    backend: str = "gloo", stdout: Literal["log", "inherit"] = "log",
                    preload: Sequence[str] = PRELOAD, warm: Callable[[], Any] | None = None) -> list[Any]:
    """``fn(*args)`` on ``world`` fresh local ranks; the returned values, in rank order.

    ``fn`` must be a module-level function and ``args`` and the results picklable. ``timeout`` is
    the process-group (and collective) timeout, by default ``$GTP_ROUNDTRIP_TIMEOUT`` or 300 s;
    ``deadline`` bounds the whole call (``"auto"``: 4 x timeout + 60 s; ``None``: no bound, for
    training). ``env`` is added to this process's environment in the ranks. ``backend="nccl"``
    gives rank ``r`` GPU ``r``. Logs go to ``workdir`` (by default a temporary folder, removed
    when every rank succeeded and kept otherwise, so that :attr:`RankFailure.log` can be read).

    ``preload``: modules every rank needs, imported once where the ranks are forked from. ``warm``:
    work every rank would do first (loading a compiled loop), done once here when the ranks are
    forked from this process (:func:`start_method`), and left to each rank otherwise.

    Raises :class:`RankFailure` for the rank whose failure looks like the root cause.
    """
    import torch.multiprocessing as mp

    most = max_local_ranks()
    if not 1 <= world <= most:  # before any pipe or process: 10^12 ranks ran out of descriptors mid-loop
        raise LaunchError(f"{world} local ranks: this launcher starts 1 to {most} ranks on one machine (one process "
                          "and a pipe each, within the open-file limit); give fewer ranks (--nproc-per-node, --dp)")
    own = workdir is None
    work = Path(tempfile.mkdtemp(prefix=f"gtp-{tag}-")) if own else Path(workdir)  # type: ignore[arg-type]
    timeout = timeout_s() if timeout is None else timeout
    limit = 4 * timeout + 60 if deadline == AUTO else deadline
    method = start_method(backend)
    if method == "fork":  # what the ranks need, imported (and warmed) once here for all of them
        import importlib

        for name in preload:
            importlib.import_module(name)
        if warm is not None:
            warm()
        method = start_method(backend)  # what it imported or warmed may have started a thread
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(list(preload))
    sock = rendezvous_socket()
    port = sock.getsockname()[1]
    child_env = {**os.environ, **(env or {})}
    pipes = [ctx.Pipe(duplex=False) for _ in range(world)]
    # The lifeline: this process keeps the only write end (the ranks get the read end), so however
    # it dies, every rank sees EOF and ends (gtp_runtime.lifeline).
    life_recv, life_send = ctx.Pipe(duplex=False)

    def inherited(r: int) -> tuple:
        if method != "fork":
            return ()
        return (life_send, sock, *(c for recv, send in pipes for c in (recv, send) if c is not pipes[r][1]))

    procs = [ctx.Process(target=_entry, args=(r, world, port, str(work), tag, timeout, child_env, backend,
                                              stdout, pipes[r][1], life_recv, fn, tuple(args), inherited(r)),
                         daemon=True)
             for r in range(world)]
    ranks = _Ranks(procs, [recv for recv, _ in pipes])
    timed_out = False
    store = None
    try:
        with sigterm_raises(replace=True):  # SIGTERM as SIGINT: the finally below stops every rank
            _start(procs)
            store = rendezvous_store(sock, timeout)  # a rank that connects earlier waits in the listen queue
            life_recv.close()
            for _, send in pipes:
                send.close()  # the children hold theirs: a rank that dies closes its pipe
            timed_out = _watch(ranks, limit)
    except LaunchError:  # no rank ran: nothing in the work folder is worth keeping
        if own:
            shutil.rmtree(work, ignore_errors=True)
        raise
    finally:
        ranks.stop()
        ranks.drain()
        ranks.note_failures()
        for recv, _ in pipes:
            recv.close()
        life_send.close()
        sock.close()  # where the store never took it over
        del store
    keep = not own
    try:
        if timed_out:
            keep = True
            stuck = min((r for r in range(world) if ranks.status(r) != "ok"), default=0)
            raise RankFailure(stuck, "exit", f"did not finish within {limit:.0f} s ({TIMEOUT_ENV}={timeout:.0f}); "
                              "terminated every rank", False, str(log_path(work, tag, stuck)))
        failure = _root_cause(ranks, work, tag, True)
        if failure is not None:
            keep = True
            raise failure
        missing = [r for r in range(world) if ranks.status(r) != "ok"]
        if missing:
            keep = True
            raise RankFailure(missing[0], "exit", "finished without reporting a result", False,
                              str(log_path(work, tag, missing[0])))
        return [ranks.reports[r]["value"] for r in range(world)]  # type: ignore[index]
    finally:
        if own and not keep:
            shutil.rmtree(work, ignore_errors=True)
