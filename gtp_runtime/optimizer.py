"""Distributed Adam (ZeRO-1 over each buffer's DP group) with exactly-once grad statistics.

DP rank ``r`` of a buffer owns the contiguous slice ``[r*n/DP, (r+1)*n/DP)`` of every bucket and
keeps the fp32 master params and Adam moments for it. A step: reduce gradients (GTP lanes, then
buckets), compute the global grad norm and zero count, clip, update the owned slices, write them
into the param buffer (cast to the param dtype) and all-gather the params over the DP group.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from gtp_format.layout import topology as topo
from gtp_runtime.buffers import Bucket, GradBuffer, build_buffers
from gtp_runtime.collectives import all_gather_dim0, all_gather_raw
from gtp_runtime.groups import Groups

# Elements per piece of the GPU zero count: an fp32 count of at most 2**24 ones is exact.
L0_PIECE = 1 << 24


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
    loss: float | None = None  # the step's reported loss, when it was read together with the stats


class BucketState:
    """fp32 master params and Adam moments of this rank's owned slice of one bucket."""

    def __init__(self, buf: GradBuffer, bucket: Bucket) -> None:
        lo, hi = buf.owned_range(bucket)
        self.lo, self.hi = lo, hi
        self.param = buf.param_data[lo:hi].detach().float().clone()
        self.exp_avg = torch.zeros_like(self.param)
        self.exp_avg_sq = torch.zeros_like(self.param)
        self.count_ranges = buf.count_ranges(bucket)

    def counted(self, buf: GradBuffer) -> list[torch.Tensor]:
        """The owned gradient elements this rank counts in the norm and zero count (views)."""
        return [buf.grad_data[self.lo : self.hi][a:b] for a, b in self.count_ranges]

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"param": self.param, "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}


class DistributedAdam:
    """AdamW with decoupled weight decay, matching ``torch.optim.AdamW``'s update rule."""

    DEVICE_UPDATE = True
    """On CUDA, :meth:`step` clips and updates from device-side statistics (:meth:`_update`) with no
    host wait first. A subclass whose update needs the clip factor on the host (Muon) sets False
    and :meth:`step` goes through :meth:`step_after_reduce`."""

    def __init__(self, model: nn.Module, groups: Groups, cfg: AdamConfig | None = None,
                 bucket_size: int = 40_000_000) -> None:
        self.model, self.groups = model, groups
        self.cfg = cfg or AdamConfig()
        self.buffers = build_buffers(model, groups, bucket_size)
        self.state = [[BucketState(buf, b) for b in buf.buckets] for buf in self.buffers]
        self.step_count = 0
        # Buckets whose params are all-gathered after the update go first, in the order forward
        # uses them (a buffer's buckets hold its params in reverse order), so their gathers run
        # while the buckets that need none (GTP shards with a DP group of one) are updated. Why:
        # on 2 x H200, folded cp2, the gather of the embedding's bucket (0.55 ms) ran after every
        # update, with nothing beside it. Each bucket's update is independent: the order changes
        # no value.
        self._update_order = sorted(((bi, ki) for bi, buf in enumerate(self.buffers) for ki in range(len(buf.buckets))),
                                    key=lambda t: (self.buffers[t[0]].dp_group.size == 1, t[0], -t[1]))
        self._step_scale: torch.Tensor | None = None  # [step, 1 / clip] on CUDA, refilled every step
        self.lr = self.cfg.lr
        """The learning rate of the next update (a schedule sets it every step)."""
        self._gathers: list = []
        # Replicated params see different data on every gtp_remat lane; their gradients are
        # averaged over that group before the buckets reduce over dp / dp_cp.
        self._lane_replicated = [p for p in model.parameters() if p.spec.shard_kind is None]
        self._lane_pending = {id(p) for p in self._lane_replicated}
        # With overlap, a bucket's reduce-scatter starts as soon as its last gradient is final
        # (during backward), not at the step.
        comm = getattr(model, "gtp_comm", None)
        self.overlap = comm is not None and comm.overlap
        self._where = {id(s.param): (buf, s.bucket) for buf in self.buffers for s in buf.slots}
        # Weak references: the model must not keep its optimizer alive (a cycle through the
        # params' hooks held both, and their GPU memory, until the next garbage collection).
        if self.overlap:
            comm.on_grad_ready = _weak(self._grad_ready)
        for p in self._lane_replicated:
            p.register_post_accumulate_grad_hook(_weak(self._replicated_grad_done))

    def _replicated_grad_done(self, p: torch.Tensor) -> None:
        p.main_grad.add_(p.grad.float())
        p.grad = None
        if self.overlap:
            self._lane_reduce(p)
            self._grad_ready(p)

    def _lane_reduce(self, p: torch.Tensor) -> None:
        gtp = self.groups[topo.GTP]
        if gtp.size > 1 and id(p) in self._lane_pending:
            dist.all_reduce(p.main_grad, op=dist.ReduceOp.AVG, group=gtp.handle)
        self._lane_pending.discard(id(p))

    def _grad_ready(self, p: torch.Tensor) -> None:
        buf, bucket = self._where[id(p)]
        buf.grad_ready(bucket, p)

    def zero_grad(self) -> None:
        for buf in self.buffers:
            buf.zero_grad()
        self._lane_pending = {id(p) for p in self._lane_replicated}
        comm = getattr(self.model, "gtp_comm", None)
        if comm is not None:
            comm.mark_fresh()

    def reduce_grads(self) -> None:
        self._reduce_lanes()
        for buf in self.buffers:
            buf.reduce_grads()

    def _reduce_lanes(self) -> None:
        comm = getattr(self.model, "gtp_comm", None)
        if comm is not None:
            comm.finish_grad_reduce()  # weight-gradient reduce-scatters still in flight
        for p in self._lane_replicated:
            self._lane_reduce(p)

    def grad_stats(self) -> StepStats:
        """Global L2 norm and zero count over every gradient element exactly once, padding never."""
        stats = self._grad_stats_tensor()
        return StepStats(math.sqrt(stats[0].item()), int(stats[1].item()))

    def _grad_stats_tensor(self) -> torch.Tensor:
        """``[sum of squares, zero count]`` (float64, summed over the world) on the buffers' device."""
        device = self.buffers[0].grad_data.device
        counted = [g for buf, states in zip(self.buffers, self.state) for st in states for g in st.counted(buf)]
        if device.type == "cuda":
            stats = self._grad_stats_cuda(counted)
        else:
            sumsq = torch.zeros((), dtype=torch.float64, device=device)
            zeros = torch.zeros((), dtype=torch.float64, device=device)
            for g in counted:
                sumsq += torch.linalg.vector_norm(g, dtype=torch.float64) ** 2
                zeros += (g == 0).sum()
            stats = torch.stack([sumsq, zeros])
        dist.all_reduce(stats, group=self.groups[topo.WORLD].handle)
        return stats

    @staticmethod
    def _grad_stats_cuda(counted: list[torch.Tensor]) -> torch.Tensor:
        """``[sum of squares, zero count]`` of ``counted`` in two reading passes and no temporaries.

        Why: ``vector_norm(dtype=float64)`` and ``count_nonzero`` each first wrote a converted copy
        of every gradient (float64; bool, then int64): on 2 x H200 the statistics cost 12.6 ms of
        a 156 ms step, 7 ms of it those copies. Here the norms are one multi-tensor fp32 pass
        (``_foreach_norm``; their squares are summed in float64) and the nonzero count is the L0
        norm of pieces of at most 2**24 elements, so its fp32 sums are whole numbers that float32
        holds exactly: the count stays exact.
        """
        norms, nonzero = _piece_norms(counted)
        return _combine_stats(norms, nonzero, sum(g.numel() for g in counted))

    def _reduce_and_stats_cuda(self) -> torch.Tensor:
        """:meth:`reduce_grads` then :meth:`_grad_stats_tensor`, interleaved bucket by bucket.

        The statistics of a bucket are queued as soon as the stream has waited for that bucket's
        reduction, so they run while later buckets are still being reduced. Why: on 2 x H200 the
        reduction of the bucket that holds the word embeddings (its gradient is complete only at the
        very end of backward) ran 1.1 to 1.6 ms with nothing beside it. The per-piece norms are
        the ones :meth:`_grad_stats_cuda` computes, in the same order, so the sums are bit for bit
        the same.
        """
        self._reduce_lanes()
        for buf in self.buffers:
            buf.start_remaining()
        norms: list[torch.Tensor] = []
        nonzero: list[torch.Tensor] = []
        numel = 0
        for buf, states in zip(self.buffers, self.state):
            for i, st in enumerate(states):
                buf.finish(i)
                counted = st.counted(buf)
                n, z = _piece_norms(counted)
                norms += n
                nonzero += z
                numel += sum(g.numel() for g in counted)
            buf.seal()
        stats = _combine_stats(norms, nonzero, numel)
        dist.all_reduce(stats, group=self.groups[topo.WORLD].handle)
        return stats

    @torch.no_grad()
    def step(self, loss: torch.Tensor | None = None) -> StepStats:
        """Reduce, clip and update; ``loss`` (a device scalar) is read back with the statistics.

        On CUDA nothing here waits for the GPU until every kernel of the step is queued: the clip
        factor is computed on the device from the all-reduced statistics, and the statistics (and
        the loss) come back through one non-blocking copy into pinned memory, waited for at the
        end, while the AdamW kernels and parameter all-gathers are still running. On 2 x H200 the
        previous order (a sync for the loss, one for the grad norm, one for the step counter, one
        for the batch) left the GPU idle while the host launched the optimizer and the next forward.
        """
        if self.buffers[0].grad_data.is_cuda:
            stats = self._reduce_and_stats_cuda()
        else:
            self.reduce_grads()
            stats = self._grad_stats_tensor()
        if not stats.is_cuda or not self.DEVICE_UPDATE:
            out = StepStats(math.sqrt(stats[0].item()), int(stats[1].item()),
                            None if loss is None else loss.item())
            self.step_after_reduce(out)
            return out
        parts = [stats] if loss is None else [stats, loss.detach().to(torch.float64).reshape(1)]
        host = torch.empty(len(parts) + 1, dtype=torch.float64, pin_memory=True)
        host.copy_(torch.cat(parts), non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        self._update(self._device_step_scale(stats))
        ready.synchronize()
        sumsq, zeros, *rest = host.tolist()
        return StepStats(math.sqrt(sumsq), int(zeros), rest[0] if rest else None)

    def _device_step_scale(self, stats: torch.Tensor) -> torch.Tensor:
        """``[step, 1 / clip]`` (fp32) for the fused AdamW, computed on the device from ``stats``.

        The same IEEE operations as :meth:`step_after_reduce` does on the host (sqrt, a true
        division, min with 1, reciprocal), so the update is bit for bit the one a host-side clip
        factor gives.
        """
        c = self.cfg
        self.step_count += 1
        if self._step_scale is None:
            self._step_scale = torch.empty(2, dtype=torch.float32, device=stats.device)
        self._step_scale[0].fill_(float(self.step_count))
        if c.clip_grad > 0:
            norm = stats[0].sqrt()
            clip = torch.clamp(torch.full_like(norm, c.clip_grad) / (norm + 1e-6), max=1.0)
            self._step_scale[1].copy_(torch.reciprocal(clip))
        else:
            self._step_scale[1].fill_(1.0)
        return self._step_scale

    @torch.no_grad()
    def step_after_reduce(self, stats: StepStats) -> None:
        """Clip, update the owned slices and publish params (gradients already reduced)."""
        c = self.cfg
        clip = min(1.0, c.clip_grad / (stats.grad_norm + 1e-6)) if c.clip_grad > 0 else 1.0
        self.step_count += 1
        device = self.buffers[0].grad_data.device
        if device.type == "cuda":
            self._update(torch.tensor([float(self.step_count), 1.0 / clip], device=device))
        else:
            self._update(None, clip)

    def _update(self, step_scale: torch.Tensor | None, clip: float = 1.0) -> None:
        """AdamW on every owned slice (fused on CUDA, with ``step_scale``), then publish."""
        c = self.cfg
        t = self.step_count
        bc1, bc2 = 1 - c.beta1**t, 1 - c.beta2**t
        for bi, ki in self._update_order:
            buf, b, st = self.buffers[bi], self.buffers[bi].buckets[ki], self.state[bi][ki]
            g = buf.grad_data[st.lo : st.hi]
            if step_scale is not None:
                self._fused_update(st, g, step_scale)
            else:
                g = g * clip
                st.param.mul_(1 - self.lr * c.weight_decay)
                st.exp_avg.lerp_(g, 1 - c.beta1)
                st.exp_avg_sq.mul_(c.beta2).addcmul_(g, g, value=1 - c.beta2)
                denom = (st.exp_avg_sq.sqrt() / math.sqrt(bc2)).add_(c.eps)
                st.param.addcdiv_(st.exp_avg, denom, value=-self.lr / bc1)
            self._publish(buf, b, st)
        for work in self._gathers:
            work.wait()
        self._gathers.clear()

    def _fused_update(self, st: BucketState, g: torch.Tensor, step_scale: torch.Tensor) -> None:
        """The same AdamW update in PyTorch's fused CUDA kernel (one pass instead of about ten).

        ``step_scale`` holds the step count and ``1 / clip``: the kernel divides each gradient by
        its ``grad_scale`` as it reads it, so clipping costs no pass of its own.
        The CPU path above stays op-by-op: it is the one the fp32 reference is compared against
        and the one CI runs; on GPUs the fused kernel is what makes the optimizer step cheap.
        """
        c = self.cfg
        torch._fused_adamw_([st.param], [g], [st.exp_avg], [st.exp_avg_sq], [], [step_scale[0]], lr=self.lr,
                            beta1=c.beta1, beta2=c.beta2, weight_decay=c.weight_decay, eps=c.eps, amsgrad=False,
                            maximize=False, grad_scale=step_scale[1], found_inf=None)

    def _publish(self, buf: GradBuffer, b: Bucket, st: BucketState) -> None:
        """Write the owned master slice into the param buffer and all-gather the bucket.

        On CUDA the all-gather runs in place and asynchronously, so it overlaps the update of the
        next bucket; :meth:`step_after_reduce` waits for all of them before returning.
        """
        if st.param.is_cuda:
            buf.param_data[st.lo : st.hi].copy_(st.param)
            if buf.dp_group.size > 1:
                self._gathers.append(all_gather_raw(buf.param_data[b.start : b.end], buf.param_data[st.lo : st.hi],
                                                    group=buf.dp_group.handle, async_op=True))
            return
        local = st.param.to(buf.key.param_dtype)
        gathered = all_gather_dim0(local, buf.dp_group)
        buf.param_data[b.start : b.end].copy_(gathered)


def _piece_norms(counted: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per piece of at most :data:`L0_PIECE` elements: its L2 norm (fp32) and its L0 norm."""
    pieces = [g[i : i + L0_PIECE] for g in counted for i in range(0, g.numel(), L0_PIECE)]
    if not pieces:
        return [], []
    return list(torch._foreach_norm(pieces, 2)), [torch.linalg.vector_norm(x, 0) for x in pieces]


def _combine_stats(norms: list[torch.Tensor], nonzero: list[torch.Tensor], numel: int) -> torch.Tensor:
    """``[sum of squares, zero count]`` (float64) from the pieces' norms, summed in piece order."""
    if not norms:
        return torch.zeros(2, dtype=torch.float64, device="cuda")
    sumsq = torch.stack(norms).double().square().sum()
    return torch.stack([sumsq, numel - torch.stack(nonzero).double().sum()])


def _weak(method: Callable[[torch.Tensor], None]) -> Callable[[torch.Tensor], None]:
    ref = weakref.WeakMethod(method)

    def call(p: torch.Tensor) -> None:
        bound = ref()
        if bound is not None:
            bound(p)

    return call
