"""The model a genuine megatron-core GPT checkpoint holds: one typed description, read from its own ``args``.

megatron-core's training loop stores the run's ``argparse.Namespace`` in ``common_state`` (decoded
as inert records by :func:`gtp_format.megatron.topology.common_state`, nothing run). The flags that
change what the stored tensors mean are read from it under Megatron-LM's argument names
(megatron-core 0.19.2 ``megatron/training/arguments.py``): ``num_attention_heads``,
``num_query_groups`` (with ``group_query_attention``), ``kv_channels``, ``swiglu`` /
``squared_relu`` / ``openai_gelu`` / ``quick_geglu``, ``normalization``, ``position_embedding_type``,
``rotary_base``, ``rotary_percent``, ``use_rope_scaling`` / ``rope_scaling_factor`` (Llama 3's frequency
scaling), ``qk_layernorm``, ``add_bias_linear``, ``add_qkv_bias``,
``untie_embeddings_and_output_weights``, ``num_experts``, ``moe_ffn_hidden_size``,
``moe_shared_expert_intermediate_size``, ``moe_router_enable_expert_bias``,
``decoder_first_pipeline_num_layers`` / ``decoder_last_pipeline_num_layers``; and, for the order of the
parameters in the optimizer's buffers (no tensor shape shows it), ``transformer_impl`` and
``moe_grouped_gemm``.

Every recorded field is checked against the stored tensors' **global** shapes (megatron-core's
keys are global, whatever the TP/PP): ``linear_qkv`` holds ``(heads + 2 x groups) x kv_channels``
rows, ``linear_proj`` ``heads x kv_channels`` columns, ``linear_fc1`` ``ffn`` rows (``2 x ffn``
with a gated linear unit: SwiGLU, quick-GeGLU), the stacked keys ``num_layers`` layers, the word
embeddings ``padded_vocab_size`` rows, the experts' keys ``num_experts``. Where they disagree the
checkpoint is refused in one line naming the arg and the tensor (a run that records 4 heads and
stores 8 would be mis-sliced by every consumer). Where ``args`` lack a field (a save made through
the bare API), what the shapes settle unambiguously is inferred, and the description says which
fields were (:attr:`ModelDescription.sources`); what they do not settle (the head count, SiLU vs
GELU behind a gated unit, RoPE vs no positions) stays ``None``.

This is the one place consumers take the model from (``show``, ``inspect``, the per-parameter view).
The work is bounded by the number of keys, never by a declared size: only shapes are compared.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from gtp_format.errors import FormatError
from gtp_format.model import TENSOR, Checkpoint

LAYERS = "decoder.layers."
QKV = "decoder.layers.self_attention.linear_qkv.weight"
QKV_BIAS = "decoder.layers.self_attention.linear_qkv.bias"
PROJ = "decoder.layers.self_attention.linear_proj.weight"
PROJ_BIAS = "decoder.layers.self_attention.linear_proj.bias"
FC1 = "decoder.layers.mlp.linear_fc1.weight"
FC2 = "decoder.layers.mlp.linear_fc2.weight"
Q_NORM = "decoder.layers.self_attention.q_layernorm.weight"
K_NORM = "decoder.layers.self_attention.k_layernorm.weight"
EMB = "embedding.word_embeddings.weight"
POS = "embedding.position_embeddings.weight"
OUT = "output_layer.weight"
FINAL_NORM_BIAS = "decoder.final_layernorm.bias"
EXPERT_FC1 = "decoder.layers.mlp.experts.experts.linear_fc1.weight"
EXPERT_FC2 = "decoder.layers.mlp.experts.experts.linear_fc2.weight"
SHARED_FC1 = "decoder.layers.mlp.shared_experts.linear_fc1.weight"
SHARED_FC2 = "decoder.layers.mlp.shared_experts.linear_fc2.weight"
ROUTER = "decoder.layers.mlp.router.weight"
EXPERT_BIAS = "decoder.layers.mlp.router.expert_bias"

NORMALIZATIONS = ("LayerNorm", "RMSNorm")
POSITIONS = ("learned_absolute", "rope", "yarn", "mrope", "relative", "none")
# activation flag -> (activation, gated linear unit); none set: megatron's default GELU (erf)
ACTIVATIONS = {"swiglu": ("silu", True), "quick_geglu": ("quick_gelu", True), "squared_relu": ("squared_relu", False),
               "openai_gelu": ("gelu_tanh", False)}
MAX_SIZE = 1 << 40

_INTS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
         "padded_vocab_size", "max_position_embeddings", "num_experts", "moe_ffn_hidden_size",
         "moe_shared_expert_intermediate_size", "decoder_first_pipeline_num_layers",
         "decoder_last_pipeline_num_layers", "rotary_base")
_BOOLS = ("group_query_attention", "qk_layernorm", "use_rope_scaling", "add_bias_linear", "add_qkv_bias",
          "untie_embeddings_and_output_weights", "moe_router_enable_expert_bias", "moe_grouped_gemm", *ACTIVATIONS)
_FLOATS = ("rotary_percent", "norm_epsilon")
_POSITIVE = ("rope_scaling_factor",)  # numbers that must be > 0 (a factor of 0 divides by zero)
_STRS = ("normalization", "position_embedding_type", "transformer_impl")
# the Megatron-LM flag that sets each description field (refusals name the flag, not an internal count)
FLAGS = {"num_layers": "--num-layers", "hidden_size": "--hidden-size", "ffn_hidden_size": "--ffn-hidden-size",
         "num_attention_heads": "--num-attention-heads", "num_query_groups": "--num-query-groups",
         "kv_channels": "--kv-channels", "vocab_size": "--padded-vocab-size", "gated_linear_unit": "--swiglu",
         "activation": "--swiglu/--squared-relu/--openai-gelu/--quick-geglu", "normalization": "--normalization",
         "position_embedding_type": "--position-embedding-type", "qk_layernorm": "--qk-layernorm",
         "use_rope_scaling": "--use-rope-scaling", "rope_scaling_factor": "--rope-scaling-factor",
         "add_bias_linear": "--disable-bias-linear", "add_qkv_bias": "--add-qkv-bias",
         "untied": "--untie-embeddings-and-output-weights", "num_experts": "--num-experts",
         "moe_ffn_hidden_size": "--moe-ffn-hidden-size",
         "moe_shared_expert_intermediate_size": "--moe-shared-expert-intermediate-size",
         "moe_router_enable_expert_bias": "--moe-router-enable-expert-bias",
         "moe_grouped_gemm": "--moe-grouped-gemm", "transformer_impl": "--transformer-impl",
         "first_stage_layers": "--decoder-first-pipeline-num-layers",
         "last_stage_layers": "--decoder-last-pipeline-num-layers"}


@dataclass(frozen=True)
class ModelDescription:
    """megatron-core's GPT as the checkpoint holds it; ``None`` where neither args nor shapes say.

    ``sources`` maps each known field to ``"args"`` (recorded by the run) or ``"shapes"`` (inferred
    from the stored tensors, no args field); :attr:`inferred` lists the latter.
    """

    num_layers: int | None = None
    hidden_size: int | None = None
    ffn_hidden_size: int | None = None
    num_attention_heads: int | None = None
    num_query_groups: int | None = None
    kv_channels: int | None = None
    vocab_size: int | None = None
    gated_linear_unit: bool | None = None
    activation: str | None = None  # gelu, gelu_tanh, silu (SwiGLU), quick_gelu (quick-GeGLU), squared_relu
    normalization: str | None = None
    norm_epsilon: float | None = None
    position_embedding_type: str | None = None
    rotary_base: int | None = None
    rotary_percent: float | None = None
    use_rope_scaling: bool | None = None  # Llama 3's RoPE frequency scaling (megatron-core fixes its other constants)
    rope_scaling_factor: float | None = None
    qk_layernorm: bool | None = None
    add_bias_linear: bool | None = None
    add_qkv_bias: bool | None = None
    untied: bool | None = None
    num_experts: int | None = None
    moe_ffn_hidden_size: int | None = None
    moe_shared_expert_intermediate_size: int | None = None
    moe_router_enable_expert_bias: bool | None = None
    first_stage_layers: int | None = None  # --decoder-first-pipeline-num-layers (uneven pipeline stages)
    last_stage_layers: int | None = None
    transformer_impl: str | None = None  # local, transformer_engine, inference_optimized (recorded only)
    moe_grouped_gemm: bool | None = None
    sources: dict[str, str] = field(default_factory=dict)

    @property
    def inferred(self) -> list[str]:
        return [k for k, v in self.sources.items() if v == "shapes"]

    @property
    def grouped_experts(self) -> bool:
        """Whether the experts are Transformer Engine's ``TEGroupedMLP``: megatron-core's TE layer spec builds it
        for ``--moe-grouped-gemm``, its inference spec always; the local spec builds ``SequentialMLP`` whatever
        ``--moe-grouped-gemm`` says (megatron-core 0.19.2 ``moe_module_specs.py``). Its sharded keys are
        SequentialMLP's, but its parameters (``linear_fc1.weight<i>`` for every expert, then ``linear_fc2``)
        sit in the optimizer's buffers in another order."""
        if not self.num_experts:
            return False
        return self.transformer_impl == "inference_optimized" or bool(
            self.moe_grouped_gemm and self.transformer_impl != "local")  # not recorded: Megatron-LM's default, TE

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["inferred"] = self.inferred
        return out

    def describe(self) -> str:
        """One line: the features a Megatron user would name, with the inferred fields marked."""
        def v(name: str, text: str) -> str:
            return text + ("*" if self.sources.get(name) == "shapes" else "")

        parts = []
        if self.num_layers is not None:
            parts.append(v("num_layers", f"{self.num_layers} layers"))
        if self.hidden_size is not None:
            parts.append(v("hidden_size", f"hidden {self.hidden_size}"))
        if self.num_attention_heads is not None:
            groups = self.num_query_groups
            kind = "MHA" if groups == self.num_attention_heads else "MQA" if groups == 1 else "GQA" if groups else ""
            parts.append(v("num_attention_heads", f"{self.num_attention_heads} heads")
                         + (f" / {groups} groups ({kind})" if groups else ""))
        if self.kv_channels is not None:
            parts.append(v("kv_channels", f"head dim {self.kv_channels}"))
        if self.ffn_hidden_size is not None:
            parts.append(v("ffn_hidden_size", f"ffn {self.ffn_hidden_size}"))
        act = {"silu": "SwiGLU", "quick_gelu": "quick-GeGLU", "gelu": "GELU", "gelu_tanh": "GELU (tanh)",
               "squared_relu": "squared ReLU"}.get(self.activation or "")
        if act:
            parts.append(v("activation", act))
        elif self.gated_linear_unit:
            parts.append(v("gated_linear_unit", "gated linear unit (activation not recorded)"))
        if self.normalization:
            parts.append(v("normalization", self.normalization))
        if self.position_embedding_type:
            pos = {"learned_absolute": "learned positions", "rope": "RoPE", "none": "no positions"}.get(
                self.position_embedding_type, self.position_embedding_type)
            parts.append(v("position_embedding_type", pos))
        if self.use_rope_scaling and self.position_embedding_type == "rope":
            parts.append(f"Llama 3 RoPE scaling x{self.rope_scaling_factor if self.rope_scaling_factor else 8.0:g}")
        if self.qk_layernorm:
            parts.append(v("qk_layernorm", "q/k layernorm"))
        if self.add_bias_linear is False:
            parts.append(v("add_bias_linear", "no linear bias"))
        if self.untied is not None:
            parts.append(v("untied", "untied output" if self.untied else "tied output"))
        if self.vocab_size is not None:
            parts.append(v("vocab_size", f"vocab {self.vocab_size}"))
        if self.num_experts:
            parts.append(v("num_experts", f"{self.num_experts} experts"))
            if self.moe_shared_expert_intermediate_size:
                parts.append(v("moe_shared_expert_intermediate_size",
                               f"shared experts {self.moe_shared_expert_intermediate_size}"))
            if self.moe_router_enable_expert_bias:
                parts.append(v("moe_router_enable_expert_bias", "router expert bias"))
            if self.grouped_experts:
                parts.append("grouped-GEMM experts (Transformer Engine)")
        if self.first_stage_layers is not None or self.last_stage_layers is not None:
            parts.append(f"pipeline first/last stage layers {self.first_stage_layers}/{self.last_stage_layers}")
        text = ", ".join(parts) or "unknown"
        return text + (" (* inferred from shapes: no args field)" if self.inferred else "")


def recorded_args(ckpt: Checkpoint) -> dict[str, Any]:
    """``common_state``'s ``args`` fields (inert records), ``{}`` when there are none."""
    from gtp_format.megatron.topology import common_state
    from gtp_format.reader.inert_object import InertObject

    state = common_state(ckpt)
    args = state.get("args") if state else None
    if isinstance(args, InertObject):
        fields = args.fields()
    elif isinstance(args, dict):
        fields = args
    else:
        return {}
    return {k: v for k, v in fields.items() if isinstance(k, str)}


def _typed(ckpt: Checkpoint, raw: dict[str, Any]) -> dict[str, Any]:
    """The model fields of ``raw`` with their types checked; ``None`` values dropped (Megatron's unset)."""
    out: dict[str, Any] = {}
    for name, value in raw.items():
        if value is None:
            continue
        if name in _INTS:
            if type(value) is not int or not 0 < value <= MAX_SIZE:
                raise _lie(ckpt, f"args {name}={value!r} is not a positive integer")
        elif name in _BOOLS:
            if type(value) is not bool:
                raise _lie(ckpt, f"args {name}={value!r} is not a bool")
        elif name in _FLOATS:
            if type(value) not in (int, float) or not 0 <= value <= MAX_SIZE:
                raise _lie(ckpt, f"args {name}={value!r} is not a non-negative number")
        elif name in _POSITIVE:
            if type(value) not in (int, float) or not 0 < value <= MAX_SIZE:
                raise _lie(ckpt, f"args {name}={value!r} is not a positive number")
        elif name in _STRS:
            if type(value) is not str:
                raise _lie(ckpt, f"args {name}={value!r} is not a string")
        else:
            continue
        out[name] = value
    return out


def _lie(ckpt: Checkpoint, why: str) -> FormatError:
    return FormatError(f"{ckpt.root}: common_state {why}; the checkpoint's args and its tensors must describe one "
                       "model (fix or drop the arg: `ckpt show CKPT common_state/shard_0_1` prints them)")


def _shape(ckpt: Checkpoint, key: str) -> tuple[int, ...] | None:
    e = ckpt.entries.get(key)
    return tuple(e.shape) if e is not None and e.kind == TENSOR and e.shape is not None else None


def describe_model(ckpt: Checkpoint) -> ModelDescription:
    """The checkpoint's model: its args checked against its tensors' shapes (module docstring).

    ``FormatError`` (one line naming the arg and the tensor) where they disagree or an arg is not a
    value megatron-core knows.
    """
    a = _typed(ckpt, recorded_args(ckpt))
    d: dict[str, Any] = {}
    src: dict[str, str] = {}

    def put(name: str, value: Any, where: str) -> None:
        if value is not None:
            d[name], src[name] = value, where

    for name in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "kv_channels",
                 "num_experts", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size", "rotary_base",
                 "rotary_percent", "use_rope_scaling", "rope_scaling_factor", "norm_epsilon", "qk_layernorm",
                 "add_bias_linear", "add_qkv_bias",
                 "moe_router_enable_expert_bias", "transformer_impl", "moe_grouped_gemm"):
        put(name, a.get(name), "args")
    put("vocab_size", a.get("padded_vocab_size"), "args")
    put("untied", a.get("untie_embeddings_and_output_weights"), "args")
    put("first_stage_layers", a.get("decoder_first_pipeline_num_layers"), "args")
    put("last_stage_layers", a.get("decoder_last_pipeline_num_layers"), "args")
    if a.get("num_query_groups") is not None and a.get("group_query_attention") is not False:
        put("num_query_groups", a["num_query_groups"], "args")
    elif a.get("group_query_attention") is False and "num_attention_heads" in d:
        put("num_query_groups", d["num_attention_heads"], "args")  # without --group-query-attention: MHA
    for name, allowed in (("normalization", NORMALIZATIONS), ("position_embedding_type", POSITIONS)):
        if name in a:
            if a[name] not in allowed:
                raise _lie(ckpt, f"args {name}={a[name]!r} is not one megatron-core knows ({', '.join(allowed)})")
            put(name, a[name], "args")
    on = [f for f in ACTIVATIONS if a.get(f)]
    if len(on) > 1:
        raise _lie(ckpt, f"args set {' and '.join(on)}: two activations for one MLP ({FC1})")
    if on:
        put("activation", ACTIVATIONS[on[0]][0], "args")
        put("gated_linear_unit", ACTIVATIONS[on[0]][1], "args")
    elif any(f in a for f in ACTIVATIONS):  # flags recorded, all off: megatron's default GELU
        put("activation", "gelu", "args")
        put("gated_linear_unit", False, "args")
    _check_and_infer(ckpt, d, src, put)
    return ModelDescription(**d, sources=src)


def _check_and_infer(ckpt: Checkpoint, d: dict[str, Any], src: dict[str, str], put: Any) -> None:
    def arg(name: str) -> str:
        return f"args {_ARG_NAME.get(name, name)}={d[name]}"

    def lie(why: str) -> FormatError:
        return _lie(ckpt, why)

    emb = _shape(ckpt, EMB)
    if emb is not None and len(emb) == 2:
        for name, got in (("vocab_size", emb[0]), ("hidden_size", emb[1])):
            if name in d and d[name] != got:
                raise lie(f"{arg(name)} disagrees with {EMB}, global shape {list(emb)}")
            put(name, d.get(name, got), src.get(name, "shapes"))
    stacked = {k: e.shape[0] for k, e in ckpt.entries.items() if e.kind == TENSOR and k.startswith(LAYERS)
               and e.shape}
    if stacked:
        key, stored = max(stacked.items(), key=lambda kv: kv[1])
        if "num_layers" in d and d["num_layers"] != stored:
            raise lie(f"{arg('num_layers')} but {key} stores {stored} layers")
        put("num_layers", d.get("num_layers", stored), src.get("num_layers", "shapes"))
    first, last, layers = d.get("first_stage_layers"), d.get("last_stage_layers"), d.get("num_layers")
    for name, value in (("first_stage_layers", first), ("last_stage_layers", last)):
        if value is not None and layers is not None and value > layers:
            raise lie(f"{arg(name)} exceeds the {layers} layers the stacked keys store")
    if first is not None and last is not None and layers is not None and first + last > layers:
        raise lie(f"{arg('first_stage_layers')} and {arg('last_stage_layers')} exceed the {layers} layers stored")
    hidden = d.get("hidden_size")
    qkv, proj = _shape(ckpt, QKV), _shape(ckpt, PROJ)
    heads, groups, kv = d.get("num_attention_heads"), d.get("num_query_groups"), d.get("kv_channels")
    if heads is not None and kv is None and hidden is not None:
        if hidden % heads:
            raise lie(f"{arg('num_attention_heads')} does not divide hidden_size={hidden} (and no kv_channels "
                      f"recorded), so {QKV} has no head dim")
        put("kv_channels", hidden // heads, "args")
        kv = hidden // heads
    if heads is not None and groups is not None and (groups > heads or heads % groups):
        raise lie(f"{arg('num_query_groups')} does not divide num_attention_heads={heads} ({QKV})")
    q_norm = _shape(ckpt, Q_NORM)
    if q_norm is not None and len(q_norm) == 2:
        if kv is not None and q_norm[1] != kv:
            raise lie(f"args kv_channels={kv} disagrees with {Q_NORM}, global shape {list(q_norm)}")
        if kv is None:
            put("kv_channels", q_norm[1], "shapes")
            kv = q_norm[1]
    if proj is not None and len(proj) == 3:
        if hidden is not None and proj[1] != hidden:
            raise lie(f"args hidden_size={hidden} disagrees with {PROJ}, global shape {list(proj)}")
        if heads is not None and kv is not None and heads * kv != proj[2]:
            raise lie(f"args num_attention_heads={heads} x kv_channels={kv} = {heads * kv} disagrees with {PROJ}, "
                      f"global shape {list(proj)}")
        if heads is None and kv is not None and proj[2] % kv == 0:
            heads = proj[2] // kv
            put("num_attention_heads", heads, "shapes")
    if qkv is not None and len(qkv) == 3:
        if heads is not None and kv is not None:
            if groups is None:
                rest = qkv[1] - heads * kv
                if rest <= 0 or rest % (2 * kv) or heads % (rest // (2 * kv)):
                    raise lie(f"args num_attention_heads={heads}, kv_channels={kv} leave no whole query-group "
                              f"count for {QKV}, global shape {list(qkv)}")
                groups = rest // (2 * kv)
                put("num_query_groups", groups, "shapes")
            elif (heads + 2 * groups) * kv != qkv[1]:
                raise lie(f"args num_query_groups={groups} (num_attention_heads={heads}, kv_channels={kv}) gives "
                          f"{(heads + 2 * groups) * kv} rows of {QKV}, which stores {qkv[1]} (global shape "
                          f"{list(qkv)})")
    gated = d.get("gated_linear_unit")
    mult = 2 if gated else 1
    for fc1_key, fc2_key, size_name, lead in ((FC1, FC2, "ffn_hidden_size", 1), (SHARED_FC1, SHARED_FC2,
                                              "moe_shared_expert_intermediate_size", 1),
                                              (EXPERT_FC1, EXPERT_FC2, "moe_ffn_hidden_size", 2)):
        fc1, fc2 = _shape(ckpt, fc1_key), _shape(ckpt, fc2_key)
        if fc1 is None or fc2 is None or len(fc1) != lead + 2 or len(fc2) != lead + 2:
            if size_name == "moe_shared_expert_intermediate_size" and d.get(size_name) and stacked:
                raise lie(f"{arg(size_name)} but the checkpoint has no {fc1_key}")
            continue
        ffn = fc2[lead + 1]
        if size_name in d and d[size_name] != ffn:
            raise lie(f"{arg(size_name)} disagrees with {fc2_key}, global shape {list(fc2)}")
        put(size_name, d.get(size_name, ffn), src.get(size_name, "shapes"))
        if gated is None:
            if fc1[lead] not in (ffn, 2 * ffn):
                raise lie(f"args record no activation, and {fc1_key} (global shape {list(fc1)}) holds neither "
                          f"{ffn} nor 2 x {ffn} rows for {fc2_key}'s {ffn} columns")
            gated = fc1[lead] == 2 * ffn
            mult = 2 if gated else 1
            put("gated_linear_unit", gated, "shapes")
        elif fc1[lead] != mult * ffn:
            if src.get("gated_linear_unit") == "args":
                why = "args swiglu/quick_geglu=True (--swiglu)" if gated else "args swiglu=False (no --swiglu)"
            else:
                why = f"the dense {FC1} ({'gated' if gated else 'not gated'})"
            raise lie(f"{why} with {size_name}={ffn} needs {mult * ffn} rows of {fc1_key}, which stores {fc1[lead]} "
                      f"(global shape {list(fc1)})")
    experts = _shape(ckpt, EXPERT_FC1) or _shape(ckpt, ROUTER)
    if experts is not None and len(experts) >= 2:
        n = experts[1]
        if "num_experts" in d and d["num_experts"] != n:
            raise lie(f"{arg('num_experts')} disagrees with {EXPERT_FC1 if _shape(ckpt, EXPERT_FC1) else ROUTER}, "
                      f"global shape {list(experts)}")
        put("num_experts", d.get("num_experts", n), src.get("num_experts", "shapes"))
    elif d.get("num_experts") and stacked:
        raise lie(f"{arg('num_experts')} but the checkpoint has no {ROUTER}")
    has_bias = _shape(ckpt, EXPERT_BIAS) is not None
    if d.get("moe_router_enable_expert_bias") not in (None, has_bias):
        raise lie(f"{arg('moe_router_enable_expert_bias')} but {EXPERT_BIAS} is "
                  f"{'stored' if has_bias else 'not stored'}")
    if d.get("num_experts") and "moe_router_enable_expert_bias" not in d:
        put("moe_router_enable_expert_bias", has_bias, "shapes")
    has_qk = q_norm is not None or _shape(ckpt, K_NORM) is not None
    if d.get("qk_layernorm") not in (None, has_qk) and stacked:
        raise lie(f"{arg('qk_layernorm')} but {Q_NORM} is {'stored' if has_qk else 'not stored'}")
    if stacked and "qk_layernorm" not in d:
        put("qk_layernorm", has_qk, "shapes")
    has_pos = _shape(ckpt, POS) is not None
    pos = d.get("position_embedding_type")
    if pos is not None and emb is not None and (pos == "learned_absolute") != has_pos:
        raise lie(f"args position_embedding_type={pos!r} but {POS} is {'stored' if has_pos else 'not stored'}")
    if pos is None and has_pos:
        put("position_embedding_type", "learned_absolute", "shapes")
    final_bias = _shape(ckpt, FINAL_NORM_BIAS) is not None
    norm = d.get("normalization")
    if norm is not None and _shape(ckpt, "decoder.final_layernorm.weight") is not None \
            and (norm == "LayerNorm") != final_bias:
        raise lie(f"args normalization={norm!r} but {FINAL_NORM_BIAS} is {'stored' if final_bias else 'not stored'} "
                  "(megatron-core's LayerNorm has a bias, RMSNorm none)")
    if norm is None and _shape(ckpt, "decoder.final_layernorm.weight") is not None:
        put("normalization", "LayerNorm" if final_bias else "RMSNorm", "shapes")
    has_proj_bias = _shape(ckpt, PROJ_BIAS) is not None
    if d.get("add_bias_linear") not in (None, has_proj_bias) and proj is not None:
        raise lie(f"{arg('add_bias_linear')} but {PROJ_BIAS} is {'stored' if has_proj_bias else 'not stored'}")
    if "add_bias_linear" not in d and proj is not None:
        put("add_bias_linear", has_proj_bias, "shapes")
    has_out = _shape(ckpt, OUT) is not None
    if d.get("untied") is False and has_out:
        raise lie(f"args untie_embeddings_and_output_weights=False but {OUT} is stored (a tied output has no key)")
    if d.get("untied") and not has_out and emb is not None:
        raise lie(f"args untie_embeddings_and_output_weights=True but {OUT} is not stored")
    if "untied" not in d and emb is not None:
        put("untied", has_out, "shapes")


_ARG_NAME = {"vocab_size": "padded_vocab_size", "untied": "untie_embeddings_and_output_weights",
             "first_stage_layers": "decoder_first_pipeline_num_layers",
             "last_stage_layers": "decoder_last_pipeline_num_layers"}
