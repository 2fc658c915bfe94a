"""Leaf layers: GTP-sharded linears (column/row TP), vocab-parallel embedding, RMSNorm, RoPE.

Every parameter carries a :class:`~gtp_runtime.sharding.ShardSpec` as ``param.spec`` and a
``param.is_expert`` flag. The buffers, the optimizer and the checkpoint read those two attributes
and nothing else about the model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from gtp_format.layout import topology as topo
from gtp_format.layout.shard import ShardSpec
from gtp_runtime.collectives import copy_to_group, reduce_from_group
from gtp_runtime.groups import Groups
from gtp_runtime.sharding import GTPComm, gtp_linear


@dataclass
class Build:
    """What every layer needs at construction: the rank's groups, dtype, device, and the
    model's collective scheduler for GTP weights."""

    groups: Groups
    dtype: torch.dtype
    device: torch.device | None
    comm: GTPComm
    align: int = 16


def make_spec(
    groups: Groups, full_shape: tuple[int, ...], tp_mode: str | None, shard_kind: str | None, align: int
) -> ShardSpec:
    tp = groups[topo.TP]
    shard = groups[shard_kind] if shard_kind else None
    return ShardSpec(
        full_shape=tuple(full_shape),
        tp_mode=tp_mode,
        tp_size=tp.size,
        tp_rank=tp.rank,
        shard_kind=shard_kind,
        shard_size=shard.size if shard else 1,
        shard_rank=shard.rank if shard else 0,
        align=align,
    )


def spec_param(spec: ShardSpec, dtype: torch.dtype, is_expert: bool, device: torch.device | None) -> nn.Parameter:
    p = nn.Parameter(torch.zeros(spec.local_shape, dtype=dtype, device=device))
    p.spec = spec  # type: ignore[attr-defined]
    p.is_expert = is_expert  # type: ignore[attr-defined]
    return p


class GTPLinear(nn.Module):
    """A bias-free linear whose TP-local weight is sharded over a GTP weight group.

    ``tp_mode="column"``: weight rows split over TP, input replicated, output split.
    ``tp_mode="row"``: weight columns split over TP, input split, output summed over TP.
    """

    def __init__(self, b: Build, in_features: int, out_features: int, tp_mode: str, expert: bool = False) -> None:
        super().__init__()
        kind = topo.EXPERT_GTP if expert else topo.WEIGHT
        self.groups, self.tp_mode, self.comm = b.groups, tp_mode, b.comm
        spec = make_spec(b.groups, (out_features, in_features), tp_mode, kind, b.align)
        self.weight = spec_param(spec, b.dtype, expert, b.device)
        self.rows = spec.tp_local_shape[0]
        b.comm.register(self.weight, b.groups[kind])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tp = self.groups[topo.TP]
        if self.tp_mode == "column":
            x = copy_to_group(x, tp)
        y = gtp_linear(x, self.weight, self.comm, self.rows)
        if self.tp_mode == "row":
            y = reduce_from_group(y, tp)
        return y


class RMSNorm(nn.Module):
    def __init__(self, b: Build, hidden: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = spec_param(make_spec(b.groups, (hidden,), None, None, 1), b.dtype, False, b.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).to(x.dtype)


class VocabParallelEmbedding(nn.Module):
    """Embedding rows split over TP; each rank looks up its own rows and TP sums the results."""

    def __init__(self, b: Build, vocab: int, hidden: int) -> None:
        super().__init__()
        self.groups = b.groups
        spec = make_spec(b.groups, (vocab, hidden), "vocab", None, 1)
        self.weight = spec_param(spec, b.dtype, False, b.device)
        self.lo = spec.tp_rank * spec.tp_local_shape[0]
        self.hi = self.lo + spec.tp_local_shape[0]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        inside = (tokens >= self.lo) & (tokens < self.hi)
        idx = torch.where(inside, tokens - self.lo, torch.zeros_like(tokens))
        out = self.weight[idx] * inside.unsqueeze(-1).to(self.weight.dtype)
        return reduce_from_group(out, self.groups[topo.TP])


def rope(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotary embedding of ``x`` [b, s, h, d] at absolute ``positions`` [s] (rotate-half form)."""
    d = x.shape[-1]
    inv = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d))
    ang = positions.to(torch.float32)[:, None] * inv[None, :]
    cos = torch.cat([ang.cos(), ang.cos()], -1)[None, :, None, :]
    sin = torch.cat([ang.sin(), ang.sin()], -1)[None, :, None, :]
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x.float() * cos + rotated * sin).to(x.dtype)
