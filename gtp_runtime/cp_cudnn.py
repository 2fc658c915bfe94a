"""Context-parallel causal attention on cuDNN blocks, with the K/V collectives overlapped (CUDA).

Why: on 2 x H200 (hidden 4096, 8 layers, sequence 8192, cp2) attention through SDPA's
FlashAttention-2 kernel took 26 ms of a 156 ms step, and the K/V all-gather before it and the
dK/dV reduce-scatter after its backward ran with nothing beside them (8.5 ms). cuDNN runs the
same blocks about 1.8x faster (2048 queries x 8192 keys, head dim 128: 1.7 against 3.2 ms forward
and backward), but its causal mask is aligned top-left, so a query chunk that sees earlier chunks
cannot be one call.

Query chunk ``j`` (``L`` tokens; see :func:`~gtp_runtime.context_parallel.cp_positions`) is
split into a *diagonal* block (keys of chunk ``j`` itself, causal and square) and a *prefix*
block (keys of chunks ``0..j-1``, no mask). The two results are merged by their log-sum-exp.
Backward calls cuDNN's backward per block with the merged output and log-sum-exp, which gives each
block its exact share of the gradient (the blockwise form ring attention uses).

A rank's diagonal blocks need only its own K and V, so forward computes them while the K/V
all-gather runs, and backward computes them while the reduce-scatter of the prefix blocks' dK/dV
runs; their own dK/dV is added locally afterwards. Every block goes to cuDNN as a contiguous
[b, h, s, d] copy (the layout the raw cuDNN op is known to handle).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from gtp_runtime.collectives import all_gather_raw, cp_chunk_order, reduce_scatter_raw
from gtp_runtime.groups import Group


def _fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> tuple[Any, ...]:
    """cuDNN attention of contiguous [b, h, s, d] tensors: (out, lse, the op's backward bookkeeping)."""
    out, lse, cq, ck, mq, mk, seed, offset, _ = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, causal, False)
    return out, lse, (cq, ck, mq, mk, seed, offset)


def _bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
         lse: torch.Tensor, book: tuple[Any, ...], causal: bool) -> tuple[torch.Tensor, ...]:
    cq, ck, mq, mk, seed, offset = book
    return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        dout, q, k, v, out, lse, seed, offset, None, cq, ck, mq, mk, 0.0, causal)


def _bhsd(x: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Tokens ``[lo, hi)`` of ``x`` [b, s, h, d] as a contiguous [b, h, hi - lo, d] tensor."""
    return x[:, lo:hi].transpose(1, 2).contiguous()


def _merge(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor,
           lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over the union of two key sets from each set's output and log-sum-exp."""
    lse = torch.logaddexp(lse_a, lse_b)
    w_a = torch.exp(lse_a - lse).reshape(*o_a.shape[:3], 1)
    w_b = torch.exp(lse_b - lse).reshape(*o_a.shape[:3], 1)
    return (o_a.float() * w_a + o_b.float() * w_b).to(o_a.dtype).contiguous(), lse


class CudnnCPAttention(torch.autograd.Function):
    """Local queries against the K/V of the whole CP group; returns [b, s_local, h, d]."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Group) -> torch.Tensor:
        half = q.shape[1] // 2
        order = cp_chunk_order(group.size)
        chunks = (group.rank, 2 * group.size - 1 - group.rank)
        kv = torch.stack([k.transpose(0, 1), v.transpose(0, 1)], dim=1)  # [s_local, 2, b, h, d]
        gathered = torch.empty((group.size * kv.shape[0], *kv.shape[1:]), dtype=kv.dtype, device=kv.device)
        work = all_gather_raw(gathered, kv, group=group.handle, async_op=True)
        qs = [_bhsd(q, i * half, (i + 1) * half) for i in range(2)]
        diag = [_fwd(qs[i], _bhsd(k, i * half, (i + 1) * half), _bhsd(v, i * half, (i + 1) * half), True)
                for i in range(2)]
        work.wait()
        outs, lses, books = [], [], []
        for i, j in enumerate(chunks):
            o, lse, book = diag[i]
            o = o.contiguous()
            pre_book = None
            if j > 0:
                kp, vp = _prefix(gathered, order, j, half)
                o_p, lse_p, pre_book = _fwd(qs[i], kp, vp, False)
                o, lse = _merge(o_p, lse_p, o, lse)
            outs.append(o)
            lses.append(lse)
            books.append((book, pre_book))
        ctx.save_for_backward(q, k, v, gathered, *outs, *lses)
        ctx.group, ctx.books, ctx.half, ctx.chunks = group, books, half, chunks
        return torch.cat(outs, dim=2).transpose(1, 2)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        q, k, v, gathered, o_0, o_1, lse_0, lse_1 = ctx.saved_tensors
        group, half = ctx.group, ctx.half
        order = cp_chunk_order(group.size)
        outs, lses = (o_0, o_1), (lse_0, lse_1)
        qs = [_bhsd(q, i * half, (i + 1) * half) for i in range(2)]
        gs = [_bhsd(grad, i * half, (i + 1) * half) for i in range(2)]
        dq = [torch.zeros_like(qs[0]), torch.zeros_like(qs[1])]
        # Prefix blocks first: their dK/dV belong to (mostly) other ranks' chunks.
        dkv_all = torch.zeros_like(gathered)  # [CP*s_local, 2, b, h, d], the gathered layout
        for i, j in enumerate(ctx.chunks):
            if j == 0:
                continue
            kp, vp = _prefix(gathered, order, j, half)
            dq_p, dk_p, dv_p = _bwd(gs[i], qs[i], kp, vp, outs[i], lses[i], ctx.books[i][1], False)
            dq[i] += dq_p
            for c in range(j):
                r, h = order[c]
                rows = dkv_all[(2 * r + h) * half : (2 * r + h + 1) * half]
                rows[:, 0] += dk_p[:, :, c * half : (c + 1) * half].permute(2, 0, 1, 3)
                rows[:, 1] += dv_p[:, :, c * half : (c + 1) * half].permute(2, 0, 1, 3)
        mine = torch.empty((dkv_all.shape[0] // group.size, *dkv_all.shape[1:]), dtype=dkv_all.dtype,
                           device=dkv_all.device)
        work = reduce_scatter_raw(mine, dkv_all, op=dist.ReduceOp.SUM, group=group.handle, async_op=True)
        # Diagonal blocks meanwhile: local keys only.
        dk_d, dv_d = [], []
        for i in range(2):
            dq_i, dk_i, dv_i = _bwd(gs[i], qs[i], _bhsd(k, i * half, (i + 1) * half),
                                    _bhsd(v, i * half, (i + 1) * half), outs[i], lses[i], ctx.books[i][0], True)
            dq[i] += dq_i
            dk_d.append(dk_i)
            dv_d.append(dv_i)
        work.wait()
        dk = mine[:, 0].transpose(0, 1) + torch.cat(dk_d, dim=2).transpose(1, 2)  # [b, s_local, h, d]
        dv = mine[:, 1].transpose(0, 1) + torch.cat(dv_d, dim=2).transpose(1, 2)
        return torch.cat(dq, dim=2).transpose(1, 2), dk, dv, None


def _prefix(gathered: torch.Tensor, order: list[tuple[int, int]], j: int,
            half: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of global chunks ``0..j-1`` from the gathered buffer, contiguous [b, h, j*half, d]."""
    _, _, b, h, d = gathered.shape
    kp = torch.empty((b, h, j * half, d), dtype=gathered.dtype, device=gathered.device)
    vp = torch.empty_like(kp)
    for c in range(j):
        r, i = order[c]
        rows = gathered[(2 * r + i) * half : (2 * r + i + 1) * half]  # [half, 2, b, h, d]
        kp[:, :, c * half : (c + 1) * half].copy_(rows[:, 0].permute(1, 2, 0, 3))
        vp[:, :, c * half : (c + 1) * half].copy_(rows[:, 1].permute(1, 2, 0, 3))
    return kp, vp
