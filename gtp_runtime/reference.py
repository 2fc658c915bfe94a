"""The independent single-process fp32 reference: the same GPT written as plain tensor code.

It shares nothing with the distributed model but the initialiser and the config: no sharding, no
collectives, no buffers, full sequences, ``torch.optim.AdamW`` and ``clip_grad_norm_``. Parity
tests compare every rank's shard against the matching slice of this model's gradients and params.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from gtp_format.layout.config import ModelConfig
from gtp_runtime.init import full_init


def param_names(cfg: ModelConfig) -> list[str]:
    names = ["embedding.word_embeddings.weight"]
    for i in range(cfg.num_layers):
        p = f"decoder.layers.{i}."
        names += [p + "input_layernorm.weight", p + "self_attention.linear_qkv.weight",
                  p + "self_attention.linear_proj.weight", p + "pre_mlp_layernorm.weight"]
        if cfg.is_moe_layer(i):
            names.append(p + "mlp.router.weight")
            for e in range(cfg.num_experts):
                q = f"{p}mlp.experts.local_experts.{e}."
                names += [q + "linear_fc1.weight", q + "linear_fc2.weight"]
        else:
            names += [p + "mlp.linear_fc1.weight", p + "mlp.linear_fc2.weight"]
    return names + ["decoder.final_layernorm.weight", "output_layer.weight"]


def param_shape(cfg: ModelConfig, name: str) -> tuple[int, ...]:
    h, f, v = cfg.hidden, cfg.ffn_hidden, cfg.vocab_size
    table = {
        "word_embeddings.weight": (v, h), "layernorm.weight": (h,), "linear_qkv.weight": (3 * h, h),
        "linear_proj.weight": (h, h), "linear_fc1.weight": (f, h), "linear_fc2.weight": (h, f),
        "router.weight": (cfg.num_experts, h), "output_layer.weight": (v, h),
    }
    for suffix, shape in table.items():
        if name.endswith(suffix):
            return shape
    raise KeyError(name)


class ReferenceGPT:
    """Full fp32 weights in a dict, a functional forward, AdamW from torch."""

    def __init__(self, cfg: ModelConfig, device: torch.device | None = None) -> None:
        self.cfg = cfg
        self.device = device or torch.device("cpu")
        self.params = {
            n: full_init(n, param_shape(cfg, n), cfg.seed, cfg.num_layers, self.device).requires_grad_(True)
            for n in param_names(cfg)
        }

    def _norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.cfg.norm_eps) * w

    def _rope(self, x: torch.Tensor) -> torch.Tensor:
        s, d = x.shape[1], x.shape[-1]
        inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d))
        ang = torch.outer(torch.arange(s, dtype=torch.float32, device=x.device), inv)
        cos, sin = ang.cos().repeat(1, 2)[None, :, None], ang.sin().repeat(1, 2)[None, :, None]
        half = d // 2
        rot = torch.cat([-x[..., half:], x[..., :half]], -1)
        return x * cos + rot * sin

    def _mlp(self, prefix: str, x: torch.Tensor) -> torch.Tensor:
        P = self.params
        return F.gelu(x @ P[prefix + "linear_fc1.weight"].t()) @ P[prefix + "linear_fc2.weight"].t()

    def loss(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.logits(tokens).flatten(0, 1), labels.flatten())

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """[b, s, vocab] fp32 logits: what an export's consumers (transformers) must reproduce."""
        cfg, P = self.cfg, self.params
        b, s = tokens.shape
        nh, hd = cfg.num_heads, cfg.hidden // cfg.num_heads
        x = P["embedding.word_embeddings.weight"][tokens]
        for i in range(cfg.num_layers):
            p = f"decoder.layers.{i}."
            h = self._norm(x, P[p + "input_layernorm.weight"])
            qkv = (h @ P[p + "self_attention.linear_qkv.weight"].t()).view(b, s, nh, 3, hd)
            q, k, v = self._rope(qkv[..., 0, :]), self._rope(qkv[..., 1, :]), qkv[..., 2, :]
            scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hd)
            causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
            att = scores.masked_fill(~causal, float("-inf")).softmax(-1)
            o = torch.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, s, cfg.hidden)
            x = x + o @ P[p + "self_attention.linear_proj.weight"].t()
            h = self._norm(x, P[p + "pre_mlp_layernorm.weight"])
            if cfg.is_moe_layer(i):
                logits = h @ P[p + "mlp.router.weight"].t()
                val, idx = logits.topk(cfg.moe_topk, -1)
                gates = torch.zeros_like(logits).scatter(-1, idx, val.softmax(-1))
                mix = sum(gates[..., e : e + 1] * self._mlp(f"{p}mlp.experts.local_experts.{e}.", h)
                          for e in range(cfg.num_experts))
                x = x + mix
            else:
                x = x + self._mlp(p + "mlp.", h)
        x = self._norm(x, P["decoder.final_layernorm.weight"])
        return x @ P["output_layer.weight"].t()

    def grads(self, tokens: torch.Tensor, labels: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
        for p in self.params.values():
            p.grad = None
        loss = self.loss(tokens.to(self.device), labels.to(self.device))
        loss.backward()
        return loss.item(), {n: p.grad.detach().clone() for n, p in self.params.items()}
