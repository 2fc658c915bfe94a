"""A small Megatron-style GPT built from GTP-sharded layers.

Module names reproduce Megatron's parameter names (``embedding.word_embeddings.weight``,
``decoder.layers.0.self_attention.linear_qkv.weight``, ``decoder.layers.1.mlp.router.weight``,
``decoder.layers.1.mlp.experts.local_experts.0.linear_fc1.weight``, ...) so checkpoints read
like Megatron's. Dense linears and the output layer are GTP-managed (sharded over the weight
group); expert linears shard over the expert GTP group and never fold; embeddings, norms and the
router are replicated.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from gtp_format.layout import topology as topo
from gtp_format.layout.config import ModelConfig, ParallelConfig
from gtp_runtime.collectives import gather_last_dim
from gtp_runtime.context_parallel import cp_attention
from gtp_runtime.fused import FusedOps, rope_tables, unfused_cross_entropy
from gtp_runtime.groups import Groups
from gtp_runtime.init import full_init
from gtp_runtime.layers import Build, GTPLinear, RMSNorm, VocabParallelEmbedding, make_spec, rope, spec_param
from gtp_runtime.sharding import GTPComm, take_shard


class SelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, b: Build) -> None:
        super().__init__()
        h = cfg.hidden
        self.groups = b.groups
        self.head_dim = h // cfg.num_heads
        self.local_heads = cfg.num_heads // b.groups[topo.TP].size
        # Rows of linear_qkv are grouped per head as [q_h; k_h; v_h], so a TP split of the rows
        # hands each TP rank whole heads (Megatron's interleaved layout).
        self.linear_qkv = GTPLinear(b, h, 3 * h, "column")
        self.linear_proj = GTPLinear(b, h, h, "row")

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        qkv = self.linear_qkv(x).view(b, s, self.local_heads, 3, self.head_dim)
        q, k, v = qkv.unbind(dim=3)
        q, k = rope(q, positions), rope(k, positions)
        out = cp_attention(q, k, v, positions, self.groups[topo.CP])
        return self.linear_proj(out.reshape(b, s, self.local_heads * self.head_dim))

    def forward_fused(self, x: torch.Tensor, positions: torch.Tensor, rope_cs: tuple[torch.Tensor, torch.Tensor],
                      ops: FusedOps) -> torch.Tensor:
        b, s, _ = x.shape
        qkv = self.linear_qkv(x).view(b, s, self.local_heads, 3, self.head_dim)
        q, k, v = ops.rope_qkv(qkv, *rope_cs)
        out = cp_attention(q, k, v, positions, self.groups[topo.CP])
        return self.linear_proj(out.reshape(b, s, self.local_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, b: Build, expert: bool = False) -> None:
        super().__init__()
        self.linear_fc1 = GTPLinear(b, cfg.hidden, cfg.ffn_hidden, "column", expert=expert)
        self.linear_fc2 = GTPLinear(b, cfg.ffn_hidden, cfg.hidden, "row", expert=expert)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class Experts(nn.Module):
    def __init__(self, cfg: ModelConfig, b: Build) -> None:
        super().__init__()
        self.local_experts = nn.ModuleList(
            [MLP(cfg, b, expert=True) for _ in range(cfg.num_experts)]
        )


class MoE(nn.Module):
    """Top-k routed experts, EP=1: every rank runs every expert on its own tokens.

    Each expert runs on all local tokens and is weighted by a gate that is zero for tokens not
    routed to it. That costs FLOPs but keeps every rank's collectives identical (an expert that
    got no tokens on one rank would otherwise skip its all-gather and hang the group).
    """

    def __init__(self, cfg: ModelConfig, b: Build) -> None:
        super().__init__()
        self.topk = cfg.moe_topk
        self.router = nn.Module()
        spec = make_spec(b.groups, (cfg.num_experts, cfg.hidden), None, None, 1)
        self.router.weight = spec_param(spec, b.dtype, False, b.device)
        self.experts = Experts(cfg, b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x.float(), self.router.weight.float())
        top_val, top_idx = logits.topk(self.topk, dim=-1)
        gates = torch.zeros_like(logits).scatter(-1, top_idx, torch.softmax(top_val, dim=-1))
        out = torch.zeros_like(x, dtype=torch.float32)
        for e, expert in enumerate(self.experts.local_experts):
            out = out + gates[..., e : e + 1] * expert(x).float()
        return out.to(x.dtype)


class TransformerLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, b: Build, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(b, cfg.hidden, cfg.norm_eps)
        self.self_attention = SelfAttention(cfg, b)
        self.pre_mlp_layernorm = RMSNorm(b, cfg.hidden, cfg.norm_eps)
        self.mlp = MoE(cfg, b) if cfg.is_moe_layer(layer) else MLP(cfg, b)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attention(self.input_layernorm(x), positions)
        return x + self.mlp(self.pre_mlp_layernorm(x))

    def forward_fused(self, x: torch.Tensor, positions: torch.Tensor, rope_cs: tuple[torch.Tensor, torch.Tensor],
                      ops: FusedOps) -> torch.Tensor:
        """The same layer with its element-wise work in fused regions (residual add + norm in one)."""
        h = ops.rms_norm(x, self.input_layernorm.weight, self.input_layernorm.eps)
        a = self.self_attention.forward_fused(h, positions, rope_cs, ops)
        x, h = ops.add_rms_norm(x, a, self.pre_mlp_layernorm.weight, self.pre_mlp_layernorm.eps)
        return x + self.mlp(h)


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig, b: Build) -> None:
        super().__init__()
        self.layers = nn.ModuleList([TransformerLayer(cfg, b, i) for i in range(cfg.num_layers)])
        self.final_layernorm = RMSNorm(b, cfg.hidden, cfg.norm_eps)


class Embedding(nn.Module):
    def __init__(self, cfg: ModelConfig, b: Build) -> None:
        super().__init__()
        self.word_embeddings = VocabParallelEmbedding(b, cfg.vocab_size, cfg.hidden)


class GPTModel(nn.Module):
    """The sharded model of one rank. ``forward`` returns this rank's mean token loss.

    ``fused`` (``"compile"`` or ``"liger"``, see :mod:`gtp_runtime.fused`) runs the element-wise
    work in fused regions; ``None`` keeps the unfused layers, the path the fp32 reference checks.
    """

    def __init__(self, cfg: ModelConfig, par: ParallelConfig, groups: Groups,
                 dtype: torch.dtype = torch.float32, device: torch.device | None = None,
                 prefetch: bool = True, overlap_grad_reduce: bool = True, fused: str | None = None) -> None:
        super().__init__()
        self.cfg, self.par, self.groups = cfg, par, groups
        self.fused = FusedOps(fused) if fused else None
        self.gtp_comm = GTPComm(prefetch, overlap_grad_reduce)
        b = Build(groups, dtype, device, self.gtp_comm, cfg.gtp_align)
        self.embedding = Embedding(cfg, b)
        self.decoder = Decoder(cfg, b)
        self.output_layer = GTPLinear(b, cfg.hidden, cfg.vocab_size, "column")
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        for name, p in self.named_parameters():
            full = full_init(name, p.spec.full_shape, self.cfg.seed, self.cfg.num_layers, device=p.device)
            p.copy_(take_shard(p.spec, full).to(p.dtype))

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self.fused is not None:
            return self._forward_fused(tokens, labels, positions, self.fused)
        x = self.embedding.word_embeddings(tokens)
        for layer in self.decoder.layers:
            x = layer(x, positions)
        x = self.decoder.final_layernorm(x)
        logits = gather_last_dim(self.output_layer(x), self.groups[topo.TP])
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())

    def _forward_fused(self, tokens: torch.Tensor, labels: torch.Tensor, positions: torch.Tensor,
                       ops: FusedOps) -> torch.Tensor:
        x = self.embedding.word_embeddings(tokens)
        rope_cs = rope_tables(positions, self.cfg.hidden // self.cfg.num_heads)
        for layer in self.decoder.layers:
            x = layer.forward_fused(x, positions, rope_cs, ops)
        norm = self.decoder.final_layernorm
        x = ops.rms_norm(x, norm.weight, norm.eps)
        out = self.output_layer
        tp = self.groups[topo.TP]
        if tp.size > 1:  # vocab-parallel logits: the fused loss would need TP reductions inside
            return unfused_cross_entropy(gather_last_dim(out(x), tp), labels)
        return ops.linear_cross_entropy(x, out.weight, labels, out.comm, out.rows, out)


def is_gtp_dense(p: nn.Parameter) -> bool:
    """A dense weight sharded over the (possibly folded) weight group."""
    return p.spec.shard_kind == topo.WEIGHT and not p.is_expert
