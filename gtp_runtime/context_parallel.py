"""Context parallelism: causal load-balanced sequence split and exact attention across CP ranks.

A causal mask makes late tokens cost more than early ones, so each sequence is cut into
``2*CP`` chunks and CP rank ``c`` takes chunks ``c`` and ``2*CP-1-c``: every rank gets one cheap
and one expensive chunk. Attention gathers K and V from all CP ranks (with their global positions)
and masks by ``q_pos >= k_pos``; the gather's backward reduce-scatters dK/dV back to their owners.
On CUDA (bf16/fp16) the same attention runs as cuDNN blocks with the collectives overlapped
(:mod:`gtp_runtime.cp_cudnn`); CPUs and ``GTP_CP_ATTENTION=sdpa`` use the SDPA path here.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from gtp_runtime.collectives import gather_kv
from gtp_runtime.cp_cudnn import CudnnCPAttention
from gtp_runtime.groups import Group


def cp_positions(seq_len: int, cp_size: int, cp_rank: int, device: torch.device | None = None) -> torch.Tensor:
    """Global token positions held by ``cp_rank``: chunks ``c`` and ``2*CP-1-c``."""
    chunk = seq_len // (2 * cp_size)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device)
    j = 2 * cp_size - 1 - cp_rank
    second = torch.arange(j * chunk, (j + 1) * chunk, device=device)
    return torch.cat([first, second]) if cp_size > 1 else torch.arange(seq_len, device=device)


def split_for_cp(x: torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
    """The tokens of ``x`` [b, s, ...] that ``cp_rank`` holds, in :func:`cp_positions` order."""
    return x[:, cp_positions(x.shape[1], cp_size, cp_rank, x.device)]


def cp_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, cp: Group
) -> torch.Tensor:
    """Causal attention of local queries against the keys/values of the whole sequence.

    ``q, k, v``: [b, s_local, heads, d]; ``positions``: [s_local] global positions, laid out
    as :func:`cp_positions` lays them out (which is what the chunk arithmetic below relies on).
    """
    if cp.size == 1:
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=True)
        return out.transpose(1, 2)
    if use_cudnn(q):
        return CudnnCPAttention.apply(q, k, v, cp)
    # One all-gather for K and V together, put in global sequence order (gather_kv).
    half = q.shape[1] // 2
    k_all, v_all = gather_kv(k, v, cp)
    # The chunk indices follow from the CP rank (no device-to-host read of ``positions``).
    chunks = (cp.rank, 2 * cp.size - 1 - cp.rank)
    # Each local half is one contiguous chunk j of the sequence: its queries see keys
    # [0, (j+1)*L) with a causal mask aligned to the bottom-right corner. Two such calls keep
    # SDPA on its fused (flash / efficient) kernels; one call with an explicit boolean mask
    # would fall back to a slower masked kernel.
    from torch.nn.attention.bias import causal_lower_right  # imports torch._dynamo: 0.9 s (see the module doc)

    outs = []
    for i, j in enumerate(chunks):
        qi = q[:, i * half : (i + 1) * half]
        end = (j + 1) * half
        outs.append(F.scaled_dot_product_attention(
            qi.transpose(1, 2), k_all[:, :end].transpose(1, 2), v_all[:, :end].transpose(1, 2),
            attn_mask=causal_lower_right(half, end),
        ).transpose(1, 2))
    return torch.cat(outs, dim=1)


# CUDA runs the attention of CP > 1 on cuDNN blocks (:mod:`gtp_runtime.cp_cudnn`);
# ``GTP_CP_ATTENTION=sdpa`` keeps the SDPA (FlashAttention-2) path of cp_attention, for comparison.
CP_ATTENTION = os.environ.get("GTP_CP_ATTENTION", "cudnn")


def use_cudnn(q: torch.Tensor) -> bool:
    """The cuDNN block path: CUDA, bf16/fp16, head dim <= 128, and cuDNN present."""
    return (CP_ATTENTION == "cudnn" and q.is_cuda and q.dtype in (torch.bfloat16, torch.float16)
            and q.shape[-1] <= 128 and q.shape[-1] % 8 == 0 and torch.backends.cudnn.is_available())
