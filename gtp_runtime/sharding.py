"""GTP_remat weight sharding: the shard math and the all-gather / reduce-scatter linear.

A GTP-managed weight is first split by TP (dim 0 for column-parallel, dim 1 for row-parallel),
then the TP-local weight is sharded along dim 0 over its *weight group* (``gtp_remat``, or
``cp x gtp_remat`` with ``fold_cp``, or the expert GTP group). dim 0 is padded at the tail to a
multiple of ``align * group_size`` so every shard has the same row count.

:class:`GTPLinearFn` is ZeRO-3 per weight: the full weight exists only inside the op. Forward
gathers it, uses it, drops it; backward gathers it again (the "remat") and reduce-scatters the
weight gradient. Saving only the shard is what makes the memory saving real.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from gtp_runtime.collectives import all_gather_dim0, reduce_scatter_dim0
from gtp_runtime.groups import Group


@dataclass(frozen=True)
class ShardSpec:
    """Where one rank's tensor sits inside the full (padded) tensor of its parameter.

    ``tp_mode``: ``"column"`` splits dim 0 over TP, ``"row"`` splits dim 1, ``"vocab"`` splits
    dim 0 without GTP (embedding), ``None`` means TP-replicated. ``shard_kind``: the group kind
    that shards dim 0 of the TP-local tensor, or ``None``.
    """

    full_shape: tuple[int, ...]
    tp_mode: str | None
    tp_size: int
    tp_rank: int
    shard_kind: str | None
    shard_size: int
    shard_rank: int
    align: int

    @property
    def tp_local_shape(self) -> tuple[int, ...]:
        s = list(self.full_shape)
        if self.tp_mode in ("column", "vocab"):
            s[0] //= self.tp_size
        elif self.tp_mode == "row":
            s[1] //= self.tp_size
        return tuple(s)

    @property
    def padded_rows(self) -> int:
        rows = self.tp_local_shape[0]
        if self.shard_kind is None:
            return rows
        m = self.align * self.shard_size
        return math.ceil(rows / m) * m

    @property
    def shard_rows(self) -> int:
        return self.padded_rows // (self.shard_size if self.shard_kind else 1)

    @property
    def local_shape(self) -> tuple[int, ...]:
        return (self.shard_rows, *self.tp_local_shape[1:])

    @property
    def valid_rows(self) -> int:
        """Rows of this shard that hold real weight (the rest is tail padding)."""
        start = self.shard_rank * self.shard_rows if self.shard_kind else 0
        return max(0, min(self.shard_rows, self.tp_local_shape[0] - start))

    @property
    def global_shape(self) -> tuple[int, ...]:
        """Shape of the checkpointed tensor: the full weight with each TP part padded."""
        s = list(self.tp_local_shape)
        s[0] = self.padded_rows
        if self.tp_mode in ("column", "vocab"):
            s[0] *= self.tp_size
        elif self.tp_mode == "row":
            s[1] *= self.tp_size
        return tuple(s)

    @property
    def global_offset(self) -> tuple[int, ...]:
        off = [0] * len(self.full_shape)
        off[0] = self.shard_rank * self.shard_rows if self.shard_kind else 0
        if self.tp_mode in ("column", "vocab"):
            off[0] += self.tp_rank * self.padded_rows
        elif self.tp_mode == "row":
            off[1] = self.tp_rank * self.tp_local_shape[1]
        return tuple(off)

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's piece of the full tensor (zero rows where the shard is tail padding)."""
        tl = self.tp_local_shape
        if self.tp_mode in ("column", "vocab"):
            full = full[self.tp_rank * tl[0] : (self.tp_rank + 1) * tl[0]]
        elif self.tp_mode == "row":
            full = full[:, self.tp_rank * tl[1] : (self.tp_rank + 1) * tl[1]]
        out = torch.zeros(self.local_shape, dtype=full.dtype)
        start = self.shard_rank * self.shard_rows if self.shard_kind else 0
        out[: self.valid_rows] = full[start : start + self.valid_rows]
        return out

    def assemble_tp_local(self, gathered: torch.Tensor) -> torch.Tensor:
        """Drop the tail padding of a gathered (padded) TP-local weight."""
        return gathered[: self.tp_local_shape[0]]


class GTPLinearFn(torch.autograd.Function):
    """``y = x @ W.T`` where ``W`` is gathered from its shards in forward and again in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, shard: torch.Tensor, group: Group, rows: int) -> torch.Tensor:
        full = all_gather_dim0(shard, group)[:rows]
        ctx.save_for_backward(x, shard)
        ctx.group, ctx.rows = group, rows
        return F.linear(x, full)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None]:
        x, shard = ctx.saved_tensors
        group, rows = ctx.group, ctx.rows
        grad_x = None
        if ctx.needs_input_grad[0]:
            full = all_gather_dim0(shard, group)[:rows]
            grad_x = grad_out @ full
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        x2 = x.reshape(-1, x.shape[-1])
        grad_full = torch.zeros((shard.shape[0] * group.size, shard.shape[1]), dtype=torch.float32,
                                device=shard.device)
        grad_full[:rows] = (g2.t().float() @ x2.float())
        # AVG: the bucket divisor then only has to cover the buffer's DP group (domain.md 3).
        grad_shard = reduce_scatter_dim0(grad_full, group, dist.ReduceOp.AVG)
        main_grad = getattr(shard, "main_grad", None)
        if main_grad is not None:
            # Accumulate in fp32 straight into the grad buffer: a bf16 param must not round its
            # gradient to bf16 on the way (Megatron's gradient-accumulation fusion does the same).
            main_grad.add_(grad_shard)
            return grad_x, None, None, None
        return grad_x, grad_shard.to(shard.dtype), None, None


def gtp_linear(x: torch.Tensor, shard: torch.Tensor, group: Group, rows: int) -> torch.Tensor:
    """Linear with a GTP-sharded weight; also used at group size 1 so that the fp32 gradient path
    is the same for every topology."""
    return GTPLinearFn.apply(x, shard, group, rows)
