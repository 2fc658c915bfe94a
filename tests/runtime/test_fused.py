"""The fused regions of gtp_runtime.fused against the unfused layers, in fp32 on the CPU.

On the CPU the regions run eagerly (torch.compile is applied on CUDA only), so these tests check
their math: the norm and RoPE regions equal the layers bit for bit, the chunked linear
cross-entropy matches F.linear + F.cross_entropy in loss, input gradient and fp32 weight gradient
for any chunk size. tests/runtime/test_gpu.py checks the compiled kernels against the unfused path.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from gtp_runtime import fused
from gtp_runtime.groups import Group
from gtp_runtime.layers import RMSNorm, rope
from gtp_runtime.sharding import GTPComm


def _grads(fn, *inputs: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    out = fn(*leaves)
    out = out if isinstance(out, tuple) else (out,)
    torch.manual_seed(99)
    total = sum((o.float() * torch.randn(o.shape)).sum() for o in out)
    total.backward()
    return torch.cat([o.detach().float().flatten() for o in out]), [t.grad for t in leaves]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_regions_equal_the_layer(dtype: torch.dtype) -> None:
    x, y, w = torch.randn(2, 5, 16, dtype=dtype), torch.randn(2, 5, 16, dtype=dtype), torch.randn(16, dtype=dtype)

    def unfused_norm(x, w):  # the layer's own forward, on a stand-in holding eps and weight
        return RMSNorm.forward(SimpleNamespace(eps=1e-5, weight=w), x)

    out, grads = _grads(lambda a, b: fused.rms_norm(a, b, 1e-5), x, w)
    ref_out, ref_grads = _grads(unfused_norm, x, w)
    assert torch.equal(out, ref_out) and all(torch.equal(a, b) for a, b in zip(grads, ref_grads))
    out, grads = _grads(lambda a, b, c: fused.add_rms_norm(a, b, c, 1e-5), x, y, w)
    ref_out, ref_grads = _grads(lambda a, b, c: ((t := a + b), unfused_norm(t, c)), x, y, w)
    assert torch.equal(out, ref_out) and all(torch.equal(a, b) for a, b in zip(grads, ref_grads))


def test_rope_region_equals_the_layer() -> None:
    b, s, heads, d = 2, 6, 3, 8
    qkv = torch.randn(b, s, heads, 3, d)
    positions = torch.tensor([0, 1, 2, 9, 10, 11])
    cos, sin = fused.rope_tables(positions, d)

    def unfused(t):
        q, k, v = t.unbind(dim=3)
        return rope(q, positions), rope(k, positions), v

    out, (g,) = _grads(lambda t: fused.rope_qkv(t, cos, sin), qkv)
    ref_out, (ref_g,) = _grads(unfused, qkv)
    assert torch.equal(out, ref_out) and torch.equal(g, ref_g)
    assert all(t.is_contiguous() for t in fused.rope_qkv(qkv, cos, sin))


def _shard(vocab: int, hidden: int) -> tuple[torch.nn.Parameter, GTPComm]:
    comm = GTPComm()
    w = torch.nn.Parameter(torch.randn(vocab, hidden) * 0.3)
    comm.register(w, Group("gtp", [0], None, 0))
    w.main_grad = torch.zeros(vocab, hidden)  # type: ignore[attr-defined]
    return w, comm


@pytest.mark.parametrize("chunk", [1, 3, 7, 64])
def test_chunked_linear_cross_entropy_matches_unfused(chunk: int) -> None:
    torch.manual_seed(chunk)
    b, s, hidden, vocab = 2, 7, 12, 40
    x0 = torch.randn(b, s, hidden)
    labels = torch.randint(0, vocab, (b, s))
    w, comm = _shard(vocab, hidden)

    x = x0.clone().requires_grad_(True)
    ref_loss = F.cross_entropy(F.linear(x, w).flatten(0, 1), labels.flatten())
    (ref_loss * 0.5).backward()
    ref_gx, ref_gw = x.grad, w.grad
    w.grad = None

    x = x0.clone().requires_grad_(True)
    loss = fused.FusedLinearCrossEntropyFn.apply(x, w, labels, comm, vocab, fused.ce_chunk, chunk)
    (loss * 0.5).backward()
    assert w.grad is None  # the weight gradient went into main_grad, as for every GTP linear
    assert torch.allclose(loss, ref_loss, rtol=1e-6, atol=0)
    assert torch.allclose(x.grad, ref_gx, rtol=1e-5, atol=1e-7)
    assert torch.allclose(w.main_grad, ref_gw, rtol=1e-5, atol=1e-7)


def test_ce_chunk_gradient_is_the_softmax_minus_one_hot() -> None:
    logits = torch.randn(5, 11, requires_grad=True)
    labels = torch.tensor([0, 3, 10, 3, 7])
    F.cross_entropy(logits, labels, reduction="sum").backward()
    loss, d = fused.ce_chunk(logits.detach(), labels, 1.0)
    assert torch.allclose(loss, F.cross_entropy(logits.detach(), labels, reduction="sum"), rtol=1e-6)
    assert torch.allclose(d, logits.grad, atol=1e-6)


def test_unknown_backend_is_refused() -> None:
    with pytest.raises(ValueError, match="compile, liger"):
        fused.FusedOps("triton")
