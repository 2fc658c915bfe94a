"""THE table between this runtime's GPT and a transformers architecture, used by export and import alike.

The runtime's GPT (:mod:`gtp_runtime.model`) is, layer for layer, transformers' ``ArceeForCausalLM``
with ``hidden_act="gelu"``: RMSNorm before attention and before the MLP (weight times the fp32
normalised input, eps inside the root), rotate-half RoPE with base 10000 on q and k, causal softmax
attention scaled by ``head_dim**-0.5`` with as many key/value heads as query heads, a *non-gated*
MLP ``down(gelu(up(x)))`` (exact erf GELU on both sides), no bias anywhere, a final RMSNorm and an
untied output layer. Checked by ``tests/cli/test_hf_export.py``: transformers' logits on the
exported folder agree with the project's fp32 reference to 1e-5 (measured: under 1e-6).

The one structural difference is the fused QKV weight: ``linear_qkv`` rows are grouped per head as
``(heads, 3, head_dim)`` (``SelfAttention.forward`` views the output so), so HF's ``q_proj`` is rows
``[h*3*hd, h*3*hd + hd)`` of every head ``h``, ``k_proj`` the next ``hd`` rows, ``v_proj`` the last.
A :class:`Part` records that as row ranges; every other tensor is one range, the whole tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gtp_format.errors import FormatError
from gtp_format.layout.config import ModelConfig

ARCHITECTURE = "ArceeForCausalLM"
MODEL_TYPE = "arcee"
ACTIVATION = "gelu"  # transformers' ACT2FN["gelu"] is torch's exact (erf) GELU, as F.gelu in the runtime
ROPE_THETA = 10000.0  # gtp_runtime.layers.rope's base; the runtime has no flag for another
PARAM_DTYPES = {"torch.float32": "float32", "torch.bfloat16": "bfloat16"}
RUNTIME_EPS = ModelConfig().norm_eps  # the launcher's (it has no --norm-eps flag)
QKV = "self_attention.linear_qkv.weight"

# (runtime suffix, HF suffix, which third of each head's fused rows or None) of one layer, in HF order.
LAYER = (
    ("input_layernorm.weight", "input_layernorm.weight", None),
    (QKV, "self_attn.q_proj.weight", 0),
    (QKV, "self_attn.k_proj.weight", 1),
    (QKV, "self_attn.v_proj.weight", 2),
    ("self_attention.linear_proj.weight", "self_attn.o_proj.weight", None),
    ("pre_mlp_layernorm.weight", "post_attention_layernorm.weight", None),
    ("mlp.linear_fc1.weight", "mlp.up_proj.weight", None),
    ("mlp.linear_fc2.weight", "mlp.down_proj.weight", None),
)
HEAD = (("embedding.word_embeddings.weight", "model.embed_tokens.weight"),)
TAIL = (("decoder.final_layernorm.weight", "model.norm.weight"), ("output_layer.weight", "lm_head.weight"))


@dataclass(frozen=True)
class Part:
    """One HF tensor: rows ``ranges`` (in order) of the runtime parameter ``ours``, all columns."""

    hf: str
    ours: str
    ranges: tuple[tuple[int, int], ...]

    @property
    def rows(self) -> int:
        return sum(b - a for a, b in self.ranges)

    def hf_rows(self, a: int, b: int) -> list[tuple[int, int, int]]:
        """``(ours_start, ours_end, hf_start)`` of each piece of ``ours`` rows ``[a, b)`` this part holds."""
        out, pos = [], 0
        for ra, rb in self.ranges:
            lo, hi = max(a, ra), min(b, rb)
            if lo < hi:
                out.append((lo, hi, pos + lo - ra))
            pos += rb - ra
        return out


# Why MoE checkpoints are refused (checked against transformers 5.24.0: every MoE *ForCausalLM class
# in transformers/models, about sixty, read for its position embedding, norm and expert MLP). None
# computes either MoE GPT here:
# * this runtime's MoE layer: a bias-free router, softmax over the top-k logits, and *non-gated*
#   GELU experts ``fc2(gelu(fc1(x)))``; every transformers MoE class has gated (GLU) experts
#   (``down(act(gate(x)) * up(x))``: Mixtral, Qwen2/3-MoE, OLMoE, GraniteMoE, DBRX, JetMoE, DeepSeek,
#   GPT-OSS...; Doge's "MoE" is a product-key memory beside a gated MLP), and the dense Arcee has
#   no router;
# * megatron-core's local-spec MoE GPT (fixtures/megatron/moe_ep2_dp4_dp_reshardable): learned
#   absolute position embeddings, LayerNorm with bias, a router with a bias, non-gated GELU experts
#   with biases; no transformers MoE class has a learned position table (all use rotary, relative
#   or no positions), and their experts are gated GLUs or, in Ergo and NemotronH (transformers 5.25),
#   non-gated squared ReLUs: ``tests/cli/test_hf_megatron.py`` checks both against the installed
#   transformers, so a new class that could match shows up. GPTBigCode (its dense counterpart) has
#   no experts.
# A mapping onto any of them would load and compute another function, which is worse than a refusal.
MOE_NO_CLASS = ("no transformers architecture computes it (every transformers MoE causal LM has gated GLU experts "
                "or squared-ReLU ones, and rotary or no positions{extra}); export the raw tensors with "
                "--names megatron")


def refuse_unmatched(model: ModelConfig, where: str) -> None:
    if model.num_experts:
        raise FormatError(f"{where}: a MoE model (--num-experts {model.num_experts}, non-gated GELU experts) has no "
                          "Hugging Face export: " + MOE_NO_CLASS.format(extra="; ArceeForCausalLM is dense"))


def refuse_megatron_moe(shapes: dict[str, tuple[int, ...]], where: str) -> None:
    """A megatron-core MoE GPT (router and experts in its module names) is refused, saying why."""
    router = next((n for n in shapes if ".mlp.router." in n), None)
    if router is None and not any(".mlp.experts." in n for n in shapes):
        return
    experts = f"{shapes[router][0]} experts" if router and shapes[router] else "experts"
    raise FormatError(f"{where}: a megatron-core MoE GPT (a router and {experts} per layer, learned absolute "
                      "positions, LayerNorm with bias, non-gated GELU experts with biases) has no Hugging Face "
                      "export: " + MOE_NO_CLASS.format(extra="; GPTBigCode, its dense match, has no experts"))


def parts(model: ModelConfig, where: str = "model") -> list[Part]:
    """Every HF tensor of ``model``, in HF's module order."""
    refuse_unmatched(model, where)
    hd = model.hidden // model.num_heads

    def whole(rows: int) -> tuple[tuple[int, int], ...]:
        return ((0, rows),)

    h, v = model.hidden, model.vocab_size
    rows_of = {"input_layernorm.weight": h, "self_attention.linear_proj.weight": h, "pre_mlp_layernorm.weight": h,
               "mlp.linear_fc1.weight": model.ffn_hidden, "mlp.linear_fc2.weight": h}
    out = [Part(hf, ours, whole(v)) for ours, hf in HEAD]
    for i in range(model.num_layers):
        for ours, hf, third in LAYER:
            ranges = whole(rows_of[ours]) if third is None else tuple(
                (k * 3 * hd + third * hd, k * 3 * hd + (third + 1) * hd) for k in range(model.num_heads))
            out.append(Part(f"model.layers.{i}.{hf}", f"decoder.layers.{i}.{ours}", ranges))
    out += [Part(TAIL[0][1], TAIL[0][0], whole(h)), Part(TAIL[1][1], TAIL[1][0], whole(v))]
    return out


def config_dtype(param_dtype: str, where: str) -> str:
    if param_dtype not in PARAM_DTYPES:
        raise FormatError(f"{where}: parameters are {param_dtype or 'of several dtypes'}; the Hugging Face export "
                          "writes float32 or bfloat16 models (one dtype); export raw tensors with --names megatron")
    return PARAM_DTYPES[param_dtype]


def hf_config(model: ModelConfig, param_dtype: str, eos_token_id: int | None = None,
              where: str = "model") -> dict[str, Any]:
    """``config.json`` of ``ArceeForCausalLM`` for ``model`` (every field the forward reads, set explicitly)."""
    refuse_unmatched(model, where)
    dtype = config_dtype(param_dtype, where)
    return {
        "architectures": [ARCHITECTURE], "model_type": MODEL_TYPE,
        "vocab_size": model.vocab_size, "hidden_size": model.hidden, "intermediate_size": model.ffn_hidden,
        "num_hidden_layers": model.num_layers, "num_attention_heads": model.num_heads,
        "num_key_value_heads": model.num_heads, "head_dim": model.hidden // model.num_heads,
        "hidden_act": ACTIVATION, "max_position_embeddings": model.seq_length, "rms_norm_eps": model.norm_eps,
        "rope_theta": ROPE_THETA, "rope_parameters": {"rope_type": "default", "rope_theta": ROPE_THETA},
        "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0, "tie_word_embeddings": False,
        "initializer_range": 0.02, "use_cache": True, "dtype": dtype,
        "bos_token_id": eos_token_id, "eos_token_id": eos_token_id, "pad_token_id": None,
    }


def generation_config(eos_token_id: int | None) -> dict[str, Any]:
    """What ``GenerationConfig.from_model_config`` would derive: the special token ids."""
    return {"_from_model_config": True, "bos_token_id": eos_token_id, "eos_token_id": eos_token_id}


def _field(cfg: dict[str, Any], name: str, where: str, kind: type = int) -> Any:
    value = cfg.get(name)
    if not isinstance(value, kind) or isinstance(value, bool) or (kind is int and value < 1):
        raise FormatError(f"{where}: config.json field {name!r} is {value!r}, expected a positive "
                          f"{kind.__name__}; not a {ARCHITECTURE} config this tool can import")
    return value


def _rope_theta(cfg: dict[str, Any]) -> Any:
    rope = cfg.get("rope_parameters")
    if isinstance(rope, dict):
        if rope.get("rope_type", "default") != "default":
            return f"rope_type {rope.get('rope_type')!r}"
        return rope.get("rope_theta", cfg.get("rope_theta", ROPE_THETA))
    if cfg.get("rope_scaling") is not None:
        return f"rope_scaling {cfg.get('rope_scaling')!r}"
    return cfg.get("rope_theta", ROPE_THETA)


def model_config(cfg: dict[str, Any], where: str, seq_length: int | None = None) -> ModelConfig:
    """The runtime's :class:`ModelConfig` of an HF ``config.json``; refuses, in one line naming the field,
    whatever the runtime's GPT cannot compute the same way."""
    archs = cfg.get("architectures")
    if cfg.get("model_type") != MODEL_TYPE or (archs is not None and archs != [ARCHITECTURE]):
        raise FormatError(f"{where}: config.json is model_type {cfg.get('model_type')!r} {archs!r}; ckpt import "
                          f"reads {ARCHITECTURE} (model_type {MODEL_TYPE!r}), the architecture of this runtime's GPT")
    hidden, heads = _field(cfg, "hidden_size", where), _field(cfg, "num_attention_heads", where)
    checks = [
        ("hidden_act", cfg.get("hidden_act"), ACTIVATION),
        ("num_key_value_heads", cfg.get("num_key_value_heads", heads), heads),
        ("head_dim", cfg.get("head_dim", hidden // heads), hidden // heads),
        ("rope_theta", _rope_theta(cfg), ROPE_THETA),
        ("attention_bias", cfg.get("attention_bias", False), False),
        ("mlp_bias", cfg.get("mlp_bias", False), False),
        ("tie_word_embeddings", cfg.get("tie_word_embeddings", False), False),
    ]
    for name, have, want in checks:
        if have != want or isinstance(have, bool) != isinstance(want, bool):
            raise FormatError(f"{where}: config.json {name} is {have!r}; the runtime's GPT computes {want!r} "
                              "(no flag changes it), so this model cannot be imported")
    eps = cfg.get("rms_norm_eps", RUNTIME_EPS)
    if eps != RUNTIME_EPS or isinstance(eps, bool):
        # ModelConfig takes any eps, but `python -m gtp_runtime.train` has no flag for it, and --load
        # refuses a checkpoint whose model config differs from the run's.
        raise FormatError(f"{where}: config.json rms_norm_eps is {eps!r}; python -m gtp_runtime.train runs "
                          f"norm_eps {RUNTIME_EPS} (no flag changes it), so the imported model could not be resumed")
    seq = seq_length or _field(cfg, "max_position_embeddings", where)
    return ModelConfig(vocab_size=_field(cfg, "vocab_size", where), hidden=hidden,
                       num_layers=_field(cfg, "num_hidden_layers", where), num_heads=heads,
                       ffn_hidden=_field(cfg, "intermediate_size", where), seq_length=seq, norm_eps=float(eps))
