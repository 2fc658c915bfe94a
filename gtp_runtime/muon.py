"""Distributed Muon: whole-matrix Newton-Schulz on one owner rank per matrix, AdamW for the rest.

Muon (momentum orthogonalized by Newton-Schulz) updates a 2-D weight ``W`` [m, n] with
``M <- beta*M + (1-beta)*G`` (momentum), ``U = (1-beta)*G + beta*M`` (Nesterov),
``O = NS5(U)`` (five quintic Newton-Schulz steps that push every singular value of ``U`` towards 1),
``W <- (1 - lr*wd)*W - lr*sqrt(max(1, m/n))*O`` (decoupled weight decay, shape-based scale).
It owns the GTP-sharded linears (``linear_qkv``, ``linear_proj``, ``linear_fc1``, ``linear_fc2``,
dense and expert); the embedding, the output layer, the norms and the router stay on AdamW.
The router is 2-D but replicated (one small gating matrix per MoE layer, whose rows are scores
rather than features), so it stays with the other replicated params.

Where the state lives does not change: the buffers' ZeRO-1 slices (:mod:`gtp_runtime.buffers`)
hold ``param`` (fp32 master), ``exp_avg`` (Adam's first moment, or Muon's momentum for a Muon
param) and ``exp_avg_sq`` (zero on Muon params), so checkpoints keep their keys and layout and the
manifest names which optimizer owns each param.

Why one owner per matrix, not a distributed Newton-Schulz: NS needs the whole matrix, and under
GTP_remat + CP folding + ZeRO-1 its elements are spread over ``tp x weight group x buffer DP``
ranks, which for every dense and expert weight here is the whole world. A distributed NS on a
row-sharded ``X`` [s, l] (s <= l) must all-reduce the Gram matrix ``X X^T`` (s x s) at each of the
5 steps: ``5 * 2 * s^2 * 4`` bytes per rank per matrix and 5 latency-bound collectives in a row
(for s = l = 4096: 671 MB per rank per matrix). Gathering to one owner moves each element of the
Nesterov momentum there once and its update back once, ``2 * 4 * m * n`` bytes per matrix in
total (134 MB for 4096 x 4096, summed over all ranks), in two ``all_to_all`` per step for all
matrices together; the owner then runs the same single-device NS an unsharded run would.
Owners are assigned longest-NS-first to the least-loaded rank (LPT, within 4/3 of the best
balance), so with at least as many matrices as ranks every rank orthogonalizes a similar share.
``docs/performance.md`` has the measured bytes and step times.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from gtp_format.layout import topology as topo
from gtp_format.layout.config import ModelConfig, ParallelConfig
from gtp_runtime.buffers import GradBuffer, build_buffers
from gtp_runtime.groups import Groups
from gtp_runtime.optimizer import AdamConfig, BucketState, DistributedAdam, StepStats
from gtp_runtime.sharding import take_shard

NS_COEFFS = (3.4445, -4.7750, 2.0315)
MUON, ADAMW = "muon", "adamw"


@dataclass
class MuonConfig:
    lr: float = 0.02
    momentum: float = 0.95
    ns_steps: int = 5
    weight_decay: float = 0.01


def muon_owned(name: str) -> bool:
    """Whether Muon (not AdamW) updates the param called ``name``: the linears of every layer."""
    leaf = name.rsplit(".", 2)[-2:]
    return leaf[-1] == "weight" and len(leaf) == 2 and leaf[0].startswith("linear_")


def newton_schulz(g: torch.Tensor, steps: int) -> torch.Tensor:
    """The quintic Newton-Schulz orthogonalization of ``g`` [m, n], in fp32."""
    x = g.float()
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.t()
    x = x / (x.norm() + 1e-7)
    a, b, c = NS_COEFFS
    for _ in range(steps):
        gram = x @ x.t()
        x = a * x + (b * gram + c * (gram @ gram)) @ x
    return x.t() if tall else x


def shape_scale(shape: tuple[int, ...]) -> float:
    return max(1.0, shape[0] / shape[1]) ** 0.5


def assign_owners(shapes: list[tuple[int, int]], world: int) -> list[int]:
    """Owner rank of each matrix: longest NS first, each to the least-loaded rank (ties: lowest)."""
    load = [0] * world
    owners = [0] * len(shapes)
    for i in sorted(range(len(shapes)), key=lambda i: (-_ns_cost(shapes[i]), i)):
        r = min(range(world), key=lambda r: (load[r], r))
        owners[i] = r
        load[r] += _ns_cost(shapes[i])
    return owners


def _ns_cost(shape: tuple[int, int]) -> int:
    s, lg = sorted(shape)
    return s * s * lg


@dataclass
class _Piece:
    """A run of one bucket's owned slice that holds elements of one Muon matrix."""

    buf: int
    bucket: int
    lo: int  # relative to the owned slice
    hi: int
    matrix: int
    index: torch.Tensor  # flat positions of these elements in the full matrix


def held_pieces(buffers: list[GradBuffer], names: list[str]) -> list[_Piece]:
    """The runs of this rank's owned bucket slices that hold elements of the matrices ``names``,
    each with the flat positions of its elements in the full matrix (GTP tail padding excluded).

    Needs no process group, so a test can lay out every rank of a topology and check that each
    element of every matrix is held exactly once.
    """
    where = {n: i for i, n in enumerate(names)}
    out: list[_Piece] = []
    for bi, buf in enumerate(buffers):
        for ki, b in enumerate(buf.buckets):
            lo, hi = buf.owned_range(b)
            for s in b.slots:
                if s.name not in where:
                    continue
                a, z = max(lo, s.start), min(hi, s.start + s.valid_numel)
                if a >= z:
                    continue
                spec = s.param.spec
                full = torch.arange(spec.full_shape[0] * spec.full_shape[1], dtype=torch.int64)
                idx = take_shard(spec, full.view(spec.full_shape)).flatten()[a - s.start : z - s.start]
                out.append(_Piece(bi, ki, a - lo, z - lo, where[s.name], idx.clone()))
    return out


class MuonPlan:
    """Who holds which elements of which matrix, who orthogonalizes it, and the all-to-all splits.

    Built once: the layout never changes during a run. ``send_counts[r]`` elements go to rank r
    each step (in the order of :attr:`pieces`), ``recv_counts[r]`` come from it, landing at
    ``recv_pos`` in this rank's assembly of the matrices it owns.
    """

    def __init__(self, buffers: list[GradBuffer], groups: Groups) -> None:
        world = groups[topo.WORLD]
        self.world, self.rank = world.size, world.rank
        # What Muon adds to a step's communication, cumulative: bytes this rank sent to other ranks,
        # and seconds spent in the exchanges (the exposed time on gloo, where they block; on NCCL the
        # launch only: synchronize before reading it).
        self.sent_bytes = 0
        self.comm_seconds = 0.0
        params: dict[str, nn.Parameter] = {}
        for buf in buffers:
            for s in buf.slots:
                if muon_owned(s.name):
                    params[s.name] = s.param
        self.names = sorted(params)
        self.shapes = [tuple(params[n].spec.full_shape) for n in self.names]
        self.owners = assign_owners(self.shapes, self.world)  # type: ignore[arg-type]
        self.owned = [i for i, o in enumerate(self.owners) if o == self.rank]
        self.offset: dict[int, int] = {}
        at = [0] * self.world
        for i, o in enumerate(self.owners):
            self.offset[i] = at[o]
            at[o] += self.shapes[i][0] * self.shapes[i][1]
        self.assembly_numel = at[self.rank]
        self.pieces = held_pieces(buffers, self.names)
        # Grouped by destination (owner), so that each rank's share of the send buffer is contiguous.
        self.pieces.sort(key=lambda pc: (self.owners[pc.matrix], pc.matrix, pc.buf, pc.bucket, pc.lo))
        self.send_counts = [0] * self.world
        for pc in self.pieces:
            self.send_counts[self.owners[pc.matrix]] += pc.hi - pc.lo
        self.device = buffers[0].grad_data.device  # NCCL exchanges device tensors only
        send_pos = torch.cat([pc.index + self.offset[pc.matrix] for pc in self.pieces]) if self.pieces else \
            torch.zeros(0, dtype=torch.int64)
        self.recv_counts = self._exchange_counts()
        self.recv_pos = self.exchange(send_pos.to(self.device), self.send_counts, self.recv_counts)

    def _exchange_counts(self) -> list[int]:
        counts = torch.tensor(self.send_counts, dtype=torch.int64, device=self.device)
        got = self.exchange(counts, [1] * self.world, [1] * self.world)
        return [int(x) for x in got]

    def exchange(self, x: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        """``all_to_all`` with per-rank split sizes (a copy on a world of one)."""
        if self.world == 1:
            return x.clone()
        t0 = time.perf_counter()
        out = torch.empty(sum(recv), dtype=x.dtype, device=x.device)
        dist.all_to_all_single(out, x.contiguous(), recv, send)
        self.sent_bytes += (sum(send) - send[self.rank]) * x.element_size()
        self.comm_seconds += time.perf_counter() - t0
        return out


class DistributedMuon(DistributedAdam):
    """Muon for the linears (see the module docstring), AdamW for every other param."""

    DEVICE_UPDATE = False  # the update below takes the clip factor on the host

    def __init__(self, model: nn.Module, groups: Groups, adam: AdamConfig | None = None,
                 muon: MuonConfig | None = None, bucket_size: int = 40_000_000) -> None:
        super().__init__(model, groups, adam, bucket_size)
        self.muon = muon or MuonConfig()
        self.plan = MuonPlan(self.buffers, groups)
        self.plan.sent_bytes, self.plan.comm_seconds = 0, 0.0  # the set-up exchange is not per-step traffic
        self._adam_runs = [[_complement(st, [(pc.lo, pc.hi) for pc in self.plan.pieces if pc.buf == bi
                                             and pc.bucket == ki]) for ki, st in enumerate(states)]
                           for bi, states in enumerate(self.state)]

    def param_optimizers(self) -> dict[str, str]:
        """Param name -> the optimizer that updates it (what the manifest records)."""
        return {s.name: MUON if muon_owned(s.name) else ADAMW for buf in self.buffers for s in buf.slots}

    @torch.no_grad()
    def step_after_reduce(self, stats: StepStats) -> None:
        c, mc = self.cfg, self.muon
        clip = min(1.0, c.clip_grad / (stats.grad_norm + 1e-6)) if c.clip_grad > 0 else 1.0
        self.step_count += 1
        t = self.step_count
        bc1, bc2 = 1 - c.beta1**t, 1 - c.beta2**t
        # The schedule sets ``self.lr`` (AdamW's rate, peak ``c.lr``); Muon follows it at its own
        # peak: the same factor, so a constant schedule gives exactly ``mc.lr`` (factor 1.0).
        lr, muon_lr = self.lr, mc.lr * (self.lr / c.lr if c.lr else 1.0)
        # Muon params: momentum and Nesterov on the holders, NS on the owner, update back.
        nesterov = []
        for pc in self.plan.pieces:
            buf, st = self.buffers[pc.buf], self.state[pc.buf][pc.bucket]
            g = buf.grad_data[st.lo + pc.lo : st.lo + pc.hi] * clip
            m = st.exp_avg[pc.lo : pc.hi]
            m.lerp_(g, 1 - mc.momentum)
            nesterov.append(g.lerp_(m, mc.momentum))
        device = self.buffers[0].grad_data.device
        send = torch.cat(nesterov) if nesterov else torch.zeros(0, device=device)
        got = self.plan.exchange(send, self.plan.send_counts, self.plan.recv_counts)
        assembly = torch.zeros(self.plan.assembly_numel, dtype=torch.float32, device=device)
        assembly.index_copy_(0, self.plan.recv_pos, got)
        for i in self.plan.owned:
            shape, at = self.plan.shapes[i], self.plan.offset[i]
            view = assembly[at : at + shape[0] * shape[1]].view(shape)
            view.copy_(newton_schulz(view, mc.ns_steps) * shape_scale(shape))
        back = self.plan.exchange(assembly[self.plan.recv_pos], self.plan.recv_counts, self.plan.send_counts)
        at = 0
        for pc in self.plan.pieces:
            st = self.state[pc.buf][pc.bucket]
            p = st.param[pc.lo : pc.hi]
            p.mul_(1 - muon_lr * mc.weight_decay)
            p.add_(back[at : at + pc.hi - pc.lo], alpha=-muon_lr)
            at += pc.hi - pc.lo
        # AdamW on the rest, run by run (the same op sequence as DistributedAdam's CPU path).
        for bi, (buf, states) in enumerate(zip(self.buffers, self.state)):
            for ki, (b, st) in enumerate(zip(buf.buckets, states)):
                for lo, hi in self._adam_runs[bi][ki]:
                    g = buf.grad_data[st.lo + lo : st.lo + hi] * clip
                    p, m, v = st.param[lo:hi], st.exp_avg[lo:hi], st.exp_avg_sq[lo:hi]
                    p.mul_(1 - lr * c.weight_decay)
                    m.lerp_(g, 1 - c.beta1)
                    v.mul_(c.beta2).addcmul_(g, g, value=1 - c.beta2)
                    denom = (v.sqrt() / bc2**0.5).add_(c.eps)
                    p.addcdiv_(m, denom, value=-lr / bc1)
                self._publish(buf, b, st)
        for work in self._gathers:
            work.wait()
        self._gathers.clear()


def _complement(st: BucketState, runs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of the owned slice ``[0, hi - lo)`` outside ``runs`` (padding included: its
    gradient is zero, so AdamW leaves it at zero)."""
    out, at = [], 0
    for a, z in sorted(runs):
        if a > at:
            out.append((at, a))
        at = max(at, z)
    if at < st.hi - st.lo:
        out.append((at, st.hi - st.lo))
    return out


def exchange_bytes(model_cfg: ModelConfig, par: ParallelConfig, bucket_size: int) -> int:
    """Bytes one step's two exchanges move between ranks, summed over all ranks, from the layout
    alone (no process group): every Muon element held by a rank other than its matrix's owner
    crosses once to the owner and once back, in fp32. The benchmark checks the runtime's counter
    (:attr:`MuonPlan.sent_bytes`) against it."""
    from gtp_runtime.groups import offline_groups
    from gtp_runtime.model import GPTModel

    owners: list[int] = []
    away = 0
    for rank in range(par.world_size):
        groups = offline_groups(par, rank)
        bufs = build_buffers(GPTModel(model_cfg, par, groups), groups, bucket_size)
        named = {s.name: s.param for b in bufs for s in b.slots if muon_owned(s.name)}
        names = sorted(named)
        if not owners:
            owners = assign_owners([tuple(named[n].spec.full_shape) for n in names], par.world_size)  # type: ignore[misc]
        away += sum(pc.hi - pc.lo for pc in held_pieces(bufs, names) if owners[pc.matrix] != rank)
    return 2 * 4 * away
