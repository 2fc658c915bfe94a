"""``ckpt`` under torchrun: the ranks of one job share a reshard, an import or a ``verify --data``.

Found from torchrun's environment (``RANK``/``WORLD_SIZE``, with ``LOCAL_RANK``/``MASTER_ADDR`` or
``TORCHELASTIC_*``): :func:`join` makes a gloo process group (torch imported here only, lazily: one
process, and every read-only command, never imports it) and makes it :func:`current`. The engines
ask :func:`current` at their few points of contact (which files or chunks are this rank's, the
gather of what each rank wrote or found); with no group they run as one process, unchanged.

The split (:func:`assign`) balances bytes, not counts: items (output files, or the data files a
verify reads) largest first, each onto the rank with the fewest bytes so far, ties to the lower rank,
so every rank computes the same owners from the same plan without a message. Why bytes: a reshard's
files are cut to equal bytes but an import's and a verify's are not (one 9 GB embedding file beside
small layer files), and a rank's time is its bytes (the copy and the hash run at a byte rate).

Failures: every collective goes through :meth:`Group.exchange`, which all-gathers each rank's outcome,
so an error on one rank (a full disk, a damaged source chunk) stops every rank at the same point with
one line naming it. A rank that dies (SIGKILL, a crash) cannot answer: its peers' collective fails on
the gloo connection or on the timeout (``CKPT_DIST_TIMEOUT``, 300 s by default), or torchrun's agent
ends them with SIGTERM; either way they name it by the process ids all ranks exchanged at the start
(a rank of this host whose process is gone). The ranks do not outlive their agent: the parent-death
signal (SIGTERM, so a writer still removes its work folder) is set at :func:`join` -- the rule the
runtime's launcher follows (``gtp_runtime/lifeline.py``), re-derived here since ``ckpt`` never
imports the runtime.

Values between ranks are this job's own (plans' file entries, chunk records, problems), passed by
torch.distributed's object collectives, which pickle: like the runtime's launcher, which takes its
own children's results so. Nothing read from a checkpoint is unpickled.
"""

from __future__ import annotations

import ctypes
import heapq
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

from gtp_format.errors import FormatError
from gtp_format.work import signals_deferred

T = TypeVar("T")
TIMEOUT_ENV = "CKPT_DIST_TIMEOUT"
DEFAULT_TIMEOUT_S = 300.0
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def under_torchrun(env: dict[str, str] | os._Environ[str] | None = None) -> bool:
    """True when torchrun (or any launcher of its environment contract) started this process."""
    env = os.environ if env is None else env
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return False
    return "LOCAL_RANK" in env or "MASTER_ADDR" in env or any(k.startswith("TORCHELASTIC_") for k in env)


def assign(sizes: Sequence[int], world: int) -> list[int]:
    """The rank of each item: largest first onto the least-loaded rank (ties: the lower item index,
    then the lower rank). Deterministic, so every rank computes the same split from the same plan."""
    loads = [(0, r) for r in range(world)]
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        load, r = heapq.heappop(loads)
        owner[i] = r
        heapq.heappush(loads, (load + max(0, sizes[i]), r))
    return owner


COMMITTING = "while committing"


def outcome(what: str) -> str:
    """What a rank that saw a failure ``what`` can say of the output."""
    if what == COMMITTING:  # rank 0 may have renamed the folder into place just before it failed
        return "DST is whole or absent (rank 0 was committing it; ckpt verify DST tells which)"
    return "nothing was committed"


class RankFailed(FormatError):
    """Another rank (or this one) failed: nothing was committed."""


@dataclass(frozen=True)
class Peer:
    rank: int
    host: str
    pid: int
    node: str = ""  # the node this rank runs on (:func:`node_of`): what shares a staging folder
    cpus: tuple[int, ...] = ()  # the CPUs it may run on (its affinity; empty: unknown): what shares the cores


NODE_ENV = "GROUP_RANK"


def node_of(env: dict[str, str] | os._Environ[str] | None = None, host: str | None = None) -> str:
    """This rank's node: torchrun's ``GROUP_RANK`` (the agent's index, one agent per node), else the host name.

    Why not the host name alone: two torchrun agents on one machine (the tests' simulated nodes, or a user's
    ``--nnodes 2`` on one host) share it, and a node-local resource (a bucket output's staging folder) must
    then still be counted per agent, as on a real cluster, so what passes there passes across machines.
    """
    env = os.environ if env is None else env
    raw = env.get(NODE_ENV)
    if raw is None:
        return f"host {host if host is not None else socket.gethostname()}"
    if not raw.isdigit() or len(raw) > 9:
        raise FormatError(f"{NODE_ENV}={raw[:40]!r}: not a node index (a whole number); start ckpt with torchrun")
    return f"node {int(raw)}"


def _set_parent_death_signal(sig: int) -> None:
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        except (OSError, AttributeError):
            pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (exited, not yet reaped by torchrun's agent) is gone for us
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


class Group:
    """This process's place in the job: its rank, the world, and the collectives the engines use."""

    def __init__(self, rank: int, world: int, peers: list[Peer]) -> None:
        self.rank, self.world, self.peers = rank, world, peers
        self.passed: set[str] = set()  # the exchanges every rank passed (:meth:`exchange`)

    @property
    def root(self) -> bool:
        return self.rank == 0

    @property
    def nodes(self) -> list[str]:
        """The job's nodes (:func:`node_of`), in the order of their lowest rank."""
        return list(dict.fromkeys(p.node for p in self.peers))

    def mine(self, sizes: Sequence[int]) -> list[int]:
        """The items (indices, in order) this rank handles, of items of these sizes (:func:`assign`)."""
        return [i for i, r in enumerate(assign(sizes, self.world)) if r == self.rank]

    def dead(self, wait: float = 0.0) -> list[int]:
        """Ranks of this host whose process is gone (``wait``: seconds to keep looking while none is: a
        killed process's sockets close before the kernel marks it exited)."""
        host = socket.gethostname()
        deadline = time.monotonic() + wait
        while True:
            out = [p.rank for p in self.peers if p.host == host and p.rank != self.rank and not _alive(p.pid)]
            if out or time.monotonic() >= deadline:
                return out
            time.sleep(0.05)

    def lost(self, what: str) -> RankFailed:
        """The one line when a peer stopped answering (killed, crashed, or its host gone)."""
        dead = self.dead(wait=2.0)
        who = (f"rank {dead[0]} (pid {self.peers[dead[0]].pid})" if dead else
               "another rank (on another host, or it stopped answering)")
        return RankFailed(f"{who} failed {what}; rank {self.rank} stopped: {outcome(what)} "
                          "(torchrun's report names its exit)")

    def _collective(self, fn: Callable[[], T], what: str) -> T:
        try:
            return fn()
        except (RuntimeError, ValueError, ConnectionError) as e:  # gloo: a peer's socket closed, or the timeout
            raise self.lost(what) from e

    def all_gather(self, value: Any, what: str = "") -> list[Any]:
        dist = _dist()

        out: list[Any] = [None] * self.world
        self._collective(lambda: dist.all_gather_object(out, value), what)
        return out

    def broadcast(self, value: Any, what: str = "") -> Any:
        dist = _dist()

        box = [value if self.root else None]
        self._collective(lambda: dist.broadcast_object_list(box, src=0), what)
        return box[0]

    def exchange(self, fn: Callable[[], T], what: str) -> list[T]:
        """Run ``fn`` here and gather every rank's result; if any rank failed, every rank raises one line
        naming the first that did (its own error where it was this rank's). ``KeyboardInterrupt`` and
        SIGTERM pass through: the peers learn of them from the broken connection."""
        try:
            mine: tuple[bool, Any, int] = (True, fn(), 0)
        except FormatError as e:
            mine = (False, e.message, e.exit_code)
        except OSError as e:
            mine = (False, f"{e.filename or ''}: {e.strerror or e}".lstrip(": "), 2)
        except Exception as e:  # noqa: BLE001 - a rank's bug still ends every rank with one line
            mine = (False, f"unexpected {type(e).__name__}: {str(e)[:300]}", 2)
        # the gather and its record in :attr:`passed` with no signal handler between: a rank that torchrun's SIGTERM
        # reaches just as an exchange every rank passed returns must know it passed (after the upload's exchange
        # rank 0 may be committing, and this rank's objects must then stay)
        with signals_deferred():
            got = self.all_gather(mine, what)
            for r, (ok, value, code) in enumerate(got):
                if not ok:
                    if r == self.rank:
                        raise RankFailed(f"rank {r}: {value}", code)
                    raise RankFailed(f"rank {r} failed {what}: {value}; rank {self.rank} stopped: {outcome(what)}",
                                     code)
            self.passed.add(what)
        return [value for _, value, _ in got]

    def barrier(self, what: str) -> None:
        self.all_gather(None, what)


_current: Group | None = None


def _dist() -> Any:
    """torch.distributed, through the format's one torch entry point (only the ranked path gets here)."""
    from gtp_format.torch_adapter import load_torch

    return load_torch().distributed


def current() -> Group | None:
    """The group of this torchrun job (None: one process, or a job of one rank)."""
    return _current


def timeout_s() -> float:
    raw = os.environ.get(TIMEOUT_ENV, "")
    try:
        return float(raw) if raw else DEFAULT_TIMEOUT_S
    except ValueError:
        raise FormatError(f"{TIMEOUT_ENV}={raw[:40]!r}: give the rank timeout in seconds") from None


def join() -> Group | None:
    """Join torchrun's job over gloo and make it :func:`current` (None: not under torchrun, or one rank)."""
    global _current
    if not under_torchrun():
        return None
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except ValueError:
        raise FormatError("RANK/WORLD_SIZE: not whole numbers; start ckpt with torchrun") from None
    if world <= 1:
        return None
    node = node_of()
    timeout = timeout_s()
    _set_parent_death_signal(signal.SIGTERM)  # torchrun's agent gone: end as if it had terminated us
    dist = _dist()

    if not dist.is_initialized():
        try:
            dist.init_process_group("gloo", timeout=timedelta(seconds=timeout))
        except (RuntimeError, ValueError, ConnectionError) as e:
            raise FormatError(f"rank {rank}: cannot join the torchrun job ({str(e).splitlines()[0][:200]}); "
                              "check --rdzv-endpoint/MASTER_ADDR and that every node started") from None
    group = Group(rank, world, [])
    me = Peer(rank, socket.gethostname(), os.getpid(), node, affinity())
    group.peers = group.all_gather(me, "while joining")
    _current = group
    return group


def leave() -> None:
    global _current
    _current = None
    dist = _dist()

    if dist.is_initialized():
        dist.destroy_process_group()


def on_root(fn: Callable[[], T]) -> T | None:
    """Run an engine that does not split its work (yet) on rank 0 alone, as one process; the other ranks
    wait for its outcome (its error is theirs, naming rank 0) and get None. Without a group: ``fn()``."""
    global _current
    group = _current
    if group is None:
        return fn()
    _current = None
    try:
        got = group.exchange(lambda: fn() if group.root else None, "while rank 0 ran it alone")
    finally:
        _current = group
    return got[0] if group.root else None


FAULT_ENV = "CKPT_RANK_FAULT"


def fault(point: str) -> None:
    """Fault injection for the tests (as the runtime's ``GTP_FAULT_INJECT``): ``CKPT_RANK_FAULT=RANK:POINT``
    kills that rank with SIGKILL when it reaches ``point`` (``created``: rank 0, its work folder made, before
    it tells the others where; ``copy``: its files written, before the gather; ``upload``: a bucket output on
    several nodes, its first object created; ``commit``: before the commit's exchange; ``renamed``: rank 0, just
    after its commit)."""
    if faulted(point):
        os.kill(os.getpid(), signal.SIGKILL)


def faulted(point: str) -> bool:
    """Whether ``CKPT_RANK_FAULT`` names this rank and ``point`` (a hook that does more than kill: ``damage``,
    a bucket output's rank flipping a byte of a staged file it is about to check; ``claim``, its verdict
    naming a file of its node that is another rank's to check)."""
    want = os.environ.get(FAULT_ENV)
    return bool(want) and _current is not None and want == f"{_current.rank}:{point}"


def affinity() -> tuple[int, ...]:
    """The CPUs this process may run on (``sched_getaffinity``), sorted; empty where the OS cannot say."""
    try:
        return tuple(sorted(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return ()


def sharing(group: Group) -> int:
    """How many ranks of ``group`` (this one included) run on this rank's host with exactly its affinity: the
    ranks whose threads take turns on the same cores. The host, not the node (:func:`node_of`): two torchrun
    agents on one machine are two nodes but one set of cores. Ranks bound to cores of their own (``numactl`` or
    ``taskset`` per rank, a scheduler's cpuset per rank) count one each: their affinity is already their share."""
    me = group.peers[group.rank] if 0 <= group.rank < len(group.peers) else None
    if me is None:
        return 1
    return max(1, sum(1 for p in group.peers if p.host == me.host and p.cpus == me.cpus))


def cores_per_rank(cores: int) -> int:
    """This rank's share of a per-machine thread count: ``cores`` divided by the ranks that share this rank's
    cores (:func:`sharing`), at least 1; ``cores`` itself with no group. Why: every pool sized from the
    affinity's cores ran that many threads in each rank, 4 ranks on 4 cores 16 busy threads (4 ranks against
    one process on the same 4 cores: reshard 0.90x, ``verify --data`` 0.54x), and a verify's default of one
    reader per core, on each of 4 ranks of a 16-core host, 64 threads."""
    group = _current
    return cores if group is None else max(1, cores // sharing(group))
