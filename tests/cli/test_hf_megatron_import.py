"""``ckpt import --from hf --to megatron-core``: a transformers folder as a megatron-core checkpoint.

Tiny models built by transformers from a config (random init, nothing downloaded; norm weights
perturbed so a swapped or dropped norm shows) of each mapped class: LlamaForCausalLM (GQA untied,
MQA tied, bf16), Qwen3ForCausalLM (q/k norms), Qwen2ForCausalLM (q/k/v biases), ArceeForCausalLM
(squared ReLU; tanh GELU with biases), Starcoder2ForCausalLM (LayerNorm, biases, GELU, tied),
GPTBigCodeForCausalLM (MHA and MQA), MixtralForCausalLM, Qwen3MoeForCausalLM (``norm_topk_prob`` true and
false), Qwen2MoeForCausalLM (gated shared expert). Must hold:

* import -> ``ckpt export --to hf`` gives every tensor back bit for bit (HF -> megatron-core -> HF),
  and ``verify --data`` passes on the import;
* megatron-core's own loader (``tests/helpers/megatron_forward.py``, the megatron venv; skipped
  without it) loads the import at TP 2 (or 1 for MQA) into a model built from the checkpoint's own
  args, and its forward equals transformers' logits within 1e-5 (fp32); at PP 2 it loads the same
  values (masters equal to the weights, zero moments, step 0);
* megatron-core (a genuine fixture) -> HF -> megatron-core at another topology -> HF is bit-identical, with
  the optimizer state (MoE's chained pair and EP 1's dense experts included) and the lr schedule carried;
* EP 1 with expert TP = TP: the experts in the dense buffers, as megatron-core's own ``pair_mixtral_tp2_ep1``;
* a class with no mapping, a config that disagrees with the tensors, a forward setting megatron-core
  cannot compute, an impossible topology: one line, exit 2, nothing written; a DST that appears
  mid-run is refused and left alone.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from cli_helpers import assert_error_line, cli
from safetensors.torch import load_file, save_file

from gtp_format.errors import FormatError

os.environ["HF_HUB_OFFLINE"] = "1"
transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
MEGATRON = ROOT / "fixtures" / "megatron"
MEGATRON_PY = MEGATRON / "_venv" / "bin" / "python"
FORWARD = ROOT / "tests" / "helpers" / "megatron_forward.py"
SIZES = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=128)
TOL = 1e-5
# Llama 3.2's RoPE (factor 32, megatron-core's low/high factors and 8192 original positions): with theta 500000
# and head dim 16 the 8 frequencies have wavelengths 2 pi 500000^(i/8): i <= 3 under 8192/4 (kept), i = 4 in
# between (interpolated), i >= 5 over 8192 (divided by the factor), so every band of the formula is used
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
LLAMA3 = dict(SIZES, num_key_value_heads=2, rope_parameters=LLAMA3_ROPE, max_position_embeddings=131072)


def hf_model(root: Path, kind: str, dtype: torch.dtype = torch.float32) -> Path:
    """A tiny random model of ``kind``; ``KIND+llama3``: the same with Llama 3.x's RoPE scaling in its config."""
    if kind.endswith("+llama3"):
        hf_model(root, kind.removesuffix("+llama3"), dtype)
        cfg = json.loads((root / "config.json").read_text())
        part = {"partial_rotary_factor": 1.0} if cfg["model_type"] == "persimmon" else {}
        _edit_config(root, rope_parameters={**LLAMA3_ROPE, **part}, max_position_embeddings=131072)
        return root
    torch.manual_seed(0)
    if kind == "llama":  # GQA, untied (Llama's default)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(num_key_value_heads=2, **SIZES))
    elif kind == "llama_mqa_tied":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(num_key_value_heads=1,
                                                                       tie_word_embeddings=True, **SIZES))
    elif kind in ("llama3", "mistral_llama3"):  # Llama 3.x RoPE scaling with megatron-core's fixed constants
        model = (transformers.MistralForCausalLM(transformers.MistralConfig(sliding_window=None, **LLAMA3))
                 if kind == "mistral_llama3" else transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA3)))
    elif kind == "mistral":  # no sliding window, its own head_dim: Llama's forward under another class
        model = transformers.MistralForCausalLM(transformers.MistralConfig(
            num_key_value_heads=2, sliding_window=None, head_dim=24, rope_theta=40000.0, **SIZES))
    elif kind == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(num_key_value_heads=2, head_dim=16,
                                                                       rope_theta=50000.0, **SIZES))
    elif kind == "qwen2":  # biases on q/k/v only
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(num_key_value_heads=2, rope_theta=20000.0,
                                                                       **SIZES))
    elif kind.startswith("arcee"):  # RMSNorm, non-gated: relu2 (its default) or tanh GELU, with biases
        act = "gelu_pytorch_tanh" if kind == "arcee_gelu_bias" else "relu2"
        model = transformers.ArceeForCausalLM(transformers.ArceeConfig(
            num_key_value_heads=2, head_dim=16, hidden_act=act, attention_bias=act != "relu2",
            mlp_bias=act != "relu2", bos_token_id=None, eos_token_id=None, **SIZES))
    elif kind == "starcoder2":  # LayerNorm, biases, GELU (tanh), GQA, tied
        model = transformers.Starcoder2ForCausalLM(transformers.Starcoder2Config(
            num_key_value_heads=2, hidden_act="gelu", bos_token_id=None, eos_token_id=None, **SIZES))
    elif kind == "persimmon":  # LayerNorm q/k norms with bias, biases, GELU, MHA, full rotary, untied
        model = transformers.PersimmonForCausalLM(transformers.PersimmonConfig(
            hidden_act="gelu", partial_rotary_factor=1.0, rope_theta=25000.0, bos_token_id=None, eos_token_id=None,
            **SIZES))
    elif kind == "mixtral":  # 4 SwiGLU experts, top 2 (megatron's top-k then softmax)
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
            num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, rope_theta=30000.0,
            **dict(SIZES, intermediate_size=32)))
    elif kind.startswith("qwen3_moe"):  # q/k norms; norm_topk_prob false: --moe-router-pre-softmax
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            norm_topk_prob=kind == "qwen3_moe", **SIZES))
    elif kind == "qwen2_moe":  # a shared expert behind a sigmoid gate, q/k/v biases, no renormalisation
        model = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
            num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=48, norm_topk_prob=False, **SIZES))
    else:
        model = transformers.GPTBigCodeForCausalLM(transformers.GPTBigCodeConfig(
            n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=32, multi_query=kind == "bigcode_mqa",
            bos_token_id=None, eos_token_id=None))
    model = model.to(dtype)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n or ".ln_" in n:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(root)
    return root


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("model*.safetensors")):
        out.update(load_file(f))
    return out


def assert_same_tensors(a: Path, b: Path) -> None:
    ta, tb = tensors(a), tensors(b)
    assert sorted(ta) == sorted(tb)
    for k in ta:
        assert ta[k].dtype == tb[k].dtype and ta[k].shape == tb[k].shape, k
        assert torch.equal(ta[k].view(torch.uint8) if ta[k].dtype == torch.bfloat16 else ta[k],
                           tb[k].view(torch.uint8) if tb[k].dtype == torch.bfloat16 else tb[k]), k


def import_mc(src: Path, dst: Path, *topo: str) -> None:
    r = cli("import", src, dst, "--from", "hf", "--to", "megatron-core", *(topo or ("--tp", "1")),
            "--format", "json")
    assert r.exit_code == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["to"] == "megatron-core" and info["iteration"] == 0


KINDS = ["llama", "llama_mqa_tied", "qwen3", "qwen2", "arcee", "arcee_gelu_bias", "starcoder2", "persimmon", "bigcode",
         "bigcode_mqa"]
SHARDINGS = ["dp_reshardable", "fully_reshardable"]


@pytest.mark.parametrize("kind,dtype,sharding", [(k, torch.float32, s) for k in KINDS for s in SHARDINGS]
                         + [("llama", torch.bfloat16, s) for s in SHARDINGS])
def test_hf_megatron_hf_round_trip_is_bit_identical(kind: str, dtype: torch.dtype, sharding: str,
                                                    tmp_path: Path) -> None:
    src = hf_model(tmp_path / "hf", kind, dtype)
    tp = "1" if "mqa" in kind else "2"
    import_mc(src, tmp_path / "mc", "--tp", tp, "--pp", "2", "--dp", "2", "--sharding", sharding)
    assert (tmp_path / "mc" / "latest_checkpointed_iteration.txt").read_text().strip() == "0"
    assert json.loads((tmp_path / "mc" / "iter_0000000" / "metadata.json").read_text())["sharded_backend"] == \
        "torch_dist"
    r = cli("verify", tmp_path / "mc", "--data")
    assert r.exit_code == 0, r.stdout + r.stderr
    r = cli("export", tmp_path / "mc", tmp_path / "back", "--to", "hf", "--format", "json")
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["architecture"] == json.loads((src / "config.json").read_text())["architectures"][0]
    assert_same_tensors(src, tmp_path / "back")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back", dtype=dtype)
    assert back.config.architectures == json.loads((src / "config.json").read_text())["architectures"]


@pytest.mark.parametrize("sharding", SHARDINGS)
def test_mistral_imports_and_exports_back_as_llama(sharding: str, tmp_path: Path) -> None:
    """MistralForCausalLM without a sliding window is Llama's forward with Llama's tensor names: imported, it
    exports as LlamaForCausalLM with the same tensors, bit for bit, and the same logits."""
    src = hf_model(tmp_path / "hf", "mistral")
    import_mc(src, tmp_path / "mc", "--tp", "2", "--dp", "2", "--sharding", sharding)
    r = cli("export", tmp_path / "mc", tmp_path / "back", "--to", "hf", "--format", "json")
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["architecture"] == "LlamaForCausalLM"
    assert_same_tensors(src, tmp_path / "back")
    ids = torch.from_numpy(np.random.default_rng(0).integers(0, 128, (2, 12)))
    with torch.no_grad():
        want = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()(ids).logits
        got = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back", dtype=torch.float32).eval()(ids)
    assert torch.equal(got.logits, want)


@pytest.mark.parametrize("kind,sharding", [("llama3", "dp_reshardable"), ("llama3", "fully_reshardable"),
                                           ("mistral_llama3", "dp_reshardable"), ("qwen3+llama3", "dp_reshardable"),
                                           ("mixtral+llama3", "dp_reshardable"),
                                           ("persimmon+llama3", "fully_reshardable")])
def test_llama3_rope_scaling_round_trips_bit_identical(kind: str, sharding: str, tmp_path: Path) -> None:
    """Llama 3.x's RoPE scaling is megatron-core's --use-rope-scaling with --rope-scaling-factor, in every RoPE
    family: imported, the args record both, and the export gives back every tensor bit for bit and the same
    rope_parameters."""
    src = hf_model(tmp_path / "hf", kind)
    arch = json.loads((src / "config.json").read_text())["architectures"][0]
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    inv = model.model.rotary_emb.inv_freq
    plain = 1.0 / (500000.0 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
    assert torch.equal(inv[:4], plain[:4]) and torch.allclose(inv[5:], plain[5:] / 32)  # kept, divided
    assert plain[4] / 32 < inv[4] < plain[4]  # interpolated: the scaling changes the frequencies in each band
    import_mc(src, tmp_path / "mc", "--tp", "2", "--dp", "2", "--sharding", sharding,
              *(("--ep", "2") if "moe" in arch.lower() or "mixtral" in kind else ()))
    r = cli("inspect", tmp_path / "mc", "--format", "json")
    assert r.exit_code == 0, r.stderr
    model = json.loads(r.stdout)["megatron_model"]  # the one model description, read back from common_state args
    assert model["use_rope_scaling"] is True and model["rope_scaling_factor"] == 32.0 and model["rotary_base"] == \
        500000 and "Llama 3 RoPE scaling x32" in model["text"], model
    r = cli("export", tmp_path / "mc", tmp_path / "back", "--to", "hf", "--format", "json")
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["architecture"] == ("LlamaForCausalLM" if arch == "MistralForCausalLM" else arch)
    assert_same_tensors(src, tmp_path / "back")
    back = json.loads((tmp_path / "back" / "config.json").read_text())
    assert back["rope_parameters"] == json.loads((src / "config.json").read_text())["rope_parameters"]
    assert {k: back["rope_parameters"][k] for k in LLAMA3_ROPE} == LLAMA3_ROPE
    ids = torch.from_numpy(np.random.default_rng(0).integers(0, 128, (2, 12)))
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    with torch.no_grad():
        want = model.eval()(ids).logits
        got = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back", dtype=torch.float32).eval()(ids)
    assert torch.equal(got.logits, want)


@pytest.mark.parametrize("change,needles", [
    ({"low_freq_factor": 2.0}, ["rope_parameters.low_freq_factor is 2.0", "fixes it to 1.0"]),
    ({"high_freq_factor": 8.0}, ["rope_parameters.high_freq_factor is 8.0", "fixes it to 4.0"]),
    ({"original_max_position_embeddings": 4096}, ["rope_parameters.original_max_position_embeddings is 4096",
                                                  "fixes it to 8192"]),
    ({"original_max_position_embeddings": None}, ["original_max_position_embeddings (absent: "
                                                  "max_position_embeddings) is 131072"]),
    ({"factor": -1.0}, ["rope_parameters.factor is -1.0", "not a positive number"]),
    ({"factor": "x"}, ["rope_parameters.factor is 'x'"]),
    ({"rope_type": "yarn"}, ["rope_parameters.rope_type 'yarn'", "no megatron-core GPT form"]),
    ({"rope_type": "linear"}, ["rope_parameters.rope_type 'linear'"]),
    ({"rope_type": "dynamic"}, ["rope_parameters.rope_type 'dynamic'"]),
    ({"top": {"original_max_position_embeddings": 4096}}, ["original_max_position_embeddings is 4096"]),
    ({"top": {"rope_scaling": dict(LLAMA3_ROPE, low_freq_factor=2.0)}}, ["rope_scaling.low_freq_factor is 2.0"]),
])
def test_llama3_rope_that_megatron_core_does_not_compute_is_refused(change: dict, needles: list[str],
                                                                    tmp_path: Path) -> None:
    """megatron-core fixes low_freq_factor 1, high_freq_factor 4 and 8192 original positions; any other value
    (or a key transformers reads in their place) computes other frequencies: refused naming the key."""
    src = hf_model(tmp_path / "hf", "llama3")
    top = change.pop("top", {})
    rope = {k: v for k, v in {**LLAMA3_ROPE, **change}.items() if v is not None}
    _edit_config(src, rope_parameters=rope, **top)
    assert_error_line(cli("import", src, tmp_path / "out", "--from", "hf", "--to", "megatron-core"), 2, *needles)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("window", [4096, "absent"])
def test_mistral_with_a_sliding_window_is_refused(window: object, tmp_path: Path) -> None:
    """A 4096-token window (Mistral's default when the key is absent) has no megatron-core GPT form here."""
    src = hf_model(tmp_path / "hf", "mistral")
    cfg = json.loads((src / "config.json").read_text())
    if window == "absent":
        cfg.pop("sliding_window")
    else:
        cfg["sliding_window"] = window
    (src / "config.json").write_text(json.dumps(cfg))
    assert_error_line(cli("import", src, tmp_path / "out", "--from", "hf", "--to", "megatron-core", "--tp", "1"), 2,
                      "sliding-window attention")
    assert not (tmp_path / "out").exists()


MOE_KINDS = ["mixtral", "qwen3_moe", "qwen3_moe_presoftmax", "qwen2_moe"]


@pytest.mark.parametrize("kind", MOE_KINDS)
@pytest.mark.parametrize("topo,sharding", [(("--tp", "1", "--ep", "2", "--dp", "2"), "dp_reshardable"),
                                           (("--tp", "2", "--ep", "2", "--pp", "2"), "dp_reshardable"),
                                           (("--tp", "1", "--ep", "4", "--dp", "4"), "fully_reshardable")])
def test_moe_hf_megatron_hf_round_trip_is_bit_identical(kind: str, topo: tuple[str, ...], sharding: str,
                                                        tmp_path: Path) -> None:
    src = hf_model(tmp_path / "hf", kind)
    import_mc(src, tmp_path / "mc", *topo, "--sharding", sharding)
    r = cli("verify", tmp_path / "mc", "--data")
    assert r.exit_code == 0, r.stdout + r.stderr
    r = cli("export", tmp_path / "mc", tmp_path / "back", "--to", "hf", "--format", "json")
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["architecture"] == json.loads((src / "config.json").read_text())["architectures"][0]
    assert_same_tensors(src, tmp_path / "back")
    cfg, back = (json.loads((d / "config.json").read_text()) for d in (src, tmp_path / "back"))
    assert back.get("norm_topk_prob", True) == cfg.get("norm_topk_prob", True)


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe", "qwen2_moe"])
@pytest.mark.parametrize("topo", [("--tp", "2", "--ep", "1", "--etp", "2", "--pp", "2"), ("--tp", "1", "--ep", "1",
                                                                                       "--dp", "2")])
@pytest.mark.parametrize("sharding", SHARDINGS)
def test_moe_at_ep1_with_expert_tp_equal_tp_round_trips(kind: str, topo: tuple[str, ...], sharding: str,
                                                          tmp_path: Path) -> None:
    """EP 1 with expert TP = TP: the experts in the dense buffers and the dense optimizer (no chained_ pair),
    each expert split over TP as the dense MLP (Qwen2-MoE: its shared expert after them); import -> export is
    bit-identical and verify --data passes."""
    src = hf_model(tmp_path / "hf", kind)
    import_mc(src, tmp_path / "mc", *topo, "--sharding", sharding)
    keys = json.loads(cli("inspect", tmp_path / "mc", "--format", "json").stdout or "{}")
    assert "chained_" not in json.dumps(keys)
    r = cli("verify", tmp_path / "mc", "--data")
    assert r.exit_code == 0, r.stdout + r.stderr
    r = cli("export", tmp_path / "mc", tmp_path / "back", "--to", "hf")
    assert r.exit_code == 0, r.stderr
    assert_same_tensors(src, tmp_path / "back")


@pytest.mark.parametrize("fixture", ["pair_mixtral_tp2_ep1_dp_reshardable", "pair_qwen2moe_tp2_ep1_dp_reshardable"])
def test_ep1_import_is_megatron_cores_own_layout(fixture: str, tmp_path: Path) -> None:
    """megatron-core's own save at TP 2, EP 1, expert TP 2 (``pair_mixtral_tp2_ep1``: the experts in the dense
    buffer after the router, no expert optimizer; ``pair_qwen2moe_tp2_ep1``: and the gated shared expert after
    them) -> HF -> import at the same topology: the same keys and global
    shapes as megatron-core's dp_reshardable and fully_reshardable saves, the same model tensors and expert chunk
    boxes (each TP rank's gate and up halves), and every parameter's fp32 master where megatron-core's buffers
    hold it (``params_in_bucket``; rounded to the bf16 weight, which is what a fresh import's master is). The
    alignment gaps are left out: megatron-core's hold uninitialised memory (63 nonzero bf16 values in one gap)."""
    import torch as _torch

    from gtp_format.reader.boxes import BoxReader
    from gtp_format.reader.checkpoint import open_checkpoint

    pair = MEGATRON / fixture
    r = cli("export", pair, tmp_path / "hf", "--to", "hf")
    assert r.exit_code == 0, r.stderr
    for sharding, theirs_dir in (("dp_reshardable", pair), ("fully_reshardable", Path(f"{pair}_fully_reshardable"))):
        import_mc(tmp_path / "hf", tmp_path / sharding, "--tp", "2", "--ep", "1", "--etp", "2", "--sharding", sharding)
        ours, theirs = open_checkpoint(tmp_path / sharding), open_checkpoint(theirs_dir)
        want = {k: e.shape for k, e in theirs.entries.items() if not k.startswith("rng_state")}
        assert {k: e.shape for k, e in ours.entries.items()} == want
        ra, rb = BoxReader(ours), BoxReader(theirs)
        for k, e in theirs.entries.items():
            if e.kind != "tensor" or k.startswith("optimizer") or e.shape is None:
                continue
            if sharding == "dp_reshardable":  # (fully_reshardable's chunks are row blocks: no topology)
                assert sorted((c.offsets, c.sizes) for c in ours.entries[k].chunks) == \
                    sorted((c.offsets, c.sizes) for c in e.chunks), k
            box = ((0,) * len(e.shape), e.shape)
            assert ra.read_box(k, *box).tobytes() == rb.read_box(k, *box).tobytes(), k
    expected = json.loads((pair / "expected.json").read_text())
    ours, theirs = open_checkpoint(tmp_path / "dp_reshardable"), open_checkpoint(pair)
    ra, rb = BoxReader(ours), BoxReader(theirs)
    checked = shared = 0
    for rec in expected["keys"]:
        if not rec.get("params_in_bucket") or not rec["key"].endswith(".param"):
            continue
        shape = theirs.entries[rec["key"]].shape
        a, b = (_torch.from_numpy(rd.read_box(rec["key"], (0,), shape).copy()).to(_torch.bfloat16) for rd in (ra, rb))
        for p in rec["params_in_bucket"]:
            assert _torch.equal(a[p["start"]:p["end"]], b[p["start"]:p["end"]]), (rec["key"], p["param"])
            checked += ".local_experts." in p["param"]
            shared += ".shared_experts." in p["param"]
    assert checked == 2 * 4 * 2  # 2 TP ranks x 4 experts x (linear_fc1, linear_fc2)
    assert shared == (2 * 3 if "qwen2moe" in fixture else 0)  # 2 TP ranks x (gate_weight, linear_fc1, linear_fc2)


def _megatron(ckpt: Path, out: Path, topo: tuple[int, int, int], tokens: Path) -> list[dict[str, np.ndarray]]:
    return _megatron_at(ckpt, out, topo, tokens, 0)


def _megatron_at(ckpt: Path, out: Path, topo: tuple[int, int, int], tokens: Path, it: int
                 ) -> list[dict[str, np.ndarray]]:
    out.mkdir()
    r = subprocess.run([str(MEGATRON_PY), str(FORWARD), str(ckpt / f"iter_{it:07d}"), str(out), *map(str, topo),
                        str(tokens)], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    ranks = []
    for i in range(topo[0] * topo[1] * topo[2]):
        with np.load(out / f"rank{i}.npz") as z:
            ranks.append({k: z[k] for k in z.files})
    return ranks


def _fresh_optimizer(ranks: list[dict[str, np.ndarray]], tp: int, dp: int, sharding: str, ep: int = 1) -> None:
    """Masters equal to the weights (as multisets: the DP shards of every rank against the params of
    the DP-rank-0 ranks; rank order tp-dp-pp), both Adam moments zero, step 0 (dp_reshardable: one
    value; the helper's CPU workaround leaves AdamW's step at its dummy-init value there, as
    ``test_megatron_load.py`` says)."""
    masters, weights = [], []
    for rank, r in enumerate(ranks):
        assert (r["step"] == 0).all() if sharding == "fully_reshardable" else len(set(r["step"].tolist())) == 1
        opt = sorted((k for k in r if k.startswith("opt.")), key=lambda k: int(k[4:]))
        for i, k in enumerate(opt):  # _optimizer_tensors: per param shard its master, exp_avg, exp_avg_sq
            if i % 3 == 0:
                masters.append(r[k].ravel())
            else:
                np.testing.assert_array_equal(r[k], 0)
        for k, v in r.items():
            # dense weights of the DP-rank-0 ranks; experts (expert TP 1) of each EP rank's expert-DP rank 0
            # (at EP 1 with expert TP = TP the experts are dense parameters: TP-split, replicated over DP)
            expert = ".local_experts." in k and ep > 1
            if expert and (rank % (tp * dp)) // ep or not expert and (rank // tp) % dp:
                continue
            if k.startswith("model."):
                weights.append((v.astype(np.int32) << 16).view(np.float32).ravel() if v.dtype == np.int16
                               else v.ravel())
    assert masters and np.array_equal(np.sort(np.concatenate(masters)), np.sort(np.concatenate(weights)))


@pytest.mark.slow
@pytest.mark.skipif(not MEGATRON_PY.exists(), reason="needs the megatron venv (fixtures/megatron/setup_venv.sh)")
@pytest.mark.parametrize("kind,topo,sharding", [
    ("llama", (2, 1, 2), "dp_reshardable"), ("llama", (2, 1, 1), "fully_reshardable"),
    ("llama_mqa_tied", (1, 1, 2), "dp_reshardable"), ("qwen3", (2, 1, 2), "dp_reshardable"),
    ("qwen3", (2, 1, 1), "fully_reshardable"), ("bigcode", (2, 1, 1), "dp_reshardable"),
    ("bigcode_mqa", (1, 1, 1), "fully_reshardable"), ("llama", (1, 2, 1), "fully_reshardable"),
    ("llama_mqa_tied", (1, 2, 2), "dp_reshardable"), ("qwen2", (2, 1, 2), "dp_reshardable"),
    ("arcee", (2, 1, 1), "fully_reshardable"), ("arcee_gelu_bias", (2, 1, 2), "dp_reshardable"),
    ("starcoder2", (2, 1, 2), "dp_reshardable"), ("mixtral", (1, 1, 2), "dp_reshardable"),
    ("qwen3_moe", (2, 1, 1), "fully_reshardable"), ("qwen3_moe_presoftmax", (1, 1, 2), "dp_reshardable"),
    ("qwen2_moe", (2, 1, 1), "dp_reshardable"), ("persimmon", (2, 1, 2), "dp_reshardable"),
    ("mistral", (2, 1, 2), "dp_reshardable"),
    ("mixtral_ep1", (2, 1, 1), "dp_reshardable"), ("qwen3_moe_ep1", (2, 1, 1), "fully_reshardable"),
    ("mixtral_ep1", (1, 1, 2), "dp_reshardable"), ("qwen2_moe_ep1", (2, 1, 1), "dp_reshardable"),
    ("qwen2_moe_ep1", (2, 1, 1), "fully_reshardable")])
def test_megatron_core_loads_the_import_and_computes_transformers_logits(kind: str, topo: tuple[int, int, int],
                                                                         sharding: str, tmp_path: Path) -> None:
    """``*_ep1``: EP 1 with expert TP = TP, the experts in megatron-core's dense buffers and optimizer."""
    ep1 = kind.endswith("_ep1")
    kind = kind.removesuffix("_ep1")
    src = hf_model(tmp_path / "hf", kind)
    ep = 1 if ep1 else 2 if "moe" in kind or kind == "mixtral" else 1  # EP 2 within the TP x DP ranks
    import_mc(src, tmp_path / "mc", "--tp", str(topo[0]), "--pp", str(topo[1]), "--dp", str(topo[2]),
              "--sharding", sharding, *(("--ep", str(ep)) if ep > 1 else ()),
              *(("--ep", "1", "--etp", str(topo[0])) if ep1 else ()))
    ids = np.random.default_rng(0).integers(0, 128, (2, 12))
    np.save(tmp_path / "tokens.npy", ids)
    ranks = _megatron(tmp_path / "mc", tmp_path / "out", topo, tmp_path / "tokens.npy")
    _fresh_optimizer(ranks, topo[0], topo[2], sharding, ep)
    if topo[1] == 1:
        model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
        with torch.no_grad():
            want = model(torch.from_numpy(ids)).logits.numpy()
        got = np.load(tmp_path / "out" / "logits.npy")
        assert got.shape == want.shape and np.abs(got - want).max() < TOL, np.abs(got - want).max()


@pytest.mark.slow
@pytest.mark.skipif(not MEGATRON_PY.exists(), reason="needs the megatron venv (fixtures/megatron/setup_venv.sh)")
@pytest.mark.parametrize("kind", ["llama3", "qwen3+llama3", "qwen2+llama3", "arcee+llama3", "starcoder2+llama3",
                                  "persimmon+llama3", "mixtral+llama3", "qwen3_moe+llama3", "qwen2_moe+llama3"])
def test_megatron_core_computes_llama3_rope_scaling_as_transformers(kind: str, tmp_path: Path) -> None:
    """The import of a model with Llama 3.x's scaling, of each RoPE family, loaded by megatron-core's own loader
    into a GPTModel built from the checkpoint's args (``rope_scaling=args.use_rope_scaling``,
    ``rope_scaling_factor=args.rope_scaling_factor``), computes transformers' logits within 1e-5, over a sequence
    long enough that plain RoPE would not."""
    src = hf_model(tmp_path / "hf", kind)
    moe = "moe" in kind or "mixtral" in kind
    import_mc(src, tmp_path / "mc", "--tp", "2", "--dp", "1", "--sharding", "dp_reshardable",
              *(("--ep", "2") if moe else ()))
    ids = np.random.default_rng(0).integers(0, 128, (2, 256))
    np.save(tmp_path / "tokens.npy", ids)
    _megatron(tmp_path / "mc", tmp_path / "out", (2, 1, 1), tmp_path / "tokens.npy")
    got = np.load(tmp_path / "out" / "logits.npy")
    with torch.no_grad():
        want = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()(
            torch.from_numpy(ids)).logits.numpy()
        cfg = json.loads((src / "config.json").read_text())
        cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 500000.0}
        (src / "config.json").write_text(json.dumps(cfg))
        plain = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()(
            torch.from_numpy(ids)).logits.numpy()
    err, unscaled = np.abs(got - want).max(), np.abs(plain - want).max()
    assert got.shape == want.shape and err < TOL and unscaled > 10 * TOL, (err, unscaled)  # 2e-7 and 2e-4


@pytest.mark.slow
def test_megatron_core_hf_megatron_core_at_another_topology(tmp_path: Path) -> None:
    """A genuine megatron-core save (tp2 dp2, GELU, LayerNorm, biases, learned positions: GPTBigCode) ->
    HF -> megatron-core at tp1 pp2 dp2 -> HF: the two HF folders hold the same bits."""
    r = cli("export", MEGATRON / "pair_tp2_dp2_dp_reshardable", tmp_path / "hf1", "--to", "hf")
    assert r.exit_code == 0, r.stderr
    import_mc(tmp_path / "hf1", tmp_path / "mc", "--tp", "1", "--pp", "2", "--dp", "2")  # dp_reshardable
    r = cli("export", tmp_path / "mc", tmp_path / "hf2", "--to", "hf")
    assert r.exit_code == 0, r.stderr
    assert_same_tensors(tmp_path / "hf1", tmp_path / "hf2")
    if MEGATRON_PY.exists():  # and megatron-core loads it at that topology
        np.save(tmp_path / "tokens.npy", np.zeros((1, 4), dtype=np.int64))
        _fresh_optimizer(_megatron(tmp_path / "mc", tmp_path / "out", (1, 2, 2), tmp_path / "tokens.npy"), 1, 2,
                         "dp_reshardable")


@pytest.mark.parametrize("fixture", ["pair_mixtral_ep2_dp_reshardable", "pair_qwen2moe_ep2_dp_reshardable"])
def test_genuine_moe_hf_megatron_core_at_another_topology(fixture: str, tmp_path: Path) -> None:
    """megatron-core's own Mixtral-style and Qwen2-MoE-style saves (bf16, EP 2 over DP 2) -> HF ->
    megatron-core at EP 4 x DP 4 and at TP 2 x EP 2 -> HF: every HF folder holds the same bits."""
    r = cli("export", MEGATRON / fixture, tmp_path / "hf1", "--to", "hf")
    assert r.exit_code == 0, r.stderr
    for i, topo in enumerate((("--ep", "4", "--dp", "4"), ("--tp", "2", "--ep", "2"))):
        import_mc(tmp_path / "hf1", tmp_path / f"mc{i}", *topo)
        r = cli("export", tmp_path / f"mc{i}", tmp_path / f"hf{i + 2}", "--to", "hf")
        assert r.exit_code == 0, r.stderr
        assert_same_tensors(tmp_path / "hf1", tmp_path / f"hf{i + 2}")


def _carried(ranks: list[dict[str, np.ndarray]], hf: Path, sharding: str, step: float) -> None:
    """At TP 1 every element of the distributed optimizer's state is on exactly one rank: the masters and
    both moments megatron-core loaded, as multisets, are the HF optimizer files' (and ``step`` is the
    run's, fully_reshardable; see :func:`_fresh_optimizer` for dp_reshardable's)."""
    got: list[list[np.ndarray]] = [[], [], []]
    for r in ranks:
        if sharding == "fully_reshardable":
            assert (r["step"] == step).all(), r["step"]
        opt = sorted((k for k in r if k.startswith("opt.")), key=lambda k: int(k[4:]))
        for i, k in enumerate(opt):
            got[i % 3].append(r[k].ravel())
    want = tensors(hf)
    opt = {k: v for f in sorted(hf.glob("optimizer*.safetensors")) for k, v in load_file(f).items()}
    assert want and opt
    for i, state in enumerate(("param", "exp_avg", "exp_avg_sq")):
        mine = np.sort(np.concatenate([v.numpy().ravel() for k, v in opt.items()
                                       if k.startswith(f"optimizer.state.{state}.")]))
        assert np.array_equal(np.sort(np.concatenate(got[i])), mine), state
        assert i == 0 or np.abs(mine).max() > 0  # genuine moments, not zeros


MOE_PAIRS = ["pair_mixtral_ep2_dp_reshardable", "pair_qwen2moe_ep2_dp_reshardable",
             "pair_mixtral_tp2_ep1_dp_reshardable",  # EP 1, expert TP = TP: the experts in the dense optimizer
             "pair_qwen2moe_tp2_ep1_dp_reshardable"]  # and the shared expert after them


def _same_schedule(genuine: Path, imported: Path) -> None:
    """The import's ``common_state`` carries megatron-core's own scheduler state (its 10 fields, the values of
    the genuine save: cosine decay at num_steps 16 or 8, the global batch times 2 iterations), the data position
    (as many samples) and param groups whose ``max_lr`` / ``min_lr`` are the schedule's (what megatron-core pairs
    saved and live groups by)."""
    from gtp_format.megatron.topology import common_state
    from gtp_format.reader.checkpoint import open_checkpoint
    from gtp_format.reader.inert_object import InertObject

    theirs, ours = (common_state(open_checkpoint(d)) for d in (genuine, imported))
    assert theirs is not None and ours is not None
    want = theirs["opt_param_scheduler"]
    assert ours["opt_param_scheduler"] == want and want["num_steps"] > 0 and want["lr_decay_style"] == "cosine"
    args = ours["args"]
    fields = args.fields() if isinstance(args, InertObject) else args
    assert fields["consumed_train_samples"] == want["num_steps"] and fields["lr"] == want["max_lr"] and \
        fields["min_lr"] == want["min_lr"]


@pytest.mark.parametrize("fixture", ["pair_llama_tp2_dp2_dp_reshardable", "pair_qk_layernorm_tp2_dp_reshardable",
                                     "pair_llama3_rope_tp2_dp_reshardable", *MOE_PAIRS])
def test_optimizer_state_megatron_hf_megatron_core_is_bit_identical(fixture: str, tmp_path: Path) -> None:
    """A genuine megatron-core save (bf16, iteration 2, Adam step 2) -> ``export --to hf --optimizer`` ->
    import at another topology carries the fp32 masters and both moments and the step -> export again:
    the same model and optimizer files, byte for byte; megatron-core's loader loads the carried state.
    MoE (Mixtral- and Qwen2-MoE-style, EP 2): megatron-core's chained dense + expert optimizer, each
    expert's state under the expert's HF names, back into the chained pair at EP 2 x DP 4 and TP 2 x EP 2."""
    r = cli("export", MEGATRON / fixture, tmp_path / "hf1", "--to", "hf", "--optimizer")
    assert r.exit_code == 0, r.stderr
    moe = fixture in MOE_PAIRS
    topos = [("--dp", "4", *(("--ep", "2") if moe else ()), "--sharding", "dp_reshardable"),
             ("--tp", "2", *(("--ep", "2") if moe else ("--pp", "1")), "--sharding", "fully_reshardable")]
    for i, topo in enumerate(topos):
        r = cli("import", tmp_path / "hf1", tmp_path / f"mc{i}", "--from", "hf", "--to", "megatron-core", *topo,
                "--format", "json")
        assert r.exit_code == 0, r.stderr
        info = json.loads(r.stdout)
        assert info["iteration"] == 2 and info["optimizer"] == "carried (step 2, lr schedule)", info
        assert (tmp_path / f"mc{i}" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
        _same_schedule(MEGATRON / fixture, tmp_path / f"mc{i}")
    r = cli("export", tmp_path / "mc0", tmp_path / "hf2", "--to", "hf", "--optimizer")
    assert r.exit_code == 0, r.stderr
    for f in sorted(p.name for p in (tmp_path / "hf1").glob("*.safetensors")):
        assert (tmp_path / "hf1" / f).read_bytes() == (tmp_path / "hf2" / f).read_bytes(), f
    r = cli("import", tmp_path / "hf1", tmp_path / "fresh", "--from", "hf", "--to", "megatron-core", "--tp", "2",
            *(("--ep", "2") if moe else ()), "--no-optimizer", "--format", "json")
    assert r.exit_code == 0 and json.loads(r.stdout)["iteration"] == 0, r.stderr
    if MEGATRON_PY.exists():  # megatron-core loads the carried state (TP 1: each element once)
        np.save(tmp_path / "tokens.npy", np.zeros((1, 4), dtype=np.int64))
        r = cli("import", tmp_path / "hf1", tmp_path / "mc2", "--from", "hf", "--to", "megatron-core", "--dp", "2",
                *(("--ep", "2") if moe else ()), "--sharding", "fully_reshardable")
        assert r.exit_code == 0, r.stderr
        for ckpt, dp, sharding in ((tmp_path / "mc2", 2, "fully_reshardable"),
                                   (tmp_path / "mc0", 4, "dp_reshardable")):
            ranks = _megatron_at(ckpt, tmp_path / f"out_{sharding}", (1, 1, dp), tmp_path / "tokens.npy", 2)
            _carried(ranks, tmp_path / "hf1", sharding, 2.0)


@pytest.mark.parametrize("pair", MOE_PAIRS)
def test_moe_optimizer_export_equals_megatrons_own_fully_reshardable_save(pair: str, tmp_path: Path) -> None:
    """``export --to hf --optimizer`` of megatron-core's dp_reshardable MoE save (the chained dense + expert
    optimizer) holds, under each HF name, the rows of megatron-core's own fully_reshardable save of the same
    state (``optimizer.state.<state>.<key>`` at the parameter's layer, and expert), bit for bit: the
    router, each expert's gate (w1 / gate_proj), up and down rows, the shared expert and its gate."""
    from gtp_format.megatron.keys import LAYER
    from gtp_format.reader.boxes import BoxReader
    from gtp_format.reader.checkpoint import open_checkpoint

    r = cli("export", MEGATRON / pair, tmp_path / "hf", "--to", "hf", "--optimizer", "--names", "megatron")
    assert r.exit_code == 0, r.stderr
    opt = load_file(tmp_path / "hf" / "optimizer.safetensors")
    theirs = open_checkpoint(MEGATRON / f"{pair}_fully_reshardable")
    reader = BoxReader(theirs)
    experts, used = 0, set()
    for name, got in opt.items():
        state, param = name[len("optimizer.state."):].split(".", 1)
        parts = param.split(".")
        lead: tuple[int, ...] = ()
        if parts[:2] == ["decoder", "layers"]:
            lead, rest = (int(parts[2]),), parts[3:]
            if rest[:2] == ["mlp", "experts"]:
                lead, rest = (*lead, int(rest[2])), ["mlp", "experts", "experts", *rest[3:]]
                experts += 1
            module = ".".join(rest)
            key = f"optimizer.state.{state}.decoder.layers.{dict(LAYER).get(module, module)}"
        else:
            key = f"optimizer.state.{state}.{param}"
        shape = theirs.entries[key].shape
        assert shape is not None and tuple(shape[len(lead):]) == tuple(got.shape), name
        want = reader.read_box(key, (*lead, *(0,) * (len(shape) - len(lead))), (*(1,) * len(lead), *got.shape))
        assert want.reshape(got.shape).tobytes() == got.numpy().tobytes(), name
        used.add(key)
    assert experts == 3 * 4 * 2  # 3 states x 4 experts x (linear_fc1, linear_fc2), one layer
    if "ep1" in pair:  # and back at EP 1 with expert TP = TP (the dense layout) and again: the same files
        r = cli("export", MEGATRON / pair, tmp_path / "hf1", "--to", "hf", "--optimizer")
        assert r.exit_code == 0, r.stderr
        r = cli("import", tmp_path / "hf1", tmp_path / "mc", "--from", "hf", "--to", "megatron-core", "--tp", "2",
                "--ep", "1", "--etp", "2", "--format", "json")
        assert r.exit_code == 0 and json.loads(r.stdout)["optimizer"] == "carried (step 2, lr schedule)", r.stderr
        r = cli("export", tmp_path / "mc", tmp_path / "hf2", "--to", "hf", "--optimizer")
        assert r.exit_code == 0, r.stderr
        for f in ("model.safetensors", "optimizer.safetensors"):
            assert (tmp_path / "hf1" / f).read_bytes() == (tmp_path / "hf2" / f).read_bytes(), f
    assert used == {k for k in theirs.entries if k.startswith("optimizer.state.")}  # every key of theirs


def test_optimizer_files_without_a_run_state_are_refused(tmp_path: Path) -> None:
    """Moments without megatron-core's Adam step cannot resume: refused naming the field, unless
    --no-optimizer; an optimizer tensor at another shape is refused naming it."""
    r = cli("export", MEGATRON / "pair_llama_tp2_dp2_dp_reshardable", tmp_path / "hf", "--to", "hf", "--optimizer")
    assert r.exit_code == 0, r.stderr
    opt = tmp_path / "hf" / "optimizer.safetensors"
    t = load_file(opt)
    save_file(t, opt, metadata={"format": "pt"})
    base = ["import", tmp_path / "hf", tmp_path / "out", "--from", "hf", "--to", "megatron-core"]
    assert_error_line(cli(*base), 2, "gtp_megatron_run_state", "--no-optimizer")
    t["optimizer.state.exp_avg.model.norm.weight"] = t["optimizer.state.exp_avg.model.norm.weight"][:-1]
    save_file(t, opt, metadata={"gtp_megatron_run_state": '{"iteration":2,"step":2.0}'})
    assert_error_line(cli(*base), 2, "'optimizer.state.exp_avg.model.norm.weight' is [31] float32",
                      "the model implies [32] float32")
    assert not (tmp_path / "out").exists()
    save_file(load_file(opt), opt, metadata={"gtp_megatron_run_state": '{"iteration":2,"step":2.0,"scheduler":'
                                             '{"max_lr":0.001,"min_lr":0.0,"lr_warmup_steps":0,"num_steps":16,'
                                             '"lr_decay_style":"cosine","lr_decay_steps":800,"start_wd":0.01,'
                                             '"end_wd":0.01,"wd_incr_style":"constant","wd_incr_steps":800}}'})
    t = load_file(opt)
    t["optimizer.state.exp_avg.model.norm.weight"] = torch.zeros(32)
    save_file(t, opt, metadata={"gtp_megatron_run_state": '{"iteration":2,"step":2.0,"scheduler":{"max_lr":0.001,'
                                '"min_lr":0.0,"lr_warmup_steps":0,"num_steps":16,"lr_decay_style":"cosine",'
                                '"lr_decay_steps":800,"start_wd":0.01,"end_wd":0.01,"wd_incr_style":"constant",'
                                '"wd_incr_steps":800}}'})
    assert_error_line(cli(*base, "--lr", "3e-4"), 2, "--lr 0.0003 contradicts the carried lr schedule's max_lr 0.001")
    assert_error_line(cli(*base, "--min-lr", "1e-5"), 2, "--min-lr 1e-05 contradicts", "min_lr 0")
    assert not (tmp_path / "out").exists()
    r = cli(*base, "--lr", "1e-3", "--format", "json")  # the schedule's own max_lr agrees
    assert r.exit_code == 0 and json.loads(r.stdout)["optimizer"] == "carried (step 2, lr schedule)", r.stderr
    r = cli(*base[:2], tmp_path / "fresh", *base[3:], "--no-optimizer")
    assert r.exit_code == 0, r.stderr


def _edit_config(folder: Path, **change: object) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(change)
    (folder / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("case,needles", [
    ("class", ["architectures ['GemmaForCausalLM']", "no megatron-core mapping"]),
    ("ffn", ["'model.layers.0.mlp.gate_proj.weight' is [128, 64]", "config.json implies [96, 64]"]),
    ("heads", ["'model.layers.0.self_attn.k_proj.weight' is [32, 64]", "[64, 64]"]),
    ("layers", ["says 1000000000 layers", "holds 21"]),
    ("scaling", ["rope_parameters.low_freq_factor is None", "fixes it to 1.0"]),
    ("act", ["hidden_act 'gelu'", "--swiglu"]),
    ("extra", ["21 tensors", "holds 22"]),
    ("tp", ["--tp 3 does not divide the model's num_attention_heads 4"]),
    ("pp", ["--pp 3", "do not divide the 2 layers"]),
    ("vpp", ["--pp 2 x --vpp 2 = 4 model chunks do not divide the 2 layers"]),
    ("dtype", ["float16", "float32 or bfloat16"]),
])
def test_import_to_megatron_core_refusals(case: str, needles: list[str], tmp_path: Path) -> None:
    src = hf_model(tmp_path / "hf", "llama", torch.float16 if case == "dtype" else torch.float32)
    if case == "class":
        _edit_config(src, architectures=["GemmaForCausalLM"])
    elif case == "ffn":
        _edit_config(src, intermediate_size=96)
    elif case == "heads":
        _edit_config(src, num_key_value_heads=4)
    elif case == "layers":
        _edit_config(src, num_hidden_layers=10**9)
    elif case == "scaling":
        _edit_config(src, rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0})
    elif case == "act":
        _edit_config(src, hidden_act="gelu")
    elif case == "extra":
        t = load_file(src / "model.safetensors")
        t["model.extra.weight"] = torch.zeros(2)
        save_file(t, src / "model.safetensors")
    topo = {"tp": ["--tp", "3"], "pp": ["--pp", "3"], "vpp": ["--pp", "2", "--vpp", "2"]}.get(case, [])
    before = sorted(p.name for p in tmp_path.iterdir())
    assert_error_line(cli("import", src, tmp_path / "out", "--from", "hf", "--to", "megatron-core", *topo), 2,
                      *needles)
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written, SRC untouched


@pytest.mark.parametrize("change,needles", [
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 25000.0, "partial_rotary_factor": 0.5}},
     ["partial_rotary_factor 0.5", "partial rotary"]),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 25000.0}}, ["partial_rotary_factor 0.5"]),  # default
    ({"qk_layernorm": False}, ["qk_layernorm false", "exports as Starcoder2ForCausalLM"]),  # no round trip
])
def test_persimmon_import_refuses_what_megatron_core_does_not_compute(change: dict, needles: list[str],
                                                                      tmp_path: Path) -> None:
    src = hf_model(tmp_path / "hf", "persimmon")
    _edit_config(src, **change)
    assert_error_line(cli("import", src, tmp_path / "out", "--from", "hf", "--to", "megatron-core"), 2, *needles)
    assert not (tmp_path / "out").exists()


def test_import_to_megatron_core_refuses_other_options_and_sharding(tmp_path: Path) -> None:
    src = hf_model(tmp_path / "hf", "llama")
    base = ["import", src, tmp_path / "out", "--from", "hf"]
    assert_error_line(cli(*base, "--to", "megatron-core", "--cp", "2"), 2, "--cp is this runtime's option")
    assert_error_line(cli(*base, "--pp", "2"), 2, "--pp is for --to megatron-core")
    assert_error_line(cli(*base, "--to", "nemo"), 2, "--to 'nemo'")
    assert_error_line(cli(*base, "--to", "megatron-core", "--sharding", "dp_zero_gather_scatter"), 2,
                      "--sharding 'dp_zero_gather_scatter'")
    assert not (tmp_path / "out").exists()


def test_a_dst_created_mid_import_is_refused_and_left_alone(tmp_path: Path) -> None:
    from ckpt_tool.hf.megatron_import import import_megatron

    src = hf_model(tmp_path / "hf", "qwen3")
    out = tmp_path / "out"
    out.mkdir()
    dst = out / "dst"

    def factory(total: int):  # noqa: ANN202 - creates DST (with a file of its own) at the first chunk
        def advance(n: int) -> None:
            if not dst.exists():
                dst.mkdir()
                (dst / "theirs").write_text("keep")
        return advance

    with pytest.raises(FormatError, match="appeared while") as e:
        import_megatron(src, dst, 1, 1, 1, progress=factory)
    assert e.value.exit_code == 2
    assert os.listdir(out) == ["dst"] and os.listdir(dst) == ["theirs"]  # nothing deleted, no work folder left


def sigterm_mid_write_leaves_nothing(out: Path, argv: list[str], at: str) -> None:
    """``ckpt argv`` slowed at ``at`` (a function the write passes through), SIGTERMed once it writes: exit 143,
    one line, and nothing left in ``out`` (the hidden work folder removed)."""
    import signal
    import sys

    from test_writer_faults import SLOW_CKPT

    env = {**os.environ, "PYTHONPATH": str(ROOT), "GTP_TEST_SLOW": "1.0", "GTP_TEST_SLOW_AT": at}
    p = subprocess.Popen([sys.executable, "-c", SLOW_CKPT, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=env)
    assert p.stdout is not None and p.stdout.readline().strip() == "writing"
    assert len(os.listdir(out)) == 1  # the hidden work folder
    p.send_signal(signal.SIGTERM)
    rc = p.wait(timeout=120)
    err = p.stderr.read() if p.stderr else ""
    assert rc == 143 and err.strip().splitlines() == [
        "ckpt: error: terminated (SIGTERM); nothing was written, the partial output was removed"], (rc, err)
    assert os.listdir(out) == []


def test_sigterm_mid_import_removes_the_work_folder(tmp_path: Path) -> None:
    src = hf_model(tmp_path / "hf", "llama")
    out = tmp_path / "out"
    out.mkdir()
    sigterm_mid_write_leaves_nothing(out, ["import", str(src), str(out / "dst"), "--from", "hf", "--to",
                                           "megatron-core", "--tp", "2", "--dp", "2", "--workers", "1"],
                                     "ckpt_tool.hf.megatron_import:view_rows")


@pytest.mark.parametrize("case", ["export_moe_optimizer", "import_ep1_dense_experts", "reshard_ep1_to_chained"])
def test_sigterm_mid_moe_write_removes_the_work_folder(case: str, tmp_path: Path) -> None:
    """The MoE write paths: ``export --to hf --optimizer`` of megatron-core's chained optimizer, the import at
    EP 1 with expert TP = TP (experts in the dense buffers), and ``ckpt reshard`` from that layout to the chained
    pair: SIGTERM mid-write leaves nothing."""
    out = tmp_path / "out"
    out.mkdir()
    if case == "export_moe_optimizer":
        argv = ["export", str(MEGATRON / "pair_mixtral_ep2_dp_reshardable"), str(out / "dst"), "--to", "hf",
                "--optimizer", "--workers", "1"]
        at = "ckpt_tool.copying.engine:chunk_data"
    elif case == "reshard_ep1_to_chained":
        argv = ["reshard", str(MEGATRON / "pair_qwen2moe_tp2_ep1_dp_reshardable"), str(out / "dst"), "--tp", "1",
                "--dp", "2", "--ep", "2", "--etp", "1", "--workers", "1"]
        at = "ckpt_tool.copying.engine:chunk_data"
    else:
        src = hf_model(tmp_path / "hf", "mixtral")
        argv = ["import", str(src), str(out / "dst"), "--from", "hf", "--to", "megatron-core", "--tp", "2", "--ep",
                "1", "--etp", "2", "--workers", "1"]
        at = "ckpt_tool.hf.megatron_import:view_rows"
    sigterm_mid_write_leaves_nothing(out, argv, at)


def test_import_written_as_many_runs_equals_the_import_in_one_run_per_file(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Files cut into as many runs as their chunks allow (two threads, each run at its place, the HF rows asked
    for ahead) hold the bytes the one-run-per-file import writes (the serialization ids drawn in the same order);
    ``verify --data`` passes."""
    from ckpt_tool.hf.megatron_import import import_megatron
    from gtp_format.writer import torch_blob

    src = hf_model(tmp_path / "hf", "llama")
    out = {}
    for tag, run_bytes in (("one", 1 << 40), ("runs", 1)):
        ids = iter(range(10**6))
        monkeypatch.setattr(torch_blob, "new_serialization_id", lambda ids=ids: f"{next(ids):040d}")
        got = import_megatron(src, tmp_path / tag, 2, 1, 2, workers=2, max_memory=8 << 20, run_bytes=run_bytes)
        assert got["threads"] >= 2
        out[tag] = tmp_path / tag / "iter_0000000"
    names = sorted(p.name for p in out["one"].iterdir())
    assert names == sorted(p.name for p in out["runs"].iterdir())
    for n in names:
        assert (out["runs"] / n).read_bytes() == (out["one"] / n).read_bytes(), n
    cli("verify", str(tmp_path / "runs"), "--data")


@pytest.mark.parametrize("sharding", ["dp_reshardable", "fully_reshardable"])
def test_no_thread_buffer_of_the_import_is_larger_than_a_chunk(sharding: str, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Each writing thread's reused buffers (rows read, a row-parallel TP part's columns) are at most one chunk:
    the whole rows of a TP part are read in blocks, so a thread holds its four chunks of ``--max-memory``
    (hidden 1024 at a 2 MiB chunk: a TP 2 part of ``linear_proj`` is a whole chunk, its whole rows two)."""
    import sys

    from ckpt_tool.hf import megatron_import
    from gtp_format.reader.boxes import Buffer

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_hf_megatron import make_hf, parse_args

    make_hf(tmp_path / "hf", parse_args(["--gb", "0.2", "--vocab", "512"]))
    asked: list[int] = []

    class Counted(Buffer):
        def get(self, n: int) -> np.ndarray:
            asked.append(n)
            return super().get(n)

    monkeypatch.setattr(megatron_import, "Buffer", Counted)
    got = megatron_import.import_megatron(tmp_path / "hf", tmp_path / "mc", 2, 1, 2, sharding=sharding, workers=2,
                                          max_memory=16 << 20)
    assert got["chunk_bytes"] == 2 << 20 and asked
    assert max(asked) <= got["chunk_bytes"], max(asked)
    cli("verify", str(tmp_path / "mc"), "--data")
