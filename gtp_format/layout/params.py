"""The model's parameters and the bucket layout of any topology, computed without torch.

``ckpt reshard`` writes a checkpoint for a topology no process is running, so it needs what the
runtime would build there: every parameter (name, full shape, how TP splits it, which group
shards it), grouped into buffers and laid out in buckets exactly as
:func:`gtp_runtime.buffers.build_buffers` does. :func:`model_params` lists the parameters of
:class:`gtp_runtime.model.GPTModel` in its ``named_parameters`` order; ``tests/format/
test_param_layout.py`` builds the real model for many (model, topology) pairs and requires
:func:`buffer_layouts` to equal the manifest layout the runtime writes, so the two cannot drift.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gtp_format.layout import topology as topo
from gtp_format.layout.buckets import lay_out
from gtp_format.layout.config import ModelConfig, ParallelConfig
from gtp_format.layout.election import dp_group_idx
from gtp_format.layout.schema import BucketLayout, BufferLayout, ParamLayout
from gtp_format.layout.shard import ShardSpec

GRAD_DTYPE = "torch.float32"  # gradients and optimizer state are fp32 whatever the param dtype


@dataclass(frozen=True)
class ParamDecl:
    """One parameter as the model declares it (identical on every rank)."""

    name: str
    full_shape: tuple[int, ...]
    tp_mode: str | None  # "column", "row", "vocab" or None
    shard_kind: str | None  # topology.WEIGHT, topology.EXPERT_GTP or None (replicated)
    is_expert: bool
    align: int

    def spec(self, par: ParallelConfig, tp_rank: int = 0, shard_rank: int = 0) -> ShardSpec:
        size = {None: 1, topo.WEIGHT: par.weight_group_size, topo.EXPERT_GTP: par.expert_gtp_remat}[self.shard_kind]
        return ShardSpec(self.full_shape, self.tp_mode, par.tp, tp_rank, self.shard_kind, size, shard_rank,
                         self.align)


def model_params(cfg: ModelConfig) -> list[ParamDecl]:
    """Parameters of ``GPTModel(cfg)`` in ``named_parameters`` order (see the module docstring)."""
    h, out = cfg.hidden, []

    def linear(name: str, n_in: int, n_out: int, mode: str, expert: bool = False) -> None:
        out.append(ParamDecl(f"{name}.weight", (n_out, n_in), mode, topo.EXPERT_GTP if expert else topo.WEIGHT,
                             expert, cfg.gtp_align))

    def norm(name: str) -> None:
        out.append(ParamDecl(f"{name}.weight", (h,), None, None, False, 1))

    out.append(ParamDecl("embedding.word_embeddings.weight", (cfg.vocab_size, h), "vocab", None, False, 1))
    for i in range(cfg.num_layers):
        pre = f"decoder.layers.{i}"
        norm(f"{pre}.input_layernorm")
        linear(f"{pre}.self_attention.linear_qkv", h, 3 * h, "column")
        linear(f"{pre}.self_attention.linear_proj", h, h, "row")
        norm(f"{pre}.pre_mlp_layernorm")
        if cfg.is_moe_layer(i):
            out.append(ParamDecl(f"{pre}.mlp.router.weight", (cfg.num_experts, h), None, None, False, 1))
            for e in range(cfg.num_experts):
                linear(f"{pre}.mlp.experts.local_experts.{e}.linear_fc1", h, cfg.ffn_hidden, "column", True)
                linear(f"{pre}.mlp.experts.local_experts.{e}.linear_fc2", cfg.ffn_hidden, h, "row", True)
        else:
            linear(f"{pre}.mlp.linear_fc1", h, cfg.ffn_hidden, "column")
            linear(f"{pre}.mlp.linear_fc2", cfg.ffn_hidden, h, "row")
    norm("decoder.final_layernorm")
    linear("output_layer", h, cfg.vocab_size, "column")
    return out


def param_count(cfg: ModelConfig) -> int:
    """Exactly ``sum(numel)`` over :func:`model_params`
    (``tests/format/test_copy_checks.py:test_param_count_is_exact`` checks it against that sum), in
    closed form: a manifest declares the layer count, so a count that walked the layers would be a
    loop as long as a 4 KB edit asks for. The output layer is untied (its own ``vocab x hidden``),
    which an estimate that left it out undercounted by up to 2x."""
    h, layers, ffn, experts = cfg.hidden, cfg.num_layers, cfg.ffn_hidden, cfg.num_experts
    moe = layers // cfg.moe_every if experts > 0 and cfg.moe_every > 0 else 0
    per_layer = 2 * h + 4 * h * h  # two norms, qkv (3h x h) and proj (h x h)
    return (2 * cfg.vocab_size * h + h + layers * per_layer + (layers - moe) * 2 * h * ffn
            + moe * (experts * h + experts * 2 * h * ffn))


def _dp(par: ParallelConfig, is_expert: bool, excludes_cp: bool) -> tuple[str, int]:
    if is_expert:
        return topo.EXPERT_DP, par.expert_dp
    return (topo.DP, par.dp) if excludes_cp else (topo.DP_CP, par.dp * par.cp)


def buffer_layouts(cfg: ModelConfig, par: ParallelConfig, bucket_size: int,
                   param_dtype: str) -> tuple[BufferLayout, ...]:
    """The manifest ``buffers`` a run of ``cfg`` at ``par`` writes (as seen from rank 0)."""
    groups: dict[tuple[bool, bool], list[ParamDecl]] = {}
    for p in model_params(cfg):
        excludes_cp = par.fold_cp and p.shard_kind == topo.WEIGHT and not p.is_expert
        groups.setdefault((p.is_expert, excludes_cp), []).append(p)
    order = sorted(groups, key=lambda k: (k[0], not k[1]))
    grid = topo.Topology(par)
    out = []
    for gbuf_idx, (is_expert, excludes_cp) in enumerate(order):
        ordered = list(reversed(groups[(is_expert, excludes_cp)]))
        specs = [p.spec(par) for p in ordered]
        kind, dp_size = _dp(par, is_expert, excludes_cp)
        slots, spans, _ = lay_out([math.prod(s.local_shape) for s in specs], bucket_size, dp_size)
        params: list[list[ParamLayout]] = [[] for _ in spans]
        for p, s, slot in zip(ordered, specs, slots):
            b = spans[slot.bucket]
            params[slot.bucket].append(ParamLayout(
                name=p.name, start=slot.start - b.start, end=slot.end - b.start,
                valid_numel=s.valid_rows * math.prod(s.local_shape[1:]), local_shape=s.local_shape,
                full_shape=s.full_shape, global_shape=s.global_shape, tp_mode=s.tp_mode, shard_kind=s.shard_kind,
                shard_size=s.shard_size, align=s.align))
        out.append(BufferLayout(
            gbuf_idx=gbuf_idx, dtype=repr_tag(param_dtype), param_dtype=param_dtype, grad_dtype=GRAD_DTYPE,
            is_expert=is_expert, excludes_cp=excludes_cp, dp_group_kind=kind, dp_size=dp_size, grad_divisor=dp_size,
            example_dp_group_idx=dp_group_idx(grid, 0, is_expert),
            buckets=tuple(BucketLayout(bucket_idx=b.index, numel=b.numel, numel_unpadded=b.numel_unpadded,
                                       params=tuple(ps)) for b, ps in zip(spans, params))))
    return tuple(out)


def repr_tag(param_dtype: str) -> str:
    """The key's dtype tag for a buffer of ``param_dtype`` params and fp32 grads (as Megatron prints it)."""
    return f"({param_dtype}, {GRAD_DTYPE})"
