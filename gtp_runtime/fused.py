"""Fused element-wise regions of the transformer for GPUs (opt-in: ``TrainConfig.fused``).

Why: on 2 x H200 (hidden 4096, 8 layers, sequence 8192) unfused element-wise kernels took 74 ms
of a 207 ms step: RMSNorm and RoPE op by op in fp32, the residual adds, the fp32 cross-entropy
over a sequence x vocabulary logits tensor, and fp32 weight-gradient copies. Each function below
is one region that ``torch.compile`` (Inductor) turns into one or two Triton kernels forward and
one or two backward ("regional compilation": GEMMs, flash attention and NCCL stay outside the
compiled regions, where cuBLAS, FlashAttention and NCCL already do the work and the GTP
collectives could not be traced anyway).

``backend="compile"`` compiles the regions on CUDA and runs the same Python eagerly elsewhere, so
the CPU tests check the math of every region against the unfused layers in fp32; the GPU tests
check the compiled kernels against the unfused path at bf16 tolerance. ``backend="liger"`` swaps
RMSNorm (with the residual add), RoPE and the cross-entropy for Liger-Kernel's Triton kernels,
the measured alternative (CUDA only).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from gtp_runtime.sharding import GTPComm, accumulate_wgrad

BACKENDS = ("compile", "liger")
# Logits per cross-entropy chunk: 64 Mi elements (2048 tokens at a 32768 vocabulary) keeps the
# bf16 chunk and its gradient at 128 MiB each whatever the sequence length.
CE_CHUNK_ELEMENTS = 1 << 26


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """The unfused :class:`~gtp_runtime.layers.RMSNorm` math: fp32 statistics, cast at the end."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * w.float()).to(x.dtype)


def add_rms_norm(x: torch.Tensor, y: torch.Tensor, w: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add and the next RMSNorm in one region: ``(x + y, rms_norm(x + y))``."""
    s = x + y
    return s, rms_norm(s, w, eps)


def rope_tables(positions: torch.Tensor, dim: int, base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [s, dim] (fp32) of :func:`~gtp_runtime.layers.rope`, computed once per forward."""
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=positions.device) / dim))
    ang = positions.to(torch.float32)[:, None] * inv[None, :]
    return torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x.float() * cos[None, :, None, :] + rotated * sin[None, :, None, :]).to(x.dtype)


def rope_qkv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Split ``qkv`` [b, s, heads, 3, d] into contiguous q, k, v with RoPE applied to q and k."""
    q, k, v = qkv.unbind(dim=3)
    return _rotate(q, cos, sin), _rotate(k, cos, sin), v.contiguous()


def ce_chunk(logits: torch.Tensor, labels: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed cross-entropy of one chunk and ``scale * d(loss)/d(logits)`` in the logits' dtype.

    The fp32 softmax exists only inside the compiled kernel: nothing of size tokens x vocabulary
    is written in fp32. The gradient is what the unfused path gives its bf16 logits (autograd of
    ``logits.float()`` casts the fp32 gradient back).
    """
    lf = logits.float()
    lse = torch.logsumexp(lf, dim=-1)
    loss = (lse - lf.gather(-1, labels[:, None]).squeeze(-1)).sum()
    p = torch.exp(lf - lse[:, None])
    hit = torch.arange(lf.shape[-1], device=lf.device)[None, :] == labels[:, None]
    return loss, ((p - hit.to(p.dtype)) * scale).to(logits.dtype)


class FusedLinearCrossEntropyFn(torch.autograd.Function):
    """Mean cross-entropy of ``x @ W.T`` for a GTP-sharded ``W``, computed chunk by chunk.

    Forward gathers ``W`` once and, per chunk of tokens, computes the bf16 logits, the loss and
    the logits' gradient (:func:`ce_chunk`), then the input gradient and the fp32 weight gradient
    of that chunk; the logits are dropped. Backward scales both by the incoming gradient and hands
    the weight gradient to the same reduce-scatter / ``main_grad`` path as every GTP linear.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, shard: torch.Tensor, labels: torch.Tensor, comm: GTPComm, rows: int,
                chunk_fn: Callable[..., tuple[torch.Tensor, torch.Tensor]], chunk: int) -> torch.Tensor:
        full = comm.gather(shard, +1)[:rows]
        x2, y = x.reshape(-1, x.shape[-1]), labels.reshape(-1)
        n = x2.shape[0]
        group_size = shard.gtp_group.size  # type: ignore[attr-defined]
        grad_w = torch.zeros((shard.shape[0] * group_size, shard.shape[1]), dtype=torch.float32, device=x.device)
        grad_x = torch.empty_like(x2)
        loss = torch.zeros((), dtype=torch.float32, device=x.device)
        for lo in range(0, n, chunk):
            xc = x2[lo : lo + chunk]
            part, dlogits = chunk_fn(xc @ full.t(), y[lo : lo + chunk], 1.0 / n)
            loss += part
            grad_x[lo : lo + chunk] = dlogits @ full
            accumulate_wgrad(grad_w[:rows], dlogits, xc)
        ctx.save_for_backward(grad_x, grad_w, shard)
        ctx.comm, ctx.shape = comm, x.shape
        return loss / n

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        grad_x, grad_w, shard = ctx.saved_tensors
        comm: GTPComm = ctx.comm
        # Backward would gather this weight and prefetch its neighbour; the gradient is already
        # there, so only the neighbour's gather is started.
        comm.prefetch_neighbour(shard.gtp_index, -1)
        grad_w.mul_(grad)
        grad_shard = comm.reduce_scatter(shard, grad_w)
        grad_x = (grad_x * grad.to(grad_x.dtype)).view(ctx.shape)
        return grad_x, None if grad_shard is None else grad_shard.to(shard.dtype), None, None, None, None, None


def compiled_region(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` compiled by Inductor for CUDA tensors, eager for anything else."""
    state: dict[str, Any] = {}

    def call(*args: Any) -> Any:
        if not args[0].is_cuda:
            return fn(*args)
        if "fn" not in state:
            import torch._dynamo

            # One compiled region serves every layer; the benchmark's shapes and sequence lengths
            # would exceed the default of 8 recompiles and silently fall back to eager.
            torch._dynamo.config.recompile_limit = max(64, getattr(torch._dynamo.config, "recompile_limit", 8))
            # Static shapes: one specialised kernel per shape. On 2 x H200 automatic dynamic shapes
            # failed to trace rope_qkv (it lost that q's and cos's sequence lengths are equal), and
            # a dynamic-size reduction ran as a single-block kernel, 50x slower than eager.
            state["fn"] = torch.compile(fn, fullgraph=True, dynamic=False)
        return state["fn"](*args)

    return call


class FusedOps:
    """The fused regions of one backend, as the model calls them."""

    def __init__(self, backend: str) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"fused backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
        self.backend = backend
        self.rms_norm = compiled_region(rms_norm)
        self.add_rms_norm = compiled_region(add_rms_norm)
        self.rope_qkv = compiled_region(rope_qkv)
        self.ce_chunk = compiled_region(ce_chunk)
        if backend == "liger":
            self._use_liger()

    def _use_liger(self) -> None:
        try:
            from liger_kernel.ops.cross_entropy import LigerCrossEntropyFunction
            from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction
            from liger_kernel.ops.rms_norm import LigerRMSNormFunction
            from liger_kernel.ops.rope import LigerRopeFunction
        except ImportError as e:
            raise ImportError(f"fused backend 'liger' needs Liger-Kernel (pip install liger-kernel): {e}") from e
        # casting_mode "gemma" keeps the whole norm in fp32 like the unfused layer; in_place=False
        # because the residual branch still reads the incoming gradient.
        self.rms_norm = lambda x, w, eps: LigerRMSNormFunction.apply(x, w, eps, 0.0, "gemma", False)

        def add_norm(x: torch.Tensor, y: torch.Tensor, w: torch.Tensor, eps: float) -> tuple[torch.Tensor, ...]:
            normed, total = LigerFusedAddRMSNormFunction.apply(x, y, w, eps, 0.0, "gemma", False)
            return total, normed

        self.add_rms_norm = add_norm

        def rope(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
            q, k, v = (t.contiguous() for t in qkv.unbind(dim=3))
            q, k = LigerRopeFunction.apply(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
            return q.transpose(1, 2), k.transpose(1, 2), v

        self.rope_qkv = rope
        self.cross_entropy = lambda logits, labels: LigerCrossEntropyFunction.apply(logits, labels, None)[0]

    def linear_cross_entropy(self, x: torch.Tensor, shard: torch.Tensor, labels: torch.Tensor, comm: GTPComm,
                             rows: int, linear: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """Mean token loss of the output layer without an fp32 tokens x vocabulary tensor."""
        if self.backend == "liger":  # bf16 logits, Liger's in-place loss and gradient
            return self.cross_entropy(linear(x).flatten(0, 1), labels.flatten())
        chunk = max(1, CE_CHUNK_ELEMENTS // rows)
        return FusedLinearCrossEntropyFn.apply(x, shard, labels, comm, rows, self.ce_chunk, chunk)


def unfused_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The unfused loss (fp32 logits), for the paths the fused one does not cover (TP > 1)."""
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
