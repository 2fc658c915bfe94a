"""Contiguous param/grad buffers ("gbufs"), their buckets, and gradient reduction.

Params are grouped by :class:`BufferKey` ``(param_dtype, grad_dtype, is_expert, excludes_cp)``.
``excludes_cp`` is true for folded dense params: their weight-gradient reduce-scatter already ran
over the folded ``cp x gtp_remat`` group, so the bucket reduces over the CP-free ``dp`` group only.
Unfolded dense and replicated params reduce over ``dp_cp``; expert params over ``expert_dp``.

Inside a buffer params are laid out by :func:`gtp_format.layout.buckets.lay_out` (reverse model
order, 64-element aligned starts, buckets of about ``bucket_size`` elements padded to a multiple of
``lcm(dp_size, 64)``): the one rule ``ckpt reshard`` also uses for topologies no process runs.
Gaps between params and the bucket tail are padding: never counted, never checkpointed as data.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn

from gtp_format.layout import topology as topo
from gtp_format.layout.buckets import BUCKET_PAD, PARAM_ALIGN, lay_out
from gtp_format.layout.config import check_buffer_cp_degrees
from gtp_runtime.collectives import reduce_scatter_raw
from gtp_runtime.groups import Group, Groups

__all__ = ["BUCKET_PAD", "PARAM_ALIGN", "Bucket", "BufferKey", "GradBuffer", "ParamSlot", "build_buffers"]


@dataclass(frozen=True)
class BufferKey:
    param_dtype: torch.dtype
    grad_dtype: torch.dtype
    is_expert: bool
    excludes_cp: bool


@dataclass
class ParamSlot:
    name: str
    param: nn.Parameter
    start: int  # in the buffer
    end: int
    bucket: int
    valid_numel: int  # leading elements that are real weight (the rest is GTP tail padding)
    counts_here: bool  # this rank counts the param in grad norm / zero count (exactly-once rule)


@dataclass
class Bucket:
    index: int
    start: int
    end: int  # padded end
    numel_unpadded: int
    slots: list[ParamSlot] = field(default_factory=list)

    @property
    def numel(self) -> int:
        return self.end - self.start


def _counts_here(p: nn.Parameter, groups: Groups) -> bool:
    """Whether this rank is the one that counts ``p``'s reduced gradient elements.

    Sharded params (GTP dense, folded or not, and experts) are distinct on every rank of their
    buffer's DP slice, so every rank counts its owned part. A replicated param sits in the bucket
    of every gtp_remat lane, and a TP-replicated one on every TP rank: count lane 0 / TP rank 0.
    """
    if p.spec.shard_kind is not None:
        return True
    c = groups.coords
    return c.gtp == 0 and (p.spec.tp_mode is not None or c.tp == 0)


def buffer_key_of(p: nn.Parameter, fold_cp: bool, grad_dtype: torch.dtype = torch.float32) -> BufferKey:
    excludes_cp = fold_cp and p.spec.shard_kind == topo.WEIGHT and not p.is_expert
    return BufferKey(p.dtype, grad_dtype, bool(p.is_expert), excludes_cp)


def dp_kind_of(key: BufferKey) -> str:
    if key.is_expert:
        return topo.EXPERT_DP
    return topo.DP if key.excludes_cp else topo.DP_CP


class GradBuffer:
    """One gbuf: a flat param buffer (param dtype), a flat fp32 grad buffer, and its buckets."""

    def __init__(self, gbuf_idx: int, key: BufferKey, named: list[tuple[str, nn.Parameter]], groups: Groups,
                 bucket_size: int) -> None:
        self.gbuf_idx, self.key, self.groups = gbuf_idx, key, groups
        self.dp_kind = dp_kind_of(key)
        self.dp_group: Group = groups[self.dp_kind]
        par = groups.par
        # Per-param divisor stamps, checked for one value per buffer (mixing them is refused).
        divisors = {par.expert_dp if key.is_expert else (par.dp if key.excludes_cp else par.dp * par.cp)
                    for _ in named}
        self.divisor = check_buffer_cp_degrees(f"gbuf_idx_{gbuf_idx}", divisors)
        assert self.divisor == self.dp_group.size
        self.slots: list[ParamSlot] = []
        self.buckets: list[Bucket] = []
        ordered = list(reversed(named))
        placed, spans, self.numel = lay_out([p.numel() for _, p in ordered], bucket_size, self.dp_group.size)
        for span in spans:
            self.buckets.append(Bucket(span.index, span.start, span.end, span.numel_unpadded))
        for (name, p), pl in zip(ordered, placed):
            spec = p.spec
            valid = spec.valid_rows * math.prod(spec.local_shape[1:])
            slot = ParamSlot(name, p, pl.start, pl.end, pl.bucket, valid, _counts_here(p, groups))
            self.buckets[pl.bucket].slots.append(slot)
            self.slots.append(slot)
        device = named[0][1].device
        self.param_data = torch.zeros(self.numel, dtype=key.param_dtype, device=device)
        self.grad_data = torch.zeros(self.numel, dtype=key.grad_dtype, device=device)
        for s in self.slots:
            view = self.param_data[s.start : s.end].view(s.param.shape)
            view.copy_(s.param.data)
            s.param.data = view
            s.param.main_grad = self.grad_data[s.start : s.end].view(s.param.shape)  # type: ignore[attr-defined]
        self.begin_step()

    # -- ownership ------------------------------------------------------------------------------
    def local_numel(self, bucket: Bucket) -> int:
        return bucket.numel // self.dp_group.size

    def owned_range(self, bucket: Bucket) -> tuple[int, int]:
        n = self.local_numel(bucket)
        lo = bucket.start + self.dp_group.rank * n
        return lo, lo + n

    def count_ranges(self, bucket: Bucket) -> list[tuple[int, int]]:
        """Ranges of the owned slice (relative to it) that this rank counts in norm and zero count.

        Ranges, not a mask: the counted elements are a few contiguous runs (one per param piece),
        and slicing them avoids a boolean gather that would force a device-to-host sync.
        """
        lo, hi = self.owned_range(bucket)
        out = []
        for s in bucket.slots:
            if not s.counts_here:
                continue
            a, b = max(lo, s.start), min(hi, s.start + s.valid_numel)
            if a < b:
                out.append((a - lo, b - lo))
        return out

    # -- reduction ------------------------------------------------------------------------------
    def begin_step(self) -> None:
        """Reset the per-bucket countdown of gradients still to arrive this step."""
        self._pending = [len(b.slots) for b in self.buckets]
        self._arrived: set[int] = set()
        # bucket -> (collective handle, out-of-place result to copy back, averaged already)
        self._inflight: dict[int, tuple[object, torch.Tensor | None, bool]] = {}

    def grad_ready(self, bucket: int, param: nn.Parameter) -> None:
        """One param of ``bucket`` holds its final gradient; the last one starts the reduction.

        This is what overlaps the bucket reduce-scatter with the rest of backward: on 2 x H200 the
        unfolded dp_cp reduction of full fp32 dense gradients was 31 ms of a 222 ms step while it
        waited for the optimizer step.
        """
        if bucket in self._inflight:
            raise RuntimeError(f"gbuf_idx_{self.gbuf_idx} bucket {bucket}: a gradient arrived after the bucket's "
                               "reduction started; call zero_grad() before every backward")
        if id(param) in self._arrived:
            raise RuntimeError(f"gbuf_idx_{self.gbuf_idx}: a param's gradient arrived twice in one step (a weight "
                               "used twice per forward); build the optimizer with overlap_grad_reduce=False")
        self._arrived.add(id(param))
        self._pending[bucket] -= 1
        if self._pending[bucket] == 0:
            self._start(bucket)

    def _start(self, i: int) -> None:
        b = self.buckets[i]
        if self.dp_group.size == 1:
            self._inflight[i] = (None, None, True)  # a mean over one rank: nothing to do
            return
        lo, hi = self.owned_range(b)
        src = self.grad_data[b.start : b.end]
        if src.is_cuda:
            # NCCL reduces in place when the output is this rank's slice of the input (no copy
            # back) and averages inside the collective (the divisor is the group size, asserted
            # at construction), so no division pass follows.
            work = reduce_scatter_raw(self.grad_data[lo:hi], src, op=dist.ReduceOp.AVG, group=self.dp_group.handle,
                                      async_op=True)
            self._inflight[i] = (work, None, True)
        else:
            out = torch.empty(hi - lo, dtype=src.dtype, device=src.device)
            work = reduce_scatter_raw(out, src, op=dist.ReduceOp.SUM, group=self.dp_group.handle, async_op=True)
            self._inflight[i] = (work, out, False)

    def reduce_grads(self) -> None:
        """Reduce-scatter each bucket over the buffer's DP group and divide by its divisor.

        Buckets already started by :meth:`grad_ready` are waited for; the others start now, in
        bucket order (every rank starts the same buckets in the same order).
        Afterwards ``grad_data[owned_range]`` holds the mean gradient of the owned slice.
        """
        self.start_remaining()
        for i in range(len(self.buckets)):
            self.finish(i)
        self.seal()

    def start_remaining(self) -> None:
        """Start the reductions of the buckets :meth:`grad_ready` has not started, in bucket order."""
        for i in range(len(self.buckets)):
            if i not in self._inflight:
                self._start(i)

    def finish(self, i: int) -> None:
        """Wait for bucket ``i``'s reduction (on CUDA: make the current stream wait) and average it.

        Separate from :meth:`reduce_grads` so the optimizer can queue work on the buckets that are
        done while the last ones are still in flight.
        """
        work, out, averaged = self._inflight[i]
        lo, hi = self.owned_range(self.buckets[i])
        if work is not None:
            work.wait()  # type: ignore[attr-defined]
        if out is not None:
            self.grad_data[lo:hi].copy_(out)
        if not averaged:
            self.grad_data[lo:hi].div_(self.divisor)
        self._inflight[i] = (None, None, True)

    def seal(self) -> None:
        """Every bucket is reduced: a gradient that arrives now is refused (see :meth:`grad_ready`)."""
        self._inflight = {i: (None, None, True) for i in range(len(self.buckets))}

    def zero_grad(self) -> None:
        self.grad_data.zero_()
        self.begin_step()


def build_buffers(model: nn.Module, groups: Groups, bucket_size: int,
                  grad_dtype: torch.dtype = torch.float32) -> list[GradBuffer]:
    """Group the model's params into buffers, in a fixed order every rank agrees on."""
    by_key: dict[BufferKey, list[tuple[str, nn.Parameter]]] = {}
    for name, p in model.named_parameters():
        by_key.setdefault(buffer_key_of(p, groups.par.fold_cp, grad_dtype), []).append((name, p))
    order = sorted(by_key, key=lambda k: (k.is_expert, not k.excludes_cp, str(k.param_dtype)))
    return [GradBuffer(i, k, by_key[k], groups, bucket_size) for i, k in enumerate(order)]
