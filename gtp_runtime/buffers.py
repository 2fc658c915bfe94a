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
from gtp_runtime.collectives import reduce_scatter_dim0
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
    def reduce_grads(self) -> None:
        """Reduce-scatter each bucket over the buffer's DP group and divide by its divisor.

        Afterwards ``grad_data[owned_range]`` holds the mean gradient of the owned slice.
        """
        for b in self.buckets:
            lo, hi = self.owned_range(b)
            reduced = reduce_scatter_dim0(self.grad_data[b.start : b.end], self.dp_group, dist.ReduceOp.SUM)
            if self.dp_group.size > 1:
                self.grad_data[lo:hi].copy_(reduced)
            self.grad_data[lo:hi].div_(self.divisor)

    def zero_grad(self) -> None:
        self.grad_data.zero_()


def build_buffers(model: nn.Module, groups: Groups, bucket_size: int,
                  grad_dtype: torch.dtype = torch.float32) -> list[GradBuffer]:
    """Group the model's params into buffers, in a fixed order every rank agrees on."""
    by_key: dict[BufferKey, list[tuple[str, nn.Parameter]]] = {}
    for name, p in model.named_parameters():
        by_key.setdefault(buffer_key_of(p, groups.par.fold_cp, grad_dtype), []).append((name, p))
    order = sorted(by_key, key=lambda k: (k.is_expert, not k.excludes_cp, str(k.param_dtype)))
    return [GradBuffer(i, k, by_key[k], groups, bucket_size) for i, k in enumerate(order)]
