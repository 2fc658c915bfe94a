"""A transformers folder read as megatron-core's GPT: the inverse of :mod:`.megatron_arch`.

``config.json`` of ``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``,
``ArceeForCausalLM``, ``Starcoder2ForCausalLM``, ``PersimmonForCausalLM`` or ``GPTBigCodeForCausalLM`` (and the
MoE classes) is read into the Megatron-LM
arguments a run of that model records (:func:`megatron_args`), and those into the one model description
(:class:`gtp_format.megatron.args.ModelDescription`). The description then goes through the export's own
choice (:func:`.megatron_arch.choose`): the class it picks and every forward-changing key of the
``config.json`` it would write must be the folder's own, else the folder is refused naming the key, so what is
imported exports back to the same model (``MistralForCausalLM`` without a sliding window computes what
``LlamaForCausalLM`` computes, with the same tensor names: it exports back as Llama, tensors bit-identical,
:data:`EXPORTS_AS`). The
export's name table (``Target.names``: megatron-core parameter -> HF tensors and the rows they
fill) is then walked the other way: each megatron-core parameter is the concatenation of its HF
tensors' rows (``linear_qkv``: per query group the group's query heads, one key head, one value
head; ``linear_fc1`` gated: gate rows then up rows). Every HF tensor must be used exactly once at
the shape that table implies, or the folder is refused naming the tensor and the config.

The config's sizes are checked against the stored tensors before any per-layer or per-group table
is built, so a config that claims 10^9 layers or heads costs nothing the folder does not back.
No torch: tensors are read as numpy memory maps (or ranged reads from a bucket), a row block at a time.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ckpt_tool.hf import megatron_arch
from ckpt_tool.hf.folder import Tensor, read_folder, read_set
from ckpt_tool.hf.megatron_run_state import MegatronRunState
from ckpt_tool.hf.megatron_run_state import parse as parse_run_state
from gtp_format.dtypes import DType
from gtp_format.errors import FormatError
from gtp_format.megatron.args import ACTIVATIONS, ModelDescription
from gtp_format.names import STATES
from gtp_format.scan import carrier
from gtp_format.storage.location import ObjectURL

CLASSES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "ArceeForCausalLM",
           "Starcoder2ForCausalLM", "MixtralForCausalLM", "Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM",
           "PersimmonForCausalLM", "GPTBigCodeForCausalLM")
# what each RoPE class's forward fixes (everything else is read from its config.json)
NON_GATED = ("ArceeForCausalLM", "Starcoder2ForCausalLM", "PersimmonForCausalLM")  # up/down, no gate
LAYERNORM = ("Starcoder2ForCausalLM", "PersimmonForCausalLM")
# one fused tensor per megatron-core tensor of a layer (no q/k/v split): GPT-BigCode's c_attn, Persimmon's
# per-head [q; k; v] query_key_value (MHA only: it has no num_key_value_heads)
FUSED_QKV = ("GPTBigCodeForCausalLM", "PersimmonForCausalLM")
QK_NORM = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
HEAD_DIM = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen3ForCausalLM", "ArceeForCausalLM", "MixtralForCausalLM",
            "Qwen3MoeForCausalLM")  # a head_dim key (else hidden / heads)
# MoE classes: every layer's MLP is SwiGLU experts behind a softmax top-k router (megatron-core's
# SequentialMLP); config key of (experts, the expert FFN size)
MOE = {"MixtralForCausalLM": ("num_local_experts", "intermediate_size"),
       "Qwen3MoeForCausalLM": ("num_experts", "moe_intermediate_size"),
       "Qwen2MoeForCausalLM": ("num_experts", "moe_intermediate_size")}  # and a gated shared expert
# stacked megatron-core key of each expert parameter (axes: layer, expert, then the parameter's own)
EXPERT_KEY = "decoder.layers.mlp.experts.experts."
PARAM_DTYPES = ("float32", "bfloat16")
# a class whose megatron-core form exports as another class with the same forward and tensor names
EXPORTS_AS = {"MistralForCausalLM": "LlamaForCausalLM"}
# per class: config key -> transformers' default (configs written by older transformers omit defaults)
DEFAULTS: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": {"rms_norm_eps": 1e-6, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
                         "tie_word_embeddings": False, "max_position_embeddings": 2048},
    # Mistral's attention and MLP have no biases whatever a config says (no attention_bias key of its own)
    "MistralForCausalLM": {"rms_norm_eps": 1e-6, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
                           "tie_word_embeddings": False, "max_position_embeddings": 131072, "sliding_window": 4096},
    "Qwen2ForCausalLM": {"rms_norm_eps": 1e-6, "hidden_act": "silu", "tie_word_embeddings": False,
                         "max_position_embeddings": 32768, "use_sliding_window": False},
    "Qwen3ForCausalLM": {"rms_norm_eps": 1e-6, "hidden_act": "silu", "attention_bias": False, "head_dim": 128,
                         "tie_word_embeddings": False, "max_position_embeddings": 32768, "use_sliding_window": False},
    "MixtralForCausalLM": {"rms_norm_eps": 1e-5, "hidden_act": "silu", "tie_word_embeddings": False,
                           "max_position_embeddings": 131072, "num_experts_per_tok": 2, "num_local_experts": 8,
                           "intermediate_size": 14336},
    "Qwen3MoeForCausalLM": {"rms_norm_eps": 1e-6, "hidden_act": "silu", "attention_bias": False,
                            "tie_word_embeddings": False, "max_position_embeddings": 32768,
                            "use_sliding_window": False, "num_experts_per_tok": 8, "num_experts": 128,
                            "moe_intermediate_size": 768, "norm_topk_prob": False, "decoder_sparse_step": 1,
                            "mlp_only_layers": []},
    "Qwen2MoeForCausalLM": {"rms_norm_eps": 1e-6, "hidden_act": "silu", "tie_word_embeddings": False,
                            "max_position_embeddings": 32768, "use_sliding_window": False, "num_experts_per_tok": 4,
                            "num_experts": 60, "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
                            "norm_topk_prob": False, "decoder_sparse_step": 1, "mlp_only_layers": [],
                            "qkv_bias": True},
    "ArceeForCausalLM": {"rms_norm_eps": 1e-5, "hidden_act": "relu2", "attention_bias": False, "mlp_bias": False,
                         "tie_word_embeddings": False, "max_position_embeddings": 4096},
    "Starcoder2ForCausalLM": {"norm_epsilon": 1e-5, "hidden_act": "gelu_pytorch_tanh", "use_bias": True,
                              "tie_word_embeddings": True, "max_position_embeddings": 4096},
    "PersimmonForCausalLM": {"layer_norm_eps": 1e-5, "hidden_act": "relu2", "qk_layernorm": True,
                             "tie_word_embeddings": False, "max_position_embeddings": 16384,
                             "partial_rotary_factor": 0.5},
    "GPTBigCodeForCausalLM": {"activation_function": "gelu_pytorch_tanh", "layer_norm_epsilon": 1e-5,
                              "multi_query": True, "n_inner": None, "tie_word_embeddings": True,
                              "scale_attn_weights": True, "n_positions": 1024},
}
# a non-gated MLP's transformers activation -> the Megatron-LM flag that selects it (None: the default GELU);
# the inverse of the export's table (megatron_arch.ACT_HF) over gtp_format.megatron.args.ACTIVATIONS
ACT_FLAGS: dict[str, str | None] = {
    megatron_arch.ACT_HF["gelu"]: None,
    **{megatron_arch.ACT_HF[act]: flag for flag, (act, glu) in ACTIVATIONS.items()
       if not glu and act in megatron_arch.ACT_HF}}
# keys of the exported config.json that do not change the forward (or are the tensors' own shapes)
NOT_FORWARD = {"architectures", "model_type", "dtype", "use_cache", "pad_token_id", "bos_token_id", "eos_token_id",
               "max_position_embeddings", "n_positions", "attention_dropout", "resid_pdrop", "embd_pdrop",
               "attn_pdrop", "use_sliding_window", "residual_dropout", "embedding_dropout", "output_router_logits",
               "router_aux_loss_coef", "router_jitter_noise", "hidden_dropout"}


@dataclass(frozen=True)
class Segment:
    tensor: Tensor
    first: int  # first row of the HF tensor
    rows: int


@dataclass(frozen=True)
class MegatronParam:
    """One megatron-core parameter of one layer (or a global one) and the HF rows it is made of."""

    key: str  # the checkpoint key: stacked over layers for ``decoder.layers.*`` (and experts, for an expert's)
    layer: int | None
    shape: tuple[int, ...]  # this layer's full tensor
    segments: tuple[Segment, ...]  # in megatron's row order
    expert: int | None = None  # the global expert index (MoE), along the stacked key's second axis
    states: tuple[tuple[Segment, ...], ...] = ()  # carried optimizer state (STATES order), fp32, same rows

    @property
    def lead(self) -> tuple[int, ...]:
        """The stacked key's leading indices: (), (layer,) or (layer, expert)."""
        return () if self.layer is None else (self.layer,) if self.expert is None else (self.layer, self.expert)

    def read_rows(self, a: int, b: int, state: int | None = None) -> np.ndarray:
        """Rows ``[a, b)`` of the parameter, stored bits, assembled from its HF tensors (``state``: of its
        carried optimizer state ``STATES[state]`` instead)."""
        segments = self.segments if state is None else self.states[state]
        pos = 0
        for s in segments:  # rows of one HF tensor: its read as it is (read-only), not copied into a new array
            if pos <= a and b <= pos + s.rows:
                rows = s.tensor.read_rows(s.first + a - pos, s.first + b - pos)
                return rows.reshape((b - a, *self.shape[1:]))
            pos += s.rows
        out = np.empty((b - a, *self.shape[1:]), dtype=carrier(segments[0].tensor.dtype))
        self.read_rows_into(a, b, out, state)
        return out

    def rows_dtype(self, state: int | None = None) -> np.dtype:
        """The carrier dtype of what :meth:`read_rows` gives for ``state``."""
        return carrier((self.segments if state is None else self.states[state])[0].tensor.dtype)

    def will_need(self, a: int, b: int, state: int | None = None) -> None:
        """Rows ``[a, b)`` asked of the kernel ahead of :meth:`read_rows` (:meth:`.folder.Tensor.will_need`)."""
        pos = 0
        for s in self.segments if state is None else self.states[state]:
            lo, hi = max(a, pos), min(b, pos + s.rows)
            if lo < hi:
                s.tensor.will_need(s.first + lo - pos, s.first + hi - pos)
            pos += s.rows

    def read_rows_into(self, a: int, b: int, out: np.ndarray, state: int | None = None) -> None:
        """:meth:`read_rows` into ``out`` (C-contiguous, ``(b - a, *shape[1:])`` of :meth:`rows_dtype`): each HF
        tensor's rows read straight into their place (:meth:`.folder.Tensor.read_rows_into`), no buffer of their
        own."""
        pos = 0
        for s in self.segments if state is None else self.states[state]:
            lo, hi = max(a, pos), min(b, pos + s.rows)
            if lo < hi:
                s.tensor.read_rows_into(s.first + lo - pos, s.first + hi - pos, out[lo - a:hi - a])
            pos += s.rows


@dataclass(frozen=True)
class HFMegatron:
    root: Path | ObjectURL
    architecture: str
    args: dict[str, Any]  # what a Megatron-LM run of this model records in common_state (model part)
    dtype: DType
    params: tuple[MegatronParam, ...]  # in module order, layer by layer
    run_state: MegatronRunState | None = None  # set where the optimizer state is carried (the params' states)

    @property
    def num_layers(self) -> int:
        return int(self.args["num_layers"])

    @property
    def num_experts(self) -> int:
        return int(self.args.get("num_experts") or 0)


def _int(cfg: dict[str, Any], key: str, where: str, default: Any = None) -> int:
    v = cfg.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise FormatError(f"{where}: {key} is {v!r}, not a positive integer; fix config.json")
    return v


def _get(cfg: dict[str, Any], arch: str, key: str) -> Any:
    return cfg.get(key, DEFAULTS[arch].get(key))




def _number(v: Any) -> bool:
    return not isinstance(v, bool) and isinstance(v, (int, float)) and v == v and abs(v) != float("inf")


def rope_parameters(cfg: dict[str, Any], arch: str, where: str, factor_default: float = 1.0) -> dict[str, Any]:
    """The RoPE the folder's class computes, read as transformers 5 reads it: ``rope_scaling`` (older configs)
    over ``rope_parameters``, ``rope_theta`` there or at the top, and for ``llama3`` the top-level
    ``original_max_position_embeddings`` over the one in the parameters (else ``max_position_embeddings``).

    Plain RoPE (``{rope_type: default, rope_theta}``), or, on a RoPE class
    (:data:`.megatron_arch.ROPE_SCALING_CLASSES`), Llama 3's scaling with the constants megatron-core fixes
    (:data:`.megatron_arch.MEGATRON_LLAMA3`): ``--use-rope-scaling`` with ``--rope-scaling-factor`` = ``factor``.
    Any other type (yarn, linear, dynamic, longrope, ...) or a llama3 constant megatron-core does not compute is
    refused naming the field and its value."""
    params, scaling = cfg.get("rope_parameters"), cfg.get("rope_scaling")
    for what, p in (("rope_parameters", params), ("rope_scaling", scaling)):
        if p is not None and not isinstance(p, dict):
            raise FormatError(f"{where}: {what} is {p!r}, not an object; fix config.json")
    what, p = ("rope_scaling", scaling) if scaling else ("rope_parameters", params or {})
    kind = p.get("rope_type", p.get("type", "default"))
    if kind not in ("default", "llama3"):
        raise FormatError(f"{where}: {what}.rope_type {kind!r}: this RoPE scaling has no megatron-core GPT form "
                          "(plain RoPE, or Llama 3's 'llama3' as --use-rope-scaling, only)")
    if kind == "llama3" and arch not in megatron_arch.ROPE_SCALING_CLASSES:
        raise FormatError(f"{where}: {what}.rope_type 'llama3' on {arch}: megatron-core's --use-rope-scaling maps "
                          f"onto {', '.join(megatron_arch.ROPE_SCALING_CLASSES)} only here")
    theta = p.get("rope_theta", cfg.get("rope_theta", 10000.0))
    if not _number(theta) or not theta > 0:
        raise FormatError(f"{where}: rope_theta is {theta!r}, not a positive number; fix config.json")
    if float(theta) != int(theta):
        raise FormatError(f"{where}: rope_theta {theta} is not a whole number, as Megatron's --rotary-base is")
    factor = p.get("partial_rotary_factor", cfg.get("partial_rotary_factor", factor_default))
    if factor != 1.0:
        raise FormatError(f"{where}: partial_rotary_factor {factor!r}: partial rotary has no exact megatron-core "
                          "form here")
    out: dict[str, Any] = {"rope_type": kind, "rope_theta": float(theta)}
    if kind == "default":
        return out
    scale = p.get("factor")
    if not _number(scale) or not scale > 0:
        raise FormatError(f"{where}: {what}.factor is {scale!r}, not a positive number (--rope-scaling-factor); "
                          "fix config.json")
    out["factor"] = float(scale)
    for key, want in megatron_arch.MEGATRON_LLAMA3.items():
        name, got = f"{what}.{key}", p.get(key)
        if key == "original_max_position_embeddings":
            if key in cfg:  # transformers gives the top-level key priority
                name, got = key, cfg[key]
            elif got is None:
                name, got = f"{what}.{key} (absent: max_position_embeddings)", cfg.get("max_position_embeddings")
        if not _number(got) or got != want:
            raise FormatError(f"{where}: {name} is {got!r}; megatron-core's --use-rope-scaling fixes it to {want} "
                              "(only the factor is a setting), so no megatron-core form computes this RoPE")
        out[key] = want
    return out


def megatron_args(cfg: dict[str, Any], where: str) -> tuple[str, dict[str, Any]]:
    """(class, Megatron-LM's model arguments) of a ``config.json``; a class with no mapping is refused."""
    archs = cfg.get("architectures")
    arch = archs[0] if isinstance(archs, list) and len(archs) == 1 and isinstance(archs[0], str) else None
    if arch not in CLASSES:
        raise FormatError(f"{where}: architectures {archs!r}: no megatron-core mapping for this class; "
                          f"ckpt import --to megatron-core reads {', '.join(CLASSES)}")
    if arch == "GPTBigCodeForCausalLM":
        hidden, layers, heads = (_int(cfg, k, where) for k in ("n_embd", "n_layer", "n_head"))
        inner = cfg.get("n_inner")
        ffn = 4 * hidden if inner is None else _int(cfg, "n_inner", where)
        act = _get(cfg, arch, "activation_function")
        if act not in ACT_FLAGS:
            raise FormatError(f"{where}: activation_function {act!r} has no megatron-core form here "
                              f"({', '.join(ACT_FLAGS)})")
        if not _get(cfg, arch, "scale_attn_weights"):
            raise FormatError(f"{where}: scale_attn_weights false: megatron-core always scales attention")
        flag = ACT_FLAGS[act]
        mq = bool(_get(cfg, arch, "multi_query"))
        eps = _get(cfg, arch, "layer_norm_epsilon")
        positions = _int(cfg, "n_positions", where, DEFAULTS[arch]["n_positions"])
        args = {"num_layers": layers, "hidden_size": hidden, "ffn_hidden_size": ffn, "num_attention_heads": heads,
                "num_query_groups": 1 if mq else heads, "group_query_attention": mq and heads > 1,
                "kv_channels": hidden // heads, "swiglu": False, "openai_gelu": flag == "openai_gelu",
                "squared_relu": flag == "squared_relu", "normalization": "LayerNorm", "norm_epsilon": eps,
                "position_embedding_type": "learned_absolute", "add_position_embedding": True,
                "qk_layernorm": False, "add_bias_linear": True, "add_qkv_bias": True,
                "untie_embeddings_and_output_weights": not _get(cfg, arch, "tie_word_embeddings"),
                "max_position_embeddings": positions}
        if hidden % heads:
            raise FormatError(f"{where}: n_head {heads} does not divide n_embd {hidden}; fix config.json")
    else:
        args = _rope_args(cfg, arch, where)
    eps = args["norm_epsilon"]
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
        raise FormatError(f"{where}: the norm epsilon is {eps!r}, not a positive number; fix config.json")
    args["padded_vocab_size"] = _int(cfg, "vocab_size", where)
    return arch, args


def _rope_args(cfg: dict[str, Any], arch: str, where: str) -> dict[str, Any]:
    """Megatron-LM's arguments of a RoPE class: the settings its forward fixes, the rest read from the config."""
    hidden, layers, heads = (_int(cfg, k, where) for k in ("hidden_size", "num_hidden_layers", "num_attention_heads"))
    moe: dict[str, Any] = {}
    if arch in MOE:
        moe = _moe_args(cfg, arch, where)
        ffn = moe["moe_ffn_hidden_size"]  # every layer is MoE: no dense FFN
    else:
        ffn = _int(cfg, "intermediate_size", where)
    # Persimmon has no num_key_value_heads: every head has its own key and value
    groups = heads if arch == "PersimmonForCausalLM" else _int(cfg, "num_key_value_heads", where, heads)
    dim = _get(cfg, arch, "head_dim") if arch in HEAD_DIM else None
    dim = hidden // heads if dim is None else _int({"head_dim": dim}, "head_dim", where)
    act = _get(cfg, arch, "hidden_act")
    gated = arch not in NON_GATED
    if gated and act != "silu":
        raise FormatError(f"{where}: hidden_act {act!r}: a gated MLP maps onto megatron-core's --swiglu only (silu)")
    if not gated and act not in ACT_FLAGS:
        raise FormatError(f"{where}: hidden_act {act!r} has no megatron-core form for a non-gated MLP here "
                          f"({', '.join(ACT_FLAGS)})")
    window = bool(_get(cfg, arch, "use_sliding_window")) or (
        arch in ("Starcoder2ForCausalLM", "MixtralForCausalLM", "MistralForCausalLM")
        and _get(cfg, arch, "sliding_window") is not None)  # Mistral's default is a 4096-token window
    if window or any(t != "full_attention" for t in _list(cfg, "layer_types", where)):
        raise FormatError(f"{where}: sliding-window attention (use_sliding_window, sliding_window, layer_types) has "
                          "no megatron-core GPT form here")
    if arch == "Starcoder2ForCausalLM":
        bias = qkv_bias = bool(_get(cfg, arch, "use_bias"))
    elif arch == "PersimmonForCausalLM":  # biases on every linear but lm_head, always
        bias = qkv_bias = True
    elif arch == "Qwen2ForCausalLM":  # q/k/v biases always, none elsewhere
        bias, qkv_bias = False, True
    elif arch == "Qwen2MoeForCausalLM":  # q/k/v biases as qkv_bias says, none elsewhere
        bias, qkv_bias = False, bool(_get(cfg, arch, "qkv_bias"))
    elif arch == "MistralForCausalLM":  # no biases, whatever the config says
        bias = qkv_bias = False
    else:
        bias = bool(_get(cfg, arch, "attention_bias"))
        mlp_bias = bool(_get(cfg, arch, "mlp_bias")) if "mlp_bias" in DEFAULTS[arch] else False
        if bias != mlp_bias:
            raise FormatError(f"{where}: attention_bias {bias} with mlp_bias {mlp_bias}: megatron-core's "
                              "--add-bias-linear puts biases on both or neither")
        qkv_bias = bias
    eps_key = {"Starcoder2ForCausalLM": "norm_epsilon", "PersimmonForCausalLM": "layer_norm_eps"}.get(arch,
                                                                                                    "rms_norm_eps")
    qk_norm = arch in QK_NORM
    if arch == "PersimmonForCausalLM":
        qk_norm = True
        if not _get(cfg, arch, "qk_layernorm"):
            raise FormatError(f"{where}: qk_layernorm false: megatron-core's form of this model exports as "
                              "Starcoder2ForCausalLM, not Persimmon; no round trip, so it is refused")
    rope = rope_parameters(cfg, arch, where, DEFAULTS[arch].get("partial_rotary_factor", 1.0))
    # megatron-core's GPTModel(rope_scaling=args.use_rope_scaling, rope_scaling_factor=args.rope_scaling_factor)
    scaled = {"use_rope_scaling": True, "rope_scaling_factor": rope["factor"]} if rope["rope_type"] == "llama3" else {}
    flags = {f: False for f in ("openai_gelu", "squared_relu")}
    if not gated and ACT_FLAGS[act]:
        flags[ACT_FLAGS[act]] = True
    return {"num_layers": layers, "hidden_size": hidden, "ffn_hidden_size": ffn, "num_attention_heads": heads,
            "num_query_groups": groups, "group_query_attention": groups != heads, "kv_channels": dim,
            "swiglu": gated, **flags, "normalization": "LayerNorm" if arch in LAYERNORM else "RMSNorm",
            "norm_epsilon": _get(cfg, arch, eps_key), "position_embedding_type": "rope",
            "add_position_embedding": False, "rotary_base": int(rope["rope_theta"]), **scaled,
            "rotary_percent": 1.0, "rotary_interleaved": False, "qk_layernorm": qk_norm, "add_bias_linear": bias,
            "add_qkv_bias": qkv_bias, "untie_embeddings_and_output_weights": not _get(cfg, arch, "tie_word_embeddings"),
            "max_position_embeddings": _int(cfg, "max_position_embeddings", where,
                                            DEFAULTS[arch]["max_position_embeddings"]), **moe}


def _moe_args(cfg: dict[str, Any], arch: str, where: str) -> dict[str, Any]:
    """Megatron-LM's MoE arguments of Mixtral / Qwen3-MoE: experts, expert FFN, top-k, and the router's
    normalisation (``norm_topk_prob`` false: megatron's ``--moe-router-pre-softmax``, see megatron_arch)."""
    n_key, ffn_key = MOE[arch]
    if arch == "Qwen3MoeForCausalLM" and n_key not in cfg and "num_local_experts" in cfg:
        n_key = "num_local_experts"  # the name transformers 5 saves (the refusal names the folder's key)
    experts = _int(cfg, n_key, where, _experts_default(cfg, arch))
    topk = _int(cfg, "num_experts_per_tok", where, DEFAULTS[arch]["num_experts_per_tok"])
    if topk > experts:
        raise FormatError(f"{where}: num_experts_per_tok {topk} is more than the {experts} experts ({n_key})")
    shared = None
    if arch == "Qwen2MoeForCausalLM":  # its shared expert is always there, behind a sigmoid gate
        shared = _int(cfg, "shared_expert_intermediate_size", where, DEFAULTS[arch]["shared_expert_intermediate_size"])
    if arch != "MixtralForCausalLM":
        step, dense = _get(cfg, arch, "decoder_sparse_step"), _list(cfg, "mlp_only_layers", where)
        if step != 1 or dense:
            raise FormatError(f"{where}: decoder_sparse_step {step!r} / mlp_only_layers {dense[:4]!r}: dense layers "
                              "between MoE layers have no megatron-core GPT form here (every layer MoE)")
        pre_softmax = not _get(cfg, arch, "norm_topk_prob")
    else:
        pre_softmax = False  # Mixtral always renormalises its top k
    return {"num_experts": experts, "moe_ffn_hidden_size": _int(cfg, ffn_key, where, DEFAULTS[arch][ffn_key]),
            "moe_router_topk": topk, "moe_router_pre_softmax": pre_softmax, "moe_router_score_function": "softmax",
            "moe_shared_expert_intermediate_size": shared, "moe_shared_expert_gate": shared is not None,
            "moe_router_enable_expert_bias": False,
            "moe_grouped_gemm": False, "moe_layer_freq": 1, "moe_aux_loss_coeff": 0.0,
            "moe_token_dispatcher_type": "allgather"}


def _experts_default(cfg: dict[str, Any], arch: str) -> Any:
    """Qwen3-MoE's expert count under its other name: transformers 5 saves ``num_local_experts`` and maps
    ``num_experts`` onto it (older configs have ``num_experts`` only)."""
    return cfg.get("num_local_experts", DEFAULTS[arch]["num_experts"]) if arch == "Qwen3MoeForCausalLM" else \
        DEFAULTS[arch][MOE[arch][0]]


def _list(cfg: dict[str, Any], key: str, where: str) -> list[Any]:
    v = cfg.get(key) or []
    if not isinstance(v, list):
        raise FormatError(f"{where}: {key} is {v!r}, not a list; fix config.json")
    return v


def description(args: dict[str, Any]) -> ModelDescription:
    act = "silu" if args["swiglu"] else "squared_relu" if args["squared_relu"] else \
        "gelu_tanh" if args["openai_gelu"] else "gelu"
    return ModelDescription(
        num_layers=args["num_layers"], hidden_size=args["hidden_size"], ffn_hidden_size=args["ffn_hidden_size"],
        num_attention_heads=args["num_attention_heads"], num_query_groups=args["num_query_groups"],
        kv_channels=args["kv_channels"], vocab_size=args["padded_vocab_size"], gated_linear_unit=args["swiglu"],
        activation=act, normalization=args["normalization"], norm_epsilon=args["norm_epsilon"],
        position_embedding_type=args["position_embedding_type"], rotary_base=args.get("rotary_base"),
        rotary_percent=args.get("rotary_percent"), use_rope_scaling=args.get("use_rope_scaling"),
        rope_scaling_factor=args.get("rope_scaling_factor"), qk_layernorm=args["qk_layernorm"],
        add_bias_linear=args["add_bias_linear"], add_qkv_bias=args["add_qkv_bias"],
        untied=args["untie_embeddings_and_output_weights"], num_experts=args.get("num_experts"),
        moe_ffn_hidden_size=args.get("moe_ffn_hidden_size"), moe_router_enable_expert_bias=args.get(
            "moe_router_enable_expert_bias"), moe_shared_expert_intermediate_size=args.get(
            "moe_shared_expert_intermediate_size"))


def layer_shapes(args: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """One layer's megatron-core parameters (checkpoint names below ``decoder.layers.``) and their shapes."""
    h, ffn = args["hidden_size"], args["ffn_hidden_size"]
    heads, groups, dim = args["num_attention_heads"], args["num_query_groups"], args["kv_channels"]
    ln = args["normalization"] == "LayerNorm"
    out: dict[str, tuple[int, ...]] = {"self_attention.linear_qkv.layer_norm_weight": (h,)}
    if ln:
        out["self_attention.linear_qkv.layer_norm_bias"] = (h,)
    out["self_attention.linear_qkv.weight"] = ((heads + 2 * groups) * dim, h)
    if args["add_qkv_bias"]:
        out["self_attention.linear_qkv.bias"] = ((heads + 2 * groups) * dim,)
    if args["qk_layernorm"]:
        for qk in ("q", "k"):
            out[f"self_attention.{qk}_layernorm.weight"] = (dim,)
            if ln:  # LayerNorm q/k norms carry a bias
                out[f"self_attention.{qk}_layernorm.bias"] = (dim,)
    out["self_attention.linear_proj.weight"] = (h, heads * dim)
    if args["add_bias_linear"]:
        out["self_attention.linear_proj.bias"] = (h,)
    out["mlp.linear_fc1.layer_norm_weight"] = (h,)
    if ln:
        out["mlp.linear_fc1.layer_norm_bias"] = (h,)
    if args.get("num_experts"):  # the MLP is the router and the experts (expert_shapes)
        out["mlp.router.weight"] = (args["num_experts"], h)
        shared = args.get("moe_shared_expert_intermediate_size")
        if shared:  # megatron-core's SharedExpertMLP (SwiGLU) with its sigmoid gate
            out["mlp.shared_experts.linear_fc1.weight"] = (2 * shared, h)
            out["mlp.shared_experts.linear_fc2.weight"] = (h, shared)
            out["mlp.shared_experts.gate_weight"] = (1, h)
        return out
    fc1 = 2 * ffn if args["swiglu"] else ffn
    out["mlp.linear_fc1.weight"] = (fc1, h)
    if args["add_bias_linear"]:
        out["mlp.linear_fc1.bias"] = (fc1,)
    out["mlp.linear_fc2.weight"] = (h, ffn)
    if args["add_bias_linear"]:
        out["mlp.linear_fc2.bias"] = (h,)
    return out


def expert_shapes(args: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """One expert's parameters (names below ``decoder.layers.mlp.experts.experts.``): SwiGLU, no bias."""
    if not args.get("num_experts"):
        return {}
    h, ffn = args["hidden_size"], args["moe_ffn_hidden_size"]
    return {"linear_fc1.weight": (2 * ffn, h), "linear_fc2.weight": (h, ffn)}


def global_shapes(args: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    h = args["hidden_size"]
    out: dict[str, tuple[int, ...]] = {"embedding.word_embeddings.weight": (args["padded_vocab_size"], h)}
    if args["position_embedding_type"] == "learned_absolute":
        out["embedding.position_embeddings.weight"] = (args["max_position_embeddings"], h)
    out["decoder.final_layernorm.weight"] = (h,)
    if args["normalization"] == "LayerNorm":
        out["decoder.final_layernorm.bias"] = (h,)
    if args["untie_embeddings_and_output_weights"]:
        out["output_layer.weight"] = (args["padded_vocab_size"], h)
    return out


def _check_config(arch: str, cfg: dict[str, Any], target: megatron_arch.Target, where: str) -> None:
    """Every forward-changing key the export would write must be the folder's own (defaults filled)."""
    if target.architecture != EXPORTS_AS.get(arch, arch):
        raise FormatError(f"{where}: this {arch} maps onto megatron-core settings that export as "
                          f"{target.architecture}; no round trip, so it is refused")
    for key, want in target.config.items():
        if key in NOT_FORWARD or (key == "intermediate_size" and arch in ("Qwen3MoeForCausalLM",
                                                                          "Qwen2MoeForCausalLM")):
            continue  # Qwen-MoE's dense FFN size: no dense layer (mlp_only_layers empty) uses it
        if key == "partial_rotary_factor":
            continue  # rope_parameters() refuses anything but 1.0 (read where transformers reads it)
        if key == "rope_parameters":  # the whole RoPE, as transformers reads it (partial rotary checked there)
            got = rope_parameters(cfg, arch, where, DEFAULTS[arch].get("partial_rotary_factor", 1.0))
            want = {k: v for k, v in want.items() if k != "partial_rotary_factor"}
            for k in sorted(set(got) | set(want)):
                if got.get(k) != want.get(k):
                    raise FormatError(f"{where}: rope_parameters {k} is {got.get(k)!r}; megatron-core's form of this "
                                      f"model computes {want.get(k)!r} (no exact megatron-core mapping)")
            continue
        got = cfg.get(key, DEFAULTS[arch].get(key, want))
        if arch in MOE and key == MOE[arch][0]:
            got = cfg.get(key, _experts_default(cfg, arch))
        if key == "num_key_value_heads" and arch == "GPTBigCodeForCausalLM":
            continue  # transformers derives it from multi_query
        if got is None and (key == "head_dim" or (key == "n_inner" and want == 4 * cfg.get("n_embd", 0))):
            got = want  # transformers' own default: hidden / heads, 4 x n_embd
        if got != want and not (isinstance(got, (int, float)) and isinstance(want, (int, float))
                                and not isinstance(got, bool) and float(got) == float(want)):
            raise FormatError(f"{where}: {key} is {got!r}; megatron-core's form of this model computes {want!r} "
                              "(no exact megatron-core mapping)")


def open_hf_megatron(src: Path | ObjectURL, optimizer: bool = True) -> HFMegatron:
    """Read and check an HF folder (headers only) as megatron-core's GPT; see the module docstring.
    ``optimizer``: carry the folder's optimizer files (``ckpt export --to hf --optimizer``: masters and
    moments under ``optimizer.state.<state>.<HF name>``, fp32, at the HF tensor's shape), if it has them."""
    cfg, tensors = read_folder(src)
    fix = "pass a folder written by `ckpt export --to hf --optimizer`, or --no-optimizer"
    opt = read_set(src, "optimizer", fix) if optimizer else None
    opt_tensors = opt[0] if opt is not None else {}
    where = str(src / "config.json")
    arch, args = megatron_args(cfg, where)
    layers = args["num_layers"]
    per_layer = layer_shapes(args)
    n_global = len(global_shapes(args))
    bigcode = arch == "GPTBigCodeForCausalLM"
    fused = arch in FUSED_QKV
    # one HF tensor per megatron-core tensor of a layer, but q/k/v (3 for linear_qkv) and gate/up (2 for fc1)
    experts = args.get("num_experts") or 0
    per_expert = expert_shapes(args)
    per_hf = len(per_layer) + (0 if fused else 2 * (1 + args["add_qkv_bias"])) + \
        (1 if args["swiglu"] and (not experts or args.get("moe_shared_expert_intermediate_size")) else 0) + \
        experts * (len(per_expert) + 1)  # a gated fc1 (dense, shared or an expert's): gate and up
    want_n = n_global + per_hf * layers
    if len(tensors) != want_n:
        raise FormatError(f"{src}: config.json says {layers} layers of {arch}, i.e. {want_n} tensors, but the "
                          f"folder holds {len(tensors)}; the weights do not belong to this config")
    dtypes = {t.dtype.name for t in tensors.values()}
    if len(dtypes) != 1 or next(iter(dtypes)) not in PARAM_DTYPES:
        raise FormatError(f"{src}: tensors are {', '.join(sorted(dtypes))}; megatron-core's import takes one param "
                          "dtype, float32 or bfloat16 (convert the model first, e.g. model.to(torch.bfloat16))")
    dtype = next(iter(tensors.values())).dtype
    # the config's sizes against the stored tensors, before any per-head or per-layer table is built
    h, heads, groups, dim = (args[k] for k in ("hidden_size", "num_attention_heads", "num_query_groups",
                                               "kv_channels"))
    first = ({"transformer.wte.weight": (args["padded_vocab_size"], h),
              "transformer.h.0.attn.c_attn.weight": ((heads + 2 * groups) * dim, h)} if bigcode else
             {"model.embed_tokens.weight": (args["padded_vocab_size"], h),
              "model.layers.0.self_attn.query_key_value.weight": (3 * heads * dim, h)} if fused else
             {"model.embed_tokens.weight": (args["padded_vocab_size"], h),
              "model.layers.0.self_attn.q_proj.weight": (heads * dim, h),
              "model.layers.0.self_attn.k_proj.weight": (groups * dim, h)})
    for hf, want in first.items():
        t = tensors.get(hf)
        if t is None or t.shape != want:
            raise FormatError(f"{t.file if t else src}: tensor {hf!r} is {list(t.shape) if t else 'missing'}, "
                              f"config.json implies {list(want)}; the weights do not belong to this config")
    shapes0 = {f"decoder.layers.0.{k}": s for k, s in per_layer.items()}
    shapes0.update(global_shapes(args))
    target = megatron_arch.choose(description(args), args, shapes0, None, dtype.name, where)
    _check_config(arch, cfg, target, where)
    params: list[MegatronParam] = []
    used: set[str] = set()
    order: list[tuple[str, int | None, int | None]] = [(k, None, None) for k in global_shapes(args)
                                                         if k.startswith("embedding.")]
    order += [(k, i, None) for i in range(layers) for k in per_layer]
    order += [(k, i, e) for i in range(layers) for e in range(experts) for k in per_expert]
    order += [(k, None, None) for k in global_shapes(args) if not k.startswith("embedding.")]
    for key, layer, expert in order:
        shape = per_expert[key] if expert is not None else per_layer[key] if layer is not None else \
            global_shapes(args)[key]
        name = f"decoder.layers.{layer}.mlp.experts.{expert}.{key}" if expert is not None else \
            f"decoder.layers.{layer}.{key}" if layer is not None else key
        segs = []
        for hf, rows in target.names(name, shape):
            t = tensors.get(hf)
            want = (sum(b - a for a, b in rows), *shape[1:])
            if t is None or t.shape != want:
                got = "missing" if t is None else list(t.shape)
                raise FormatError(f"{src}: tensor {hf!r} is {got}, config.json implies {list(want)}; the weights do "
                                  "not belong to this config")
            used.add(hf)
            states = []
            for s in STATES if opt is not None else ():
                ot = opt_tensors.get(f"optimizer.state.{s}.{hf}")
                if ot is None or ot.shape != t.shape or ot.dtype.name != "float32":
                    got = "missing" if ot is None else f"{list(ot.shape)} {ot.dtype.name}"
                    raise FormatError(f"{ot.file if ot else src}: optimizer tensor 'optimizer.state.{s}.{hf}' is "
                                      f"{got}, the model implies {list(t.shape)} float32; {fix}")
                used.add(f"optimizer.state.{s}.{hf}")
                states.append(ot)
            first = 0
            for a, b in rows:  # the HF tensor is its megatron row ranges back to back
                segs.append((a, b, Segment(t, first, b - a), tuple(Segment(o, first, b - a) for o in states)))
                first += b - a
        segs.sort(key=lambda s: s[0])
        if [(a, b) for a, b, *_ in segs] != list(zip([0] + [b for _, b, *_ in segs[:-1]],
                                                     [b for _, b, *_ in segs])) or segs[-1][1] != shape[0]:
            raise FormatError(f"{src}: the rows of {name} are not covered once by its HF tensors")  # a table bug
        stacked = EXPERT_KEY + key if expert is not None else f"decoder.layers.{key}" if layer is not None else key
        carried = tuple(tuple(sg[3][i] for sg in segs) for i in range(len(STATES))) if opt is not None else ()
        params.append(MegatronParam(stacked, layer, shape, tuple(sg[2] for sg in segs), expert, carried))
    unknown = sorted((set(tensors) | set(opt_tensors)) - used)
    if unknown:
        raise FormatError(f"{src}: has tensor {unknown[0]!r}, which {arch} of this config.json does not have; the "
                          "folder is not that model")
    run_state = parse_run_state(opt[1], str(src / "optimizer*.safetensors")) if opt is not None else None
    return HFMegatron(src, arch, args, dtype, tuple(params), run_state)
