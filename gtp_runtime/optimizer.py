"""Distributed Adam (ZeRO-1 over each buffer's DP group) with exactly-once grad statistics.

DP rank ``r`` of a buffer owns the contiguous slice ``[r*n/DP, (r+1)*n/DP)`` of every bucket and
keeps the fp32 master params and Adam moments for it. A step: reduce gradients (GTP lanes, then
buckets), compute the global grad norm and zero count, clip, update the owned slices, write them
into the param buffer (cast to the param dtype) and all-gather the params over the DP group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from gtp_runtime import topology as topo
from gtp_runtime.buffers import Bucket, GradBuffer, build_buffers
from gtp_runtime.collectives import all_gather_dim0
from gtp_runtime.groups import Groups


@dataclass
class AdamConfig:
    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.01
    clip_grad: float = 1.0


@dataclass
class StepStats:
    grad_norm: float
    num_zeros: int


class BucketState:
    """fp32 master params and Adam moments of this rank's owned slice of one bucket."""

    def __init__(self, buf: GradBuffer, bucket: Bucket) -> None:
        lo, hi = buf.owned_range(bucket)
        self.lo, self.hi = lo, hi
        self.param = buf.param_data[lo:hi].detach().float().clone()
        self.exp_avg = torch.zeros_like(self.param)
        self.exp_avg_sq = torch.zeros_like(self.param)
        self.count_ranges = buf.count_ranges(bucket)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"param": self.param, "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}


class DistributedAdam:
    """AdamW with decoupled weight decay, matching ``torch.optim.AdamW``'s update rule."""

    def __init__(self, model: nn.Module, groups: Groups, cfg: AdamConfig | None = None,
                 bucket_size: int = 40_000_000) -> None:
        self.model, self.groups = model, groups
        self.cfg = cfg or AdamConfig()
        self.buffers = build_buffers(model, groups, bucket_size)
        self.state = [[BucketState(buf, b) for b in buf.buckets] for buf in self.buffers]
        self.step_count = 0
        self.lr = self.cfg.lr
        """The learning rate of the next update (a schedule sets it every step)."""
        # Replicated params see different data on every gtp_remat lane; their gradients are
        # averaged over that group before the buckets reduce over dp / dp_cp.
        self._lane_replicated = [p for p in model.parameters() if p.spec.shard_kind is None]
        for p in model.parameters():
            if p.spec.shard_kind is None:
                p.register_post_accumulate_grad_hook(_move_grad_to_main)

    def zero_grad(self) -> None:
        for buf in self.buffers:
            buf.zero_grad()

    def reduce_grads(self) -> None:
        comm = getattr(self.model, "gtp_comm", None)
        if comm is not None:
            comm.finish_grad_reduce()  # weight-gradient reduce-scatters still in flight
        gtp = self.groups[topo.GTP]
        if gtp.size > 1:
            for p in self._lane_replicated:
                dist.all_reduce(p.main_grad, op=dist.ReduceOp.AVG, group=gtp.handle)
        for buf in self.buffers:
            buf.reduce_grads()

    def grad_stats(self) -> StepStats:
        """Global L2 norm and zero count over every gradient element exactly once, padding never."""
        device = self.buffers[0].grad_data.device
        sumsq = torch.zeros((), dtype=torch.float64, device=device)
        zeros = torch.zeros((), dtype=torch.float64, device=device)
        for buf, states in zip(self.buffers, self.state):
            for st in states:
                owned = buf.grad_data[st.lo : st.hi]
                for a, b in st.count_ranges:
                    g = owned[a:b]
                    sumsq += torch.linalg.vector_norm(g, dtype=torch.float64) ** 2
                    zeros += (g == 0).sum()
        stats = torch.stack([sumsq, zeros])
        dist.all_reduce(stats, group=self.groups[topo.WORLD].handle)
        return StepStats(math.sqrt(stats[0].item()), int(stats[1].item()))

    @torch.no_grad()
    def step(self) -> StepStats:
        self.reduce_grads()
        stats = self.grad_stats()
        self.step_after_reduce(stats)
        return stats

    @torch.no_grad()
    def step_after_reduce(self, stats: StepStats) -> None:
        """Clip, update the owned slices and publish params (gradients already reduced)."""
        c = self.cfg
        clip = min(1.0, c.clip_grad / (stats.grad_norm + 1e-6)) if c.clip_grad > 0 else 1.0
        self.step_count += 1
        t = self.step_count
        bc1, bc2 = 1 - c.beta1**t, 1 - c.beta2**t
        for buf, states in zip(self.buffers, self.state):
            for b, st in zip(buf.buckets, states):
                g = buf.grad_data[st.lo : st.hi]
                if st.param.is_cuda:
                    self._fused_update(st, g.mul_(clip), t)
                else:
                    g = g * clip
                    st.param.mul_(1 - self.lr * c.weight_decay)
                    st.exp_avg.lerp_(g, 1 - c.beta1)
                    st.exp_avg_sq.mul_(c.beta2).addcmul_(g, g, value=1 - c.beta2)
                    denom = (st.exp_avg_sq.sqrt() / math.sqrt(bc2)).add_(c.eps)
                    st.param.addcdiv_(st.exp_avg, denom, value=-self.lr / bc1)
                self._publish(buf, b, st)

    def _fused_update(self, st: BucketState, g: torch.Tensor, t: int) -> None:
        """The same AdamW update in PyTorch's fused CUDA kernel (one pass instead of about ten).

        The CPU path above stays op-by-op: it is the one the fp32 reference is compared against
        and the one CI runs; on GPUs the fused kernel is what makes the optimizer step cheap.
        """
        c = self.cfg
        step = torch.tensor(float(t), device=g.device)
        torch._fused_adamw_([st.param], [g], [st.exp_avg], [st.exp_avg_sq], [], [step], lr=self.lr, beta1=c.beta1,
                            beta2=c.beta2, weight_decay=c.weight_decay, eps=c.eps, amsgrad=False, maximize=False)

    def _publish(self, buf: GradBuffer, b: Bucket, st: BucketState) -> None:
        """Write the owned master slice into the param buffer and all-gather the bucket."""
        local = st.param.to(buf.key.param_dtype)
        gathered = all_gather_dim0(local, buf.dp_group)
        buf.param_data[b.start : b.end].copy_(gathered)


def _move_grad_to_main(p: torch.Tensor) -> None:
    p.main_grad.add_(p.grad.float())
    p.grad = None
