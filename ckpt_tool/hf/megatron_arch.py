"""megatron-core's GPT -> the transformers class that computes it exactly, chosen from the checkpoint.

The model is the one description the checkpoint records (:func:`gtp_format.megatron.args.describe_model`:
``common_state``'s args checked against the stored shapes); no model flag is asked for. Each
supported combination of Megatron settings maps onto the one transformers class whose forward is
the same function, with every config key that changes the forward written from the checkpoint:

* learned absolute positions, LayerNorm, linear biases, a non-gated MLP -> ``GPTBigCodeForCausalLM``
  (``activation_function`` from ``--openai-gelu``/``--squared-relu``; ``multi_query`` for one query
  group: GPT-BigCode's MQA ``c_attn`` rows are ``[q (all heads); k; v]``, which is megatron's layout
  for one group, and its MHA view ``(heads, 3 * head_dim)`` is megatron's per-head ``[q_h; k_h; v_h]``);
* RoPE, RMSNorm, SwiGLU -> ``LlamaForCausalLM`` (``attention_bias``/``mlp_bias`` from
  ``--add-bias-linear``), ``Qwen2ForCausalLM`` (biases on q/k/v only: ``--add-qkv-bias`` without
  linear biases), ``Qwen3ForCausalLM`` (RMSNorm q/k layernorm: megatron-core and Qwen3 both
  normalise each head's query and key over the head dimension before RoPE);
* RoPE, RMSNorm, a non-gated MLP -> ``ArceeForCausalLM``; RoPE, LayerNorm, biases, non-gated GELU ->
  ``Starcoder2ForCausalLM``; the same with LayerNorm q/k layernorm (MHA only: no ``num_key_value_heads``)
  -> ``PersimmonForCausalLM`` (``partial_rotary_factor`` written as 1.0: its default is 0.5).

megatron-core's fused tensors are cut by rows: ``linear_qkv`` holds, per query group, the group's
query heads then one key head then one value head (``SelfAttention.get_query_key_value_tensors``);
a gated ``linear_fc1`` holds the gate rows then the up rows (``torch.chunk(x, 2)``: the first half
goes through the activation). megatron's RoPE rotates halves (``rotary_interleaved`` off), as
transformers' ``rotate_half`` does, with ``inv_freq = base ** -(2i / head_dim)``; attention is scaled
by ``kv_channels ** -0.5``, as every class here scales by ``head_dim ** -0.5``.

``--use-rope-scaling`` (Llama 3.x's frequency scaling) maps onto every RoPE class here with ``rope_parameters``
``{rope_type: llama3, factor: --rope-scaling-factor}`` and megatron-core's fixed ``low_freq_factor`` 1,
``high_freq_factor`` 4, ``original_max_position_embeddings`` 8192 (:data:`ROPE_SCALING_CLASSES`); with learned
positions (GPT-BigCode) it is refused.

What no class represents exactly is refused in one line naming the Megatron setting (MoE, interleaved
or partial rotary, zero-centred gamma, GLU offsets and clamps, multi-latent attention,
...): a folder that loads and computes another function is worse than a refusal.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ckpt_tool.hf.mapping import refuse_megatron_moe
from gtp_format.errors import FormatError
from gtp_format.megatron.args import ModelDescription

Rows = tuple[tuple[int, int], ...]
MEGATRON_EPS = 1e-5  # TransformerConfig.layernorm_epsilon's default (--norm-epsilon)
MEGATRON_ROPE_BASE = 10000  # --rotary-base's default
# --use-rope-scaling: megatron-core 0.19.2's RotaryEmbedding._apply_scaling takes only the factor
# (--rope-scaling-factor, default 8) and fixes the other three constants of Llama 3's scaling to these
# values, which transformers' "llama3" rope type reads from rope_parameters (the same piecewise formula:
# wavelengths under original / high_freq_factor kept, over original / low_freq_factor divided by the
# factor, the band between interpolated)
MEGATRON_LLAMA3 = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
MEGATRON_ROPE_SCALING_FACTOR = 8.0
# every RoPE class the export writes and the import reads: each builds its rotary table through
# transformers' shared ROPE_INIT_FUNCTIONS["llama3"] (the scaled inverse frequencies, then cos/sin as with plain
# RoPE), and each, imported with Llama 3's scaling, computes transformers' logits in megatron-core's own forward
# within 1e-5 over 256 positions, where plain RoPE is 1e-4 off (tests/cli/test_hf_megatron_import.py)
ROPE_SCALING_CLASSES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                        "ArceeForCausalLM", "Starcoder2ForCausalLM", "PersimmonForCausalLM", "MixtralForCausalLM",
                        "Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM")
# args whose non-default value changes the forward in a way no class here represents
# (the flag, the numeric value that is the default where there is one; off, None or False, is always default)
UNREPRESENTABLE = {
    "rotary_interleaved": ("--rotary-interleaved (transformers' classes rotate halves)", None),
    "apply_layernorm_1p": ("--apply-layernorm-1p (zero-centred gamma)", None),
    "rotary_seq_len_interpolation_factor": ("--rotary-seq-len-interpolation-factor", None),
    "glu_linear_offset": ("--glu-linear-offset", 0.0),
    "activation_func_clamp_value": ("--activation-func-clamp-value", None),
    "multi_latent_attention": ("--multi-latent-attention", None),
    "qk_l2_norm": ("--qk-l2-norm", None),
    "attention_output_gate": ("--attention-output-gate", None),
    "softmax_scale": ("--softmax-scale (transformers scales by head_dim ** -0.5)", None),
    "window_size": ("--window-size (sliding-window attention; the classes here attend to every earlier token)", None),
    "no_rope_freq": ("--no-rope-freq (layers without RoPE)", None),
}
ACT_BIGCODE = {"gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh", "squared_relu": "relu2"}
ACT_HF = {"gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh", "squared_relu": "relu2", "silu": "silu"}


@dataclass(frozen=True)
class Target:
    """The transformers class of a megatron-core GPT: its ``config.json`` and the name table."""

    architecture: str
    config: dict[str, Any]
    names: Callable[[str, tuple[int, ...]], list[tuple[str, Rows]]]
    assumed: list[str] = field(default_factory=list)  # Megatron defaults taken where args do not record a field


def _refuse(where: str, why: str) -> FormatError:
    return FormatError(f"{where}: {why}; export the raw tensors with --names megatron")


def _heads(d: ModelDescription, shapes: dict[str, tuple[int, ...]], num_heads: int | None,
           where: str) -> tuple[int, int, int]:
    """(heads, query groups, head dim): recorded, or filled by ``--num-heads`` only where args lack it."""
    heads, groups, dim = d.num_attention_heads, d.num_query_groups, d.kv_channels
    if num_heads is not None and heads is not None and num_heads != heads:
        raise FormatError(f"{where}: --num-heads {num_heads} disagrees with the checkpoint's args "
                          f"num_attention_heads={heads}; drop --num-heads (the checkpoint records it)")
    heads = heads if heads is not None else num_heads
    if heads is None:
        raise FormatError(f"{where}: the checkpoint's args do not record num_attention_heads; pass --num-heads "
                          "(Megatron's --num-attention-heads)")
    qkv = next((s for n, s in shapes.items() if n.endswith("self_attention.linear_qkv.weight")), None)
    proj = next((s for n, s in shapes.items() if n.endswith("self_attention.linear_proj.weight")), None)
    if dim is None and proj is not None and len(proj) == 2 and proj[1] % heads == 0:
        dim = proj[1] // heads
    if groups is None and qkv is not None and dim and qkv[0] % dim == 0 and (qkv[0] // dim - heads) % 2 == 0:
        groups = (qkv[0] // dim - heads) // 2
    if not dim or not groups or groups < 1 or heads % groups or qkv is None or qkv[0] != (heads + 2 * groups) * dim:
        raise FormatError(f"{where}: --num-heads {heads} does not divide linear_qkv "
                          f"{list(qkv) if qkv else 'absent'} into heads, query groups and head dim; pass the run's "
                          "--num-attention-heads")
    return heads, groups, dim


def _qkv_rows(heads: int, groups: int, dim: int) -> tuple[Rows, Rows, Rows]:
    per = heads // groups
    q = tuple((g * (per + 2) * dim, (g * (per + 2) + per) * dim) for g in range(groups))
    k = tuple(((g * (per + 2) + per) * dim, (g * (per + 2) + per + 1) * dim) for g in range(groups))
    v = tuple(((g * (per + 2) + per + 1) * dim, (g * (per + 2) + per + 2) * dim) for g in range(groups))
    return q, k, v


def _split(name: str) -> tuple[int | None, str, str]:
    """(layer, module, kind) of a megatron-core parameter name; layer ``None`` outside the decoder's layers."""
    module, kind = name.rsplit(".", 1)
    parts = module.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["decoder", "layers"] and parts[2].isdigit():
        return int(parts[2]), parts[3], kind
    return None, module, kind


def _whole(shape: tuple[int, ...]) -> Rows:
    return ((0, shape[0] if shape else 1),)


def choose(d: ModelDescription, args: dict[str, Any], shapes: dict[str, tuple[int, ...]], num_heads: int | None,
           dtype: str, where: str) -> Target:
    """The class that computes ``d`` exactly, or a refusal naming the Megatron setting."""
    if d.num_experts and d.position_embedding_type == "learned_absolute":
        refuse_megatron_moe(shapes, where)  # no class at all: the reason, checked against transformers
    for arg, (flag, default) in UNREPRESENTABLE.items():
        value = args.get(arg)
        if value is None or value is False:
            continue
        if default is not None and type(value) in (int, float) and value == default:
            continue
        raise _refuse(where, f"the run sets {flag}={value!r}, which no transformers class computes")
    if d.position_embedding_type not in ("learned_absolute", "rope"):
        raise _refuse(where, f"position embedding type {d.position_embedding_type or 'not recorded'} "
                      "(--position-embedding-type) has no exact transformers class here")
    if d.rotary_percent not in (None, 1.0) and d.position_embedding_type == "rope":
        raise _refuse(where, f"--rotary-percent {d.rotary_percent}: partial rotary has no exact class here")
    heads, groups, dim = _heads(d, shapes, num_heads, where)
    assumed: list[str] = []
    act = d.activation
    if act is None:
        if d.gated_linear_unit:
            raise _refuse(where, "a gated MLP whose activation the args do not record (--swiglu or --quick-geglu)")
        act = "gelu"
        assumed.append("activation: GELU (erf), megatron-core's default: the args record no activation flag")
    eps = d.norm_epsilon
    if eps is None:
        eps = MEGATRON_EPS
        assumed.append(f"norm epsilon {MEGATRON_EPS}, megatron-core's default: the args do not record --norm-epsilon")
    norm = d.normalization or "LayerNorm"
    vocab, hidden, layers = d.vocab_size, d.hidden_size, d.num_layers
    if vocab is None or hidden is None or layers is None or d.ffn_hidden_size is None:
        raise _refuse(where, "the model's vocab, hidden size, layers or FFN size could not be read")
    bias = _any(shapes, "linear_proj.bias")  # the stored tensors (the description checked them against the args)
    qkv_bias = _any(shapes, "linear_qkv.bias")
    tied = not d.untied if d.untied is not None else not _any(shapes, "output_layer.weight")
    common = {"vocab_size": vocab, "num_hidden_layers": layers, "tie_word_embeddings": tied, "dtype": dtype,
              "use_cache": True, "pad_token_id": None}
    q, k, v = _qkv_rows(heads, groups, dim)
    gated = bool(d.gated_linear_unit)
    ffn = d.ffn_hidden_size

    if d.position_embedding_type == "learned_absolute":
        why = [w for w, bad in (("--use-rope-scaling (Llama 3.1 frequency scaling)", bool(d.use_rope_scaling)),
                                ("RMSNorm (--normalization RMSNorm)", norm != "LayerNorm"),
                                ("a model without linear biases (--disable-bias-linear)", not bias),
                                (f"a gated MLP ({'--swiglu' if act == 'silu' else '--quick-geglu'})", gated),
                                ("q/k layernorm (--qk-layernorm)", bool(d.qk_layernorm)),
                                (f"{groups} query groups of {heads} heads (--num-query-groups)", 1 < groups < heads),
                                (f"head dim {dim} != hidden/heads (--kv-channels)", dim * heads != hidden),
                                (f"activation {act}", act not in ACT_BIGCODE))
               if bad]
        if why:
            raise _refuse(where, "learned absolute positions map only onto GPTBigCodeForCausalLM, which cannot "
                          "represent " + why[0])
        pos = shapes.get("embedding.position_embeddings.weight", (args.get("max_position_embeddings") or 0,))
        config = {"architectures": ["GPTBigCodeForCausalLM"], "model_type": "gpt_bigcode", **common,
                  "n_positions": pos[0], "n_embd": hidden, "n_layer": layers, "n_head": heads, "n_inner": ffn,
                  "activation_function": ACT_BIGCODE[act], "multi_query": groups == 1 and heads > 1,
                  "layer_norm_epsilon": eps, "scale_attn_weights": True, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
                  "attn_pdrop": 0.0}
        config.pop("num_hidden_layers")
        return Target("GPTBigCodeForCausalLM", config, _bigcode_names(where), assumed)

    base = d.rotary_base
    if base is None:
        base = MEGATRON_ROPE_BASE
        assumed.append(f"rotary base {MEGATRON_ROPE_BASE}, megatron-core's default: the args do not record "
                       "--rotary-base")
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(base)}
    if d.use_rope_scaling:
        factor = d.rope_scaling_factor
        if factor is None:
            factor = MEGATRON_ROPE_SCALING_FACTOR
            assumed.append(f"RoPE scaling factor {factor}, megatron-core's default: the args record "
                           "--use-rope-scaling without --rope-scaling-factor")
        rope = {"rope_type": "llama3", "rope_theta": float(base), "factor": float(factor), **MEGATRON_LLAMA3}
    seq = args.get("max_position_embeddings") or args.get("seq_length") or 4096
    attn = {"hidden_size": hidden, "intermediate_size": ffn, "num_attention_heads": heads,
            "num_key_value_heads": groups, "max_position_embeddings": seq, "rope_parameters": rope,
            "attention_dropout": 0.0, "hidden_act": ACT_HF.get(act, act)}
    if d.num_experts:
        arch, mtype, config = _moe(d, args, attn, dim, eps, bias, qkv_bias, gated and act == "silu" and
                                   norm == "RMSNorm", _any(shapes, "shared_experts.gate_weight"), heads, hidden, where)
        config = {"architectures": [arch], "model_type": mtype, **common, **config}
        return Target(arch, config, _rope_names(arch, q, k, v, ffn, gated, where, d.moe_ffn_hidden_size,
                                                d.moe_shared_expert_intermediate_size), assumed)
    if norm == "RMSNorm" and gated and act == "silu":
        if d.qk_layernorm:
            if bias or qkv_bias:
                raise _refuse(where, "q/k layernorm with linear biases (--add-bias-linear/--add-qkv-bias): "
                              "Qwen3ForCausalLM has none")
            arch, mtype = "Qwen3ForCausalLM", "qwen3"
            config = {**attn, "head_dim": dim, "rms_norm_eps": eps, "attention_bias": False,
                      "use_sliding_window": False}
        elif qkv_bias and not bias:
            if dim * heads != hidden:
                raise _refuse(where, f"head dim {dim} != hidden/heads (--kv-channels): Qwen2ForCausalLM has none")
            arch, mtype = "Qwen2ForCausalLM", "qwen2"
            config = {**attn, "rms_norm_eps": eps, "use_sliding_window": False}
        else:
            arch, mtype = "LlamaForCausalLM", "llama"
            config = {**attn, "head_dim": dim, "rms_norm_eps": eps, "attention_bias": bias, "mlp_bias": bias}
    elif norm == "RMSNorm" and not gated and not d.qk_layernorm and act in ACT_HF:
        arch, mtype = "ArceeForCausalLM", "arcee"
        config = {**attn, "head_dim": dim, "rms_norm_eps": eps, "attention_bias": bias, "mlp_bias": bias}
        if qkv_bias and not bias:
            raise _refuse(where, "biases on q/k/v only (--add-qkv-bias) with a non-gated MLP: no exact class")
    elif norm == "LayerNorm" and not gated and d.qk_layernorm:
        why = [w for w, bad in ((f"{groups} query groups of {heads} heads (--group-query-attention): it has no "
                                 "num_key_value_heads", groups != heads),
                                ("a model without linear biases (--disable-bias-linear)", not (bias and qkv_bias)),
                                ("q/k layernorm without biases", not _any(shapes, "q_layernorm.bias")),
                                (f"head dim {dim} != hidden/heads (--kv-channels)", dim * heads != hidden),
                                (f"activation {act}", act not in ACT_HF))
               if bad]
        if why:
            raise _refuse(where, "RoPE with LayerNorm q/k layernorm maps only onto PersimmonForCausalLM, which "
                          "cannot represent " + why[0])
        attn.pop("num_key_value_heads")
        config = {"architectures": ["PersimmonForCausalLM"], "model_type": "persimmon", **common, **attn,
                  "rope_parameters": {**rope, "partial_rotary_factor": 1.0}, "partial_rotary_factor": 1.0,
                  "layer_norm_eps": eps, "qk_layernorm": True, "hidden_dropout": 0.0}
        return Target("PersimmonForCausalLM", config, _table_names("PersimmonForCausalLM", "model.layers",
                                                                   PERSIMMON_LAYER, PERSIMMON_GLOBAL, where), assumed)
    elif norm == "LayerNorm" and not gated and not d.qk_layernorm and bias and act in ("gelu", "gelu_tanh"):
        if dim * heads != hidden:
            raise _refuse(where, f"head dim {dim} != hidden/heads (--kv-channels): Starcoder2ForCausalLM has none")
        arch, mtype = "Starcoder2ForCausalLM", "starcoder2"
        config = {**attn, "norm_epsilon": eps, "use_bias": True, "residual_dropout": 0.0, "embedding_dropout": 0.0,
                  "sliding_window": None}
    else:
        what = (f"{norm}, {'gated ' if gated else ''}{act}, {'' if bias else 'no '}linear biases"
                f"{', q/k layernorm' if d.qk_layernorm else ''}")
        raise _refuse(where, f"RoPE with {what} (--normalization, --swiglu, --disable-bias-linear, --qk-layernorm) "
                      "has no exact transformers class here")
    config = {"architectures": [arch], "model_type": mtype, **common, **config}
    return Target(arch, config, _rope_names(arch, q, k, v, ffn, gated, where), assumed)


def _moe(d: ModelDescription, args: dict[str, Any], attn: dict[str, Any], dim: int, eps: float, bias: bool,
         qkv_bias: bool, llama_style: bool, shared_gate: bool, heads: int, hidden: int,
         where: str) -> tuple[str, str, dict[str, Any]]:
    """A megatron-core MoE GPT with SwiGLU experts -> Mixtral, Qwen3-MoE with RMSNorm q/k norms, or Qwen2-MoE
    with a gated shared expert.

    megatron's default router takes the top-k logits and a softmax over them; Mixtral (and Qwen3-MoE
    with ``norm_topk_prob``) take a softmax over all experts, the top k, and divide by their sum:
    the same weights, since a softmax's ratios do not depend on the other terms. With
    ``--moe-router-pre-softmax`` megatron takes the softmax over all experts, then the top k, and does
    not renormalise: Qwen3-MoE with ``norm_topk_prob`` false (no Mixtral form: Mixtral always divides).

    A shared expert (``--moe-shared-expert-intermediate-size``) maps only onto Qwen2-MoE, whose block adds
    ``sigmoid(shared_expert_gate(x)) * shared_expert(x)`` to the routed experts' sum: megatron-core's
    ``SharedExpertMLP`` with ``--moe-shared-expert-gate`` (``gate_weight`` of shape ``(1, hidden)``, the
    same sigmoid on the same input). Qwen2-MoE always gates it, so a shared expert without the gate is
    refused; its q/k/v biases are ``qkv_bias`` (megatron's ``--add-qkv-bias``), no q/k norms.
    """
    shared = d.moe_shared_expert_intermediate_size
    topk = args.get("moe_router_topk") or 2
    pre_softmax = bool(args.get("moe_router_pre_softmax"))
    settings = (
        (not llama_style, "experts that are not SwiGLU with RMSNorm (--swiglu, --normalization RMSNorm)"),
        (bias, "linear biases (--add-bias-linear)"),
        (qkv_bias and not shared, "q/k/v biases (--add-qkv-bias) without a shared expert"),
        (bool(shared) and not shared_gate, "a shared expert without --moe-shared-expert-gate (Qwen2-MoE's shared "
         "expert is always gated)"),
        (bool(shared) and bool(d.qk_layernorm), "a shared expert with q/k layernorm (--qk-layernorm)"),
        (bool(shared) and dim * heads != hidden, f"a shared expert and head dim {dim} != hidden/heads "
         "(--kv-channels): Qwen2-MoE has none"),
        (bool(d.moe_router_enable_expert_bias), "a router expert bias (--moe-router-enable-expert-bias)"),
        (pre_softmax and not d.qk_layernorm and not shared, "--moe-router-pre-softmax (softmax before the top-k, "
         "unnormalised) without q/k layernorm or a gated shared expert (Mixtral always renormalises its top k)"),
        (args.get("moe_router_score_function") not in (None, "softmax"),
         f"--moe-router-score-function {args.get('moe_router_score_function')}"),
        (args.get("moe_layer_freq") not in (None, 1), f"--moe-layer-freq {args.get('moe_layer_freq')} (dense layers "
         "between MoE layers)"),
        (args.get("moe_router_topk_scaling_factor") is not None, "--moe-router-topk-scaling-factor"),
        (args.get("moe_expert_capacity_factor") is not None, "--moe-expert-capacity-factor (dropped tokens)"),
        (bool(args.get("moe_router_num_groups")), "--moe-router-num-groups (group-limited routing)"),
        (d.moe_ffn_hidden_size is None, "an expert FFN size the args do not record (--moe-ffn-hidden-size)"),
    )
    bad = [why for cond, why in settings if cond]
    if bad:
        raise _refuse(where, f"a MoE model with {bad[0]} has no exact transformers class here")
    moe = {**attn, "head_dim": dim, "rms_norm_eps": eps, "intermediate_size": d.moe_ffn_hidden_size,
           "num_experts_per_tok": topk, "output_router_logits": False, "router_aux_loss_coef": 0.0}
    if shared:
        return "Qwen2MoeForCausalLM", "qwen2_moe", {**moe, "num_experts": d.num_experts,
                                                    "norm_topk_prob": not pre_softmax,
                                                    "moe_intermediate_size": d.moe_ffn_hidden_size,
                                                    "shared_expert_intermediate_size": shared,
                                                    "decoder_sparse_step": 1, "mlp_only_layers": [],
                                                    "qkv_bias": qkv_bias, "use_sliding_window": False}
    if d.qk_layernorm:
        return "Qwen3MoeForCausalLM", "qwen3_moe", {**moe, "num_experts": d.num_experts,
                                                    "norm_topk_prob": not pre_softmax,
                                                    "moe_intermediate_size": d.moe_ffn_hidden_size,
                                                    "decoder_sparse_step": 1, "mlp_only_layers": [],
                                                    "attention_bias": False, "use_sliding_window": False}
    return "MixtralForCausalLM", "mixtral", {**moe, "num_local_experts": d.num_experts, "sliding_window": None}


def _any(shapes: dict[str, tuple[int, ...]], suffix: str) -> bool:
    return any(n.endswith(suffix) for n in shapes)


BIGCODE_LAYER = {
    "input_layernorm": "ln_1", "self_attention.linear_qkv": "attn.c_attn", "self_attention.linear_proj": "attn.c_proj",
    "pre_mlp_layernorm": "ln_2", "mlp.linear_fc1": "mlp.c_fc", "mlp.linear_fc2": "mlp.c_proj",
}
BIGCODE_GLOBAL = {
    "embedding.word_embeddings": "transformer.wte", "embedding.position_embeddings": "transformer.wpe",
    "decoder.final_layernorm": "transformer.ln_f", "output_layer": "lm_head",
}
# Transformer Engine's layer spec fuses the norms into the next linear: the same tensors under other names
TE_NORMS = {("self_attention.linear_qkv", "layer_norm_weight"): ("input_layernorm", "weight"),
            ("self_attention.linear_qkv", "layer_norm_bias"): ("input_layernorm", "bias"),
            ("mlp.linear_fc1", "layer_norm_weight"): ("pre_mlp_layernorm", "weight"),
            ("mlp.linear_fc1", "layer_norm_bias"): ("pre_mlp_layernorm", "bias")}


# Persimmon's fused query_key_value is viewed as (heads, 3, head_dim): per head [q_h; k_h; v_h], which is
# megatron-core's linear_qkv for one head per query group (MHA), so it maps whole; its q/k LayerNorms (with
# bias) act on each head's head_dim before RoPE, as megatron-core's q_layernorm/k_layernorm do
PERSIMMON_LAYER = {
    "input_layernorm": "input_layernorm", "self_attention.linear_qkv": "self_attn.query_key_value",
    "self_attention.q_layernorm": "self_attn.q_layernorm", "self_attention.k_layernorm": "self_attn.k_layernorm",
    "self_attention.linear_proj": "self_attn.dense", "pre_mlp_layernorm": "post_attention_layernorm",
    "mlp.linear_fc1": "mlp.dense_h_to_4h", "mlp.linear_fc2": "mlp.dense_4h_to_h",
}
PERSIMMON_GLOBAL = {
    "embedding.word_embeddings": "model.embed_tokens", "decoder.final_layernorm": "model.final_layernorm",
    "output_layer": "lm_head",
}


def _bigcode_names(where: str) -> Callable[[str, tuple[int, ...]], list[tuple[str, Rows]]]:
    return _table_names("GPTBigCodeForCausalLM", "transformer.h", BIGCODE_LAYER, BIGCODE_GLOBAL, where)


def _table_names(arch: str, prefix: str, layer_table: dict[str, str], global_table: dict[str, str], where: str
                 ) -> Callable[[str, tuple[int, ...]], list[tuple[str, Rows]]]:
    """The names of a class whose every tensor is one megatron-core tensor, whole."""
    def names(name: str, shape: tuple[int, ...]) -> list[tuple[str, Rows]]:
        layer, module, kind = _split(name)
        module, kind = TE_NORMS.get((module, kind), (module, kind))
        if layer is None and module in global_table:
            return [(f"{global_table[module]}.{kind}", _whole(shape))]
        if layer is not None and module in layer_table:
            return [(f"{prefix}.{layer}.{layer_table[module]}.{kind}", _whole(shape))]
        raise _refuse(where, f"parameter {name!r} has no {arch} name")

    return names


def _rope_names(arch: str, q: Rows, k: Rows, v: Rows, ffn: int, gated: bool, where: str,
                expert_ffn: int | None = None, shared: int | None = None
                ) -> Callable[[str, tuple[int, ...]], list[tuple[str, Rows]]]:
    star = arch == "Starcoder2ForCausalLM"
    fc1 = ("mlp.c_fc" if star else "mlp.up_proj")
    fc2 = ("mlp.c_proj" if star else "mlp.down_proj")
    globals_ = {"embedding.word_embeddings": "model.embed_tokens", "decoder.final_layernorm": "model.norm",
                "output_layer": "lm_head"}
    layer_map = {"input_layernorm": "input_layernorm", "pre_mlp_layernorm": "post_attention_layernorm",
                 "self_attention.linear_proj": "self_attn.o_proj", "self_attention.q_layernorm": "self_attn.q_norm",
                 "self_attention.k_layernorm": "self_attn.k_norm", "mlp.linear_fc2": fc2}

    def names(name: str, shape: tuple[int, ...]) -> list[tuple[str, Rows]]:
        layer, module, kind = _split(name)
        module, kind = TE_NORMS.get((module, kind), (module, kind))
        if layer is None:
            if module in globals_:
                return [(f"{globals_[module]}.{kind}", _whole(shape))]
            raise _refuse(where, f"parameter {name!r} has no {arch} name")
        at = f"model.layers.{layer}"
        if module == "self_attention.linear_qkv":
            return [(f"{at}.self_attn.{p}_proj.{kind}", rows) for p, rows in (("q", q), ("k", k), ("v", v))]
        if module == "mlp.linear_fc1":
            if gated:
                return [(f"{at}.mlp.gate_proj.{kind}", ((0, ffn),)), (f"{at}.mlp.up_proj.{kind}", ((ffn, 2 * ffn),))]
            return [(f"{at}.{fc1}.{kind}", _whole(shape))]
        if module in layer_map:
            return [(f"{at}.{layer_map[module]}.{kind}", _whole(shape))]
        if expert_ffn is not None:  # Mixtral's per-expert names (transformers fuses them when it loads)
            moe = "block_sparse_moe" if arch == "MixtralForCausalLM" else "mlp"
            w1, w3, w2 = ("w1", "w3", "w2") if arch == "MixtralForCausalLM" else ("gate_proj", "up_proj", "down_proj")
            if module == "mlp.router":
                return [(f"{at}.{moe}.gate.{kind}", _whole(shape))]
            if shared and module == "mlp.shared_experts.linear_fc1":  # Qwen2-MoE's shared expert
                return [(f"{at}.mlp.shared_expert.gate_proj.{kind}", ((0, shared),)),
                        (f"{at}.mlp.shared_expert.up_proj.{kind}", ((shared, 2 * shared),))]
            if shared and module == "mlp.shared_experts.linear_fc2":
                return [(f"{at}.mlp.shared_expert.down_proj.{kind}", _whole(shape))]
            if shared and (module, kind) == ("mlp.shared_experts", "gate_weight"):
                return [(f"{at}.mlp.shared_expert_gate.weight", _whole(shape))]
            parts = module.split(".")
            if len(parts) == 4 and parts[:2] == ["mlp", "experts"] and parts[2].isdigit():
                e, lin = parts[2], parts[3]
                if lin == "linear_fc1":
                    return [(f"{at}.{moe}.experts.{e}.{w1}.{kind}", ((0, expert_ffn),)),
                            (f"{at}.{moe}.experts.{e}.{w3}.{kind}", ((expert_ffn, 2 * expert_ffn),))]
                if lin == "linear_fc2":
                    return [(f"{at}.{moe}.experts.{e}.{w2}.{kind}", _whole(shape))]
        raise _refuse(where, f"parameter {name!r} has no {arch} name")

    return names
