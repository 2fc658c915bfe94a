"""Differentiable collectives: TP copy/reduce, CP sequence all-gather.

Each is an autograd function whose backward is the adjoint of its forward, so gradients are exact
without any post-hoc correction. All take a :class:`~gtp_runtime.groups.Group` and are no-ops on a
group of one.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from gtp_runtime.groups import Group

# torch 2.13 renamed the tensor collectives (the old names warn); torch 2.11 on the GPU hosts
# only has the old ones.
all_gather_raw = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_raw = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_dim0(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Concatenate ``x`` of every member along dim 0, in group-rank order."""
    if group.size == 1:
        return x
    x = x.contiguous()
    out = torch.empty((group.size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    all_gather_raw(out, x, group=group.handle)
    return out


def reduce_scatter_dim0(x: torch.Tensor, group: Group, op: dist.ReduceOp.RedOpType) -> torch.Tensor:
    """Reduce ``x`` over the group and keep this rank's dim-0 slice."""
    if group.size == 1:
        return x
    x = x.contiguous()
    out = torch.empty((x.shape[0] // group.size, *x.shape[1:]), dtype=x.dtype, device=x.device)
    reduce_scatter_raw(out, x, op=op, group=group.handle)
    return out


class _CopyToGroup(torch.autograd.Function):
    """Identity forward, all-reduce (sum) backward: input of a column-parallel layer."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group.handle)
        return grad, None


class _ReduceFromGroup(torch.autograd.Function):
    """All-reduce (sum) forward, identity backward: output of a row-parallel layer."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group.handle)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _GatherLastDim(torch.autograd.Function):
    """All-gather along the last dim forward, take own slice backward (vocab-parallel logits)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        parts = all_gather_dim0(x.movedim(-1, 0), group)
        return parts.movedim(0, -1).contiguous()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        n = grad.shape[-1] // ctx.group.size
        return grad[..., ctx.group.rank * n : (ctx.group.rank + 1) * n].contiguous(), None


class _GatherSeq(torch.autograd.Function):
    """All-gather along dim 0 forward, reduce-scatter (sum) backward: K/V over the CP group."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return all_gather_dim0(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return reduce_scatter_dim0(grad, ctx.group, dist.ReduceOp.SUM), None


def cp_chunk_order(cp_size: int) -> list[tuple[int, int]]:
    """(CP rank, which of its two halves) holding global chunk ``c``, for c in 0..2*CP-1."""
    return [(c, 0) if c < cp_size else (2 * cp_size - 1 - c, 1) for c in range(2 * cp_size)]


class _GatherKV(torch.autograd.Function):
    """K and V of every CP rank, in global sequence order: one all-gather forward, one
    reduce-scatter (sum) backward.

    Rank ``r`` holds chunks ``r`` and ``2*CP-1-r`` (see ``context_parallel.cp_positions``). The
    reorder into sequence order happens inside the function, as one copy each way: done by
    autograd on slices of the gathered tensor, its backward wrote a zero-filled full-size
    gradient per slice and summed them (on 2 x H200, 81 fills and 72 adds a step).
    """

    @staticmethod
    def forward(ctx: Any, k: torch.Tensor, v: torch.Tensor, group: Group) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.group = group
        half = k.shape[1] // 2
        ctx.half = half
        kv = all_gather_dim0(torch.stack([k.transpose(0, 1), v.transpose(0, 1)], dim=1), group)  # [CP*s, 2, b, h, d]
        kv = torch.cat([kv[(2 * r + i) * half : (2 * r + i + 1) * half] for r, i in cp_chunk_order(group.size)])
        return kv[:, 0].transpose(0, 1), kv[:, 1].transpose(0, 1)

    @staticmethod
    def backward(ctx: Any, gk: torch.Tensor, gv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        half, group = ctx.half, ctx.group
        b, _, h, d = gk.shape
        blocks = torch.empty((2 * group.size * half, 2, b, h, d), dtype=gk.dtype, device=gk.device)
        for c, (r, i) in enumerate(cp_chunk_order(group.size)):
            dst = blocks[(2 * r + i) * half : (2 * r + i + 1) * half]
            dst[:, 0].copy_(gk[:, c * half : (c + 1) * half].transpose(0, 1))
            dst[:, 1].copy_(gv[:, c * half : (c + 1) * half].transpose(0, 1))
        out = reduce_scatter_dim0(blocks, group, dist.ReduceOp.SUM)  # [s, 2, b, h, d]
        return out[:, 0].transpose(0, 1), out[:, 1].transpose(0, 1), None


def gather_kv(k: torch.Tensor, v: torch.Tensor, group: Group) -> tuple[torch.Tensor, torch.Tensor]:
    """``k, v`` [b, s_local, heads, d] of the whole CP group, [b, s, heads, d] in sequence order."""
    return _GatherKV.apply(k, v, group)


def copy_to_group(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if group.size == 1 else _CopyToGroup.apply(x, group)


def reduce_from_group(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if group.size == 1 else _ReduceFromGroup.apply(x, group)


def gather_last_dim(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if group.size == 1 else _GatherLastDim.apply(x, group)


def gather_seq(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if group.size == 1 else _GatherSeq.apply(x, group)
