"""``ckpt export --to hf`` of genuine megatron-core checkpoints of the families users train, with no
model flag, against megatron-core's own forward.

Each fixture was written by megatron-core 0.19.2 (``fixtures/megatron/make_megatron_fixtures.py``),
records its Megatron-LM flags in ``common_state`` args, has perturbed norm weights (after two bf16
steps an untouched norm weight is still exactly 1.0, which hides swapped norms) and stores
megatron's own fp32 forward on a fixed token batch beside it (``reference_logits.npz``), so this
test needs no megatron venv. transformers must load the export with ``AutoModelForCausalLM`` and
compute the same logits within 1e-5: a correct mapping gives about 1e-7, swapped q/k norms 4e-5, a
wrong ``rope_theta`` 2e-4. Both halves of each pair (``dp_reshardable`` and ``fully_reshardable``)
export the same model weights.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from cli_helpers import assert_error_line, cli

REPO = Path(__file__).resolve().parents[2]
MEGATRON = REPO / "fixtures" / "megatron"
# fixture -> the transformers class its recorded model maps onto
EXPECTED = {
    "pair_llama_tp2_dp2_dp_reshardable": "LlamaForCausalLM",
    "pair_qwen3_tp2_dp_reshardable": "Qwen3ForCausalLM",
    "pair_mixtral_ep2_dp_reshardable": "MixtralForCausalLM",
    "pair_mixtral_tp2_ep1_dp_reshardable": "MixtralForCausalLM",  # EP 1, expert TP = TP: experts in the dense optimizer
    "pair_starcoder2_tp2_dp_reshardable": "Starcoder2ForCausalLM",
    "pair_mqa_tp2_dp_reshardable": "GPTBigCodeForCausalLM",  # multi_query: one group at TP2
    "pair_qwen2moe_ep2_dp_reshardable": "Qwen2MoeForCausalLM",
    "pair_qwen2moe_tp2_ep1_dp_reshardable": "Qwen2MoeForCausalLM",  # EP 1: experts and shared expert dense
    # RoPE + LayerNorm q/k layernorm (with biases) + linear biases + GELU, MHA, tied
    "pair_qk_layernorm_tp2_dp_reshardable": "PersimmonForCausalLM",
    # Llama-style with --use-rope-scaling --rope-scaling-factor 32 --rotary-base 500000 (Llama 3.2's RoPE)
    "pair_llama3_rope_tp2_dp_reshardable": "LlamaForCausalLM",
    # PP2 x VPP2 (EP 2): each model chunk's layers, experts and optimizer buffers where megatron-core put them
    "pair_mixtral_vpp_pp2_dp_reshardable": "MixtralForCausalLM",
    # 6 layers over PP2 x VPP2 with --decoder-first-pipeline-num-layers 2 (GELU, learned positions: GPT-BigCode)
    "pair_uneven_vpp_pp2_dp_reshardable": "GPTBigCodeForCausalLM",
}
# fixture -> the flag its refusal names (no transformers class computes that model exactly)
REFUSED = {
    "pair_swiglu_tp1_dp_reshardable": "--swiglu",  # SwiGLU with learned positions
    "pair_moe_shared_dp_reshardable": "MoE",
    "pair_moe_expert_bias_dp_reshardable": "MoE",
}


def _present(names: dict[str, str]) -> list[str]:
    return [n for n in names if (MEGATRON / n / "reference_logits.npz").exists()]


@pytest.mark.parametrize("half", ["", "_fully_reshardable"])
@pytest.mark.parametrize("name", _present(EXPECTED))
def test_export_matches_megatrons_forward(name: str, half: str, tmp_path: Path) -> None:
    os.environ["HF_HUB_OFFLINE"] = "1"
    transformers = pytest.importorskip("transformers")
    src = MEGATRON / (name + half)
    r = cli("export", src, tmp_path / "hf", "--to", "hf", "--format", "json")
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["architecture"] == EXPECTED[name], doc
    # the fixtures' args are a subset of a Megatron-LM run's: only --norm-epsilon (1e-5, both ways) is missing
    assert all("norm epsilon" in a for a in doc["assumed"]), doc["assumed"]
    with np.load(MEGATRON / name / "reference_logits.npz") as z:
        tokens, want = torch.from_numpy(z["tokens"]), torch.from_numpy(z["logits"])
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    assert type(model).__name__ == EXPECTED[name]
    model.eval()
    with torch.no_grad():
        got = model(tokens).logits
    assert got.shape == want.shape
    err = (got - want).abs().max().item()
    assert err <= 1e-5 and want.abs().max().item() > 0.05, err


def test_llama3_rope_scaling_fixture_exports_its_recorded_scaling(tmp_path: Path) -> None:
    """The run's --use-rope-scaling --rope-scaling-factor 32 is written as transformers' llama3 RoPE with
    megatron-core's fixed constants; the same weights with plain RoPE are off megatron's forward by 5e-5
    (the export's own error is 1e-7), so the comparison above tells the two apart."""
    name = "pair_llama3_rope_tp2_dp_reshardable"
    if not (MEGATRON / name / "reference_logits.npz").exists():
        pytest.skip(f"fixture {name} not generated")
    os.environ["HF_HUB_OFFLINE"] = "1"
    transformers = pytest.importorskip("transformers")
    assert cli("export", MEGATRON / name, tmp_path / "hf", "--to", "hf").exit_code == 0
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["rope_parameters"] == {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 8192}
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 500000.0}
    (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg))
    with np.load(MEGATRON / name / "reference_logits.npz") as z:
        tokens, want = torch.from_numpy(z["tokens"]), torch.from_numpy(z["logits"])
    plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    with torch.no_grad():
        assert (plain(tokens).logits - want).abs().max().item() > 2e-5


@pytest.mark.parametrize("name,arch", [
    ("pair_qwen3_tp2_dp_reshardable", "Qwen3ForCausalLM"), ("pair_mixtral_ep2_dp_reshardable", "MixtralForCausalLM"),
    ("pair_starcoder2_tp2_dp_reshardable", "Starcoder2ForCausalLM"), ("pair_tp2_dp2_dp_reshardable", None),
    ("pair_llama_tp2_dp2_dp_reshardable", "LlamaForCausalLM")])
def test_rope_scaling_maps_onto_every_rope_class(name: str, arch: str | None) -> None:
    """--use-rope-scaling maps onto every RoPE class (each checked against megatron-core's forward by the
    import's loader test); with learned positions (GPT-BigCode) it is refused naming the flag. Without
    --rope-scaling-factor recorded, megatron-core's default 8 is used and the export says it assumed it."""
    from dataclasses import replace

    from ckpt_tool.hf import megatron_arch
    from gtp_format.errors import FormatError
    from gtp_format.megatron.args import describe_model, recorded_args
    from gtp_format.megatron.view import megatron_views
    from gtp_format.reader.checkpoint import open_checkpoint

    ckpt = open_checkpoint(MEGATRON / name)
    d = replace(describe_model(ckpt), use_rope_scaling=True, rope_scaling_factor=None)
    shapes = {v.name: v.full_shape for v in megatron_views(ckpt, experts=True).values()}
    if arch is None:
        with pytest.raises(FormatError, match="--use-rope-scaling"):
            megatron_arch.choose(d, recorded_args(ckpt), shapes, None, "float32", name)
        return
    target = megatron_arch.choose(d, recorded_args(ckpt), shapes, None, "float32", name)
    assert target.architecture == arch
    assert target.config["rope_parameters"]["rope_type"] == "llama3"
    assert target.config["rope_parameters"]["factor"] == 8.0
    assert any("RoPE scaling factor 8.0" in a for a in target.assumed), target.assumed


@pytest.mark.parametrize("name", _present(REFUSED))
def test_models_with_no_exact_class_are_refused_by_flag(name: str, tmp_path: Path) -> None:
    r = cli("export", MEGATRON / name, tmp_path / "hf", "--to", "hf")
    assert_error_line(r, 2, REFUSED[name], "--names megatron")
    assert not (tmp_path / "hf").exists()


def _moe_description(**extra: object) -> tuple[object, dict, dict]:
    from gtp_format.megatron.args import ModelDescription

    d = ModelDescription(num_layers=1, hidden_size=32, ffn_hidden_size=32, num_attention_heads=4, num_query_groups=2,
                         kv_channels=8, vocab_size=128, gated_linear_unit=True, activation="silu",
                         normalization="RMSNorm", norm_epsilon=1e-5, position_embedding_type="rope", rotary_base=10000,
                         rotary_percent=1.0, qk_layernorm=bool(extra.pop("qk", False)), add_bias_linear=False,
                         add_qkv_bias=False, untied=True, num_experts=4, moe_ffn_hidden_size=32,
                         moe_shared_expert_intermediate_size=extra.pop("shared", None))
    shapes = {"decoder.layers.0.self_attention.linear_qkv.weight": (64, 32),
              "decoder.layers.0.self_attention.linear_proj.weight": (32, 32), "output_layer.weight": (128, 32)}
    if extra.pop("gate", False):
        shapes["decoder.layers.0.mlp.shared_experts.gate_weight"] = (1, 32)
    return d, {"moe_router_topk": 2, **extra}, shapes


@pytest.mark.parametrize("case,want", [
    ({"moe_router_pre_softmax": True}, "--moe-router-pre-softmax"),  # Mixtral always renormalises
    ({"shared": 48}, "without --moe-shared-expert-gate"),  # Qwen2-MoE always gates its shared expert
    ({"shared": 48, "gate": True, "qk": True}, "a shared expert with q/k layernorm"),
    ({"moe_router_pre_softmax": True, "qk": True}, "Qwen3MoeForCausalLM"),
    ({"moe_router_pre_softmax": True, "shared": 48, "gate": True}, "Qwen2MoeForCausalLM"),
    ({"shared": 48, "gate": True}, "Qwen2MoeForCausalLM"),
])
def test_moe_router_and_shared_expert_map_only_where_exact(case: dict, want: str) -> None:
    """--moe-router-pre-softmax (softmax over all experts, top k, no renormalisation) is Qwen3-MoE's or
    Qwen2-MoE's ``norm_topk_prob: false``, never Mixtral's; a shared expert is Qwen2-MoE's only with
    megatron's sigmoid gate; anything else is refused naming the flag."""
    from ckpt_tool.hf.megatron_arch import choose
    from gtp_format.errors import FormatError

    d, args, shapes = _moe_description(**case)
    if want.endswith("ForCausalLM"):
        t = choose(d, args, shapes, None, "float32", "ckpt")
        assert t.architecture == want
        assert t.config["norm_topk_prob"] is not bool(args.get("moe_router_pre_softmax"))
    else:
        with pytest.raises(FormatError, match=want.replace("-", "\\-")):
            choose(d, args, shapes, None, "float32", "ckpt")


def _layernorm_qk_description(groups: int, dim: int = 8, **over: object) -> tuple[object, dict[str, tuple[int, ...]]]:
    from gtp_format.megatron.args import ModelDescription

    fields = dict(num_layers=1, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_query_groups=groups,
                  kv_channels=dim, vocab_size=128, gated_linear_unit=False, activation="gelu",
                  normalization="LayerNorm", norm_epsilon=1e-5, position_embedding_type="rope", rotary_base=10000,
                  rotary_percent=1.0, qk_layernorm=True, add_bias_linear=True, add_qkv_bias=True, untied=False)
    fields.update(over)
    qkv = (4 + 2 * groups) * dim
    shapes = {"decoder.layers.0.self_attention.linear_qkv.weight": (qkv, 32),
              "decoder.layers.0.self_attention.linear_qkv.bias": (qkv,),
              "decoder.layers.0.self_attention.q_layernorm.weight": (dim,),
              "decoder.layers.0.self_attention.q_layernorm.bias": (dim,),
              "decoder.layers.0.self_attention.linear_proj.weight": (32, 4 * dim),
              "decoder.layers.0.self_attention.linear_proj.bias": (32,)}
    return ModelDescription(**fields), shapes


@pytest.mark.parametrize("groups,over,want", [
    (4, {}, "PersimmonForCausalLM"),
    (4, {"activation": "squared_relu"}, "PersimmonForCausalLM"),  # relu2, Persimmon's own activation
    (2, {}, "--group-query-attention"),  # Persimmon has no num_key_value_heads
    (1, {}, "--group-query-attention"),
    (4, {"dim": 16}, "--kv-channels"),  # Persimmon's head dim is hidden / heads
    (4, {"add_bias_linear": False, "add_qkv_bias": False, "bias": False}, "--disable-bias-linear"),
])
def test_layernorm_qk_norms_map_onto_persimmon_only_for_mha(groups: int, over: dict, want: str) -> None:
    """LayerNorm q/k layernorm is Persimmon's (per-head LayerNorm with bias before RoPE), whose fused
    query_key_value is per head [q; k; v]: megatron-core's layout with one head per group, so GQA and MQA
    are refused naming the flag."""
    from ckpt_tool.hf.megatron_arch import choose
    from gtp_format.errors import FormatError

    over = dict(over)
    bias = over.pop("bias", True)
    d, shapes = _layernorm_qk_description(groups, **over)
    if not bias:  # --disable-bias-linear: no bias tensor stored
        shapes = {k: s for k, s in shapes.items() if not k.endswith("linear_proj.bias") and "linear_qkv.bias" not in k}
    if want.endswith("ForCausalLM"):
        t = choose(d, {}, shapes, None, "float32", "ckpt")
        assert t.architecture == want
        assert t.config["rope_parameters"]["partial_rotary_factor"] == 1.0 == t.config["partial_rotary_factor"]
        assert t.config["hidden_act"] == {"gelu": "gelu", "squared_relu": "relu2"}[d.activation]
        assert "num_key_value_heads" not in t.config
        assert t.names("decoder.layers.0.self_attention.linear_qkv.weight", (96, 32)) == [
            ("model.layers.0.self_attn.query_key_value.weight", ((0, 96),))]
    else:
        with pytest.raises(FormatError, match=want.replace("-", "\\-")):
            choose(d, {}, shapes, None, "float32", "ckpt")


@pytest.mark.parametrize("arg,value,flag", [
    ("rotary_interleaved", True, "--rotary-interleaved"), ("apply_layernorm_1p", True, "--apply-layernorm-1p"),
    ("window_size", (4096, 0), "--window-size"), ("no_rope_freq", 4, "--no-rope-freq"),
    ("glu_linear_offset", 1.0, "--glu-linear-offset"), ("softmax_scale", 0.1, "--softmax-scale")])
def test_forward_changing_args_with_no_class_are_refused(arg: str, value: object, flag: str) -> None:
    """A recorded setting no transformers class computes is refused naming its flag; its default is not."""
    from ckpt_tool.hf.megatron_arch import choose
    from gtp_format.errors import FormatError

    d, _, shapes = _moe_description()
    d = replace(d, num_experts=None, moe_ffn_hidden_size=None)
    shapes = {k: v for k, v in shapes.items() if "expert" not in k}
    assert choose(d, {arg: None}, shapes, None, "float32", "x").architecture == "LlamaForCausalLM"
    with pytest.raises(FormatError, match=re.escape(flag)):
        choose(d, {arg: value}, shapes, None, "float32", "x")
