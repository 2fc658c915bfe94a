"""Weights-only exports of genuine megatron-core checkpoints, whatever their optimizer sharding, and
the GPTBigCode export checked against megatron-core's own forward.

``--to hf`` (Megatron names) and ``--to torch`` read model keys only, so ``fully_reshardable``,
``dp_zero_gather_scatter`` and model-only checkpoints export as ``dp_reshardable`` ones do. Every
exported tensor must equal ``ckpt show`` of the same key (the stacked ``decoder.layers.*`` key at
the layer's index), and the torch file PyTorch's own ``dcp_to_torch_save``. With ``--num-heads``
the export is a ``GPTBigCodeForCausalLM`` folder whose transformers logits must equal megatron-core
0.19.2's forward on the same weights and tokens (the megatron venv, ``fixtures/megatron/_venv``;
skipped cleanly without it).
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
from safetensors.torch import load_file

from gtp_format.megatron.view import module_params
from gtp_format.model import TENSOR
from gtp_format.reader.checkpoint import open_checkpoint

REPO = Path(__file__).resolve().parents[2]
MEGATRON = REPO / "fixtures" / "megatron"
MEGATRON_PY = MEGATRON / "_venv" / "bin" / "python"
SHARDINGS = ["tp2_dp2_dp_reshardable", "pp2_dp2_dp_reshardable", "dp2_fully_reshardable",
             "dp2_dp_zero_gather_scatter", "pair_tp2_dp2_dp_reshardable_fully_reshardable",
             "pair_fp32norm_dp2_dp_reshardable"]  # the last: two buffers, its layernorms fp32


def _shown(src: Path, key: str) -> torch.Tensor:
    r = cli("show", src, key, "--values", "--format", "json")
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    return torch.tensor(doc["values"], dtype=torch.float64).reshape(doc["global_shape"])


def _assert_equals_show(src: Path, exported: dict[str, torch.Tensor]) -> None:
    ckpt = open_checkpoint(src)
    params = module_params(ckpt)
    assert set(exported) == {name for name, _, _ in params}
    shown: dict[str, torch.Tensor] = {}
    for name, key, layer in params:
        full = shown.setdefault(key, _shown(src, key))
        want = full[layer] if layer is not None else full
        got = exported[name]
        dtype = ckpt.entries[key].dtype
        assert dtype is not None and got.dtype == dtype.torch, name  # bf16, or fp32 where megatron kept it so
        assert torch.equal(got.double(), want), name  # bf16 / fp32 -> f64 is exact


@pytest.mark.parametrize("name", SHARDINGS)
def test_weights_only_hf_export_equals_show(name: str, tmp_path: Path) -> None:
    out = tmp_path / "hf"
    r = cli("export", MEGATRON / name, out, "--to", "hf", "--names", "megatron", "--format", "json")
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["names"] == "megatron"
    assert sorted(p.name for p in out.iterdir()) == ["gtp_attestation.json", "model.safetensors"]
    _assert_equals_show(MEGATRON / name, load_file(out / "model.safetensors"))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["dp2_fully_reshardable", "dp2_dp_zero_gather_scatter",
                                  "pair_fp32norm_dp2_dp_reshardable", "pair_vpp_pp2_dp2_dp_reshardable"])
def test_weights_only_torch_export_equals_pytorch_dcp(name: str, tmp_path: Path) -> None:
    """Every tensor key, as PyTorch DCP itself loads it; the non-tensor objects that come along are the
    checkpoint's own byte entries (those a weights-only ``torch.load`` refuses are left out and named)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    r = cli("export", MEGATRON / name, tmp_path / "ours.pt", "--to", "torch")
    assert r.exit_code == 0, r.stderr
    folder = MEGATRON / name / "iter_0000002"
    md = dcp.FileSystemReader(folder).read_metadata()
    theirs = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype) for k, v in md.state_dict_metadata.items()
              if isinstance(v, TensorStorageMetadata)}
    dcp.load(theirs, storage_reader=dcp.FileSystemReader(folder), no_dist=True)
    ours = torch.load(tmp_path / "ours.pt", weights_only=True)
    tensors = {k for k, v in ours.items() if isinstance(v, torch.Tensor)}
    assert tensors == theirs.keys() and any(k.startswith("decoder.layers.") for k in ours)
    # the rest are the checkpoint's byte objects that weights_only decodes, under their own keys
    assert set(ours) - tensors <= set(md.state_dict_metadata) - set(theirs)
    for k in tensors:
        assert ours[k].dtype == theirs[k].dtype and torch.equal(ours[k].view(torch.uint8),
                                                               theirs[k].view(torch.uint8)), k


def test_model_only_checkpoint_exports(tmp_path: Path) -> None:
    """A checkpoint with model keys and nothing else, saved by PyTorch DCP itself."""
    import torch.distributed.checkpoint as dcp

    src = MEGATRON / "dp2_dp_zero_gather_scatter"
    ckpt = open_checkpoint(src)
    keys = {k for _, k, _ in module_params(ckpt)}
    state = {k: _shown(src, k).to(torch.bfloat16) for k in sorted(keys)}
    folder = tmp_path / "model_only" / "iter_0000002"
    dcp.save(state, checkpoint_id=folder, no_dist=True)
    (tmp_path / "model_only" / "latest_checkpointed_iteration.txt").write_text("2")
    r = cli("export", tmp_path / "model_only", tmp_path / "hf", "--to", "hf", "--names", "megatron")
    assert r.exit_code == 0, r.stderr
    _assert_equals_show(src, load_file(tmp_path / "hf" / "model.safetensors"))
    # no args recorded: the head count is the one field a flag fills; the assumed defaults are reported
    r = cli("export", tmp_path / "model_only", tmp_path / "hf2", "--to", "hf")
    assert_error_line(r, 2, "do not record num_attention_heads", "--num-heads")
    r = cli("export", tmp_path / "model_only", tmp_path / "hf2", "--to", "hf", "--num-heads", "4", "--format", "json")
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["architecture"] == "GPTBigCodeForCausalLM" and any("GELU" in a for a in doc["assumed"])
    r = cli("export", tmp_path / "model_only", tmp_path / "hf3", "--to", "hf", "--num-heads", "5")
    assert_error_line(r, 2, "--num-heads 5", "linear_qkv")


@pytest.mark.slow
@pytest.mark.skipif(not MEGATRON_PY.exists(), reason="needs the megatron venv (fixtures/megatron/setup_venv.sh)")
@pytest.mark.parametrize("name", ["tp2_dp2_dp_reshardable", "dp2_fully_reshardable", "pp2_dp2_dp_reshardable"])
def test_gpt_bigcode_export_matches_megatron_cores_forward(name: str, tmp_path: Path) -> None:
    os.environ["HF_HUB_OFFLINE"] = "1"
    transformers = pytest.importorskip("transformers")
    src, hf, raw = MEGATRON / name, tmp_path / "hf", tmp_path / "raw"
    r = cli("export", src, hf, "--to", "hf", "--format", "json")  # no model flag: the args record the heads
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["architecture"] == "GPTBigCodeForCausalLM"
    assert cli("export", src, raw, "--to", "hf", "--names", "megatron").exit_code == 0
    np.savez(tmp_path / "w.npz", **{k: v.float().numpy() for k, v in load_file(raw / "model.safetensors").items()})
    tokens = np.random.default_rng(3).integers(0, 128, (2, 32)).astype(np.int64)
    np.save(tmp_path / "tokens.npy", tokens)
    out = subprocess.run([str(MEGATRON_PY), str(REPO / "tests" / "helpers" / "megatron_logits.py"),
                          str(tmp_path / "w.npz"), str(tmp_path / "tokens.npy"), str(tmp_path / "meg.npy"), "4"],
                         capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    want = torch.from_numpy(np.load(tmp_path / "meg.npy"))
    model = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    assert type(model).__name__ == "GPTBigCodeForCausalLM" and model.config.tie_word_embeddings
    with torch.no_grad():
        got = model(torch.from_numpy(tokens)).logits
    assert got.shape == want.shape == (2, 32, 128)
    err = (got - want).abs().max().item()
    assert err <= 1e-5 and want.abs().max().item() > 0.05, err


def test_megatron_hf_head_count_comes_from_the_args_and_optimizer_its_keys(tmp_path: Path) -> None:
    """The checkpoint records num_attention_heads=4: a contradicting --num-heads is refused (it once
    exited 0 with a model whose logits were 0.1 off), an agreeing one is accepted."""
    r = cli("export", MEGATRON / "dp2_fully_reshardable", tmp_path / "x", "--to", "hf", "--num-heads", "5")
    assert_error_line(r, 2, "--num-heads 5 disagrees", "num_attention_heads=4")
    r = cli("export", MEGATRON / "dp2_fully_reshardable", tmp_path / "x", "--to", "hf", "--num-heads", "8")
    assert_error_line(r, 2, "--num-heads 8 disagrees")
    assert not list(tmp_path.iterdir())
    r = cli("export", MEGATRON / "dp2_fully_reshardable", tmp_path / "y", "--to", "hf", "--num-heads", "4")
    assert r.exit_code == 0, r.stderr
    assert json.loads((tmp_path / "y" / "config.json").read_text())["n_head"] == 4
    r = cli("export", MEGATRON / "dp2_fully_reshardable", tmp_path / "x", "--to", "hf", "--optimizer")
    assert r.exit_code == 0, r.stderr  # its per-parameter optimizer keys (tests/cli/test_megatron_fr_optimizer.py)
    assert (tmp_path / "x" / "optimizer.safetensors").exists()


def test_megatron_moe_is_refused_saying_why(tmp_path: Path) -> None:
    """The MoE fixture (router, 4 experts, EP 2) has no transformers class: refused in one line that
    names the reason, with or without --num-heads, before anything is written."""
    src = MEGATRON / "moe_ep2_dp4_dp_reshardable"
    for extra in (["--num-heads", "4"], ["--names", "hf"]):
        r = cli("export", src, tmp_path / "x", "--to", "hf", *extra)
        assert_error_line(r, 2, "MoE GPT", "4 experts", "learned absolute positions", "gated GLU experts",
                          "--names megatron")
    assert not list(tmp_path.iterdir())


def test_no_transformers_moe_causal_lm_has_learned_positions() -> None:
    """The refusal's reason, checked against the installed transformers: no causal-LM class with
    experts creates a learned absolute position table (what megatron-core's MoE GPT has), and every
    one of them has gated experts, squared-ReLU ones (Ergo and NemotronH, transformers 5.25) or no
    expert MLP class (this runtime's experts are non-gated GELU). A transformers release that adds a
    matching class fails this test, and the mapping can be written."""
    import re

    transformers = pytest.importorskip("transformers")
    models = Path(transformers.__file__).parent / "models"
    table = re.compile(r"nn\.Embedding\(\s*(?:config\.|self\.config\.)?(?:max_position_embeddings|n_positions|"
                       r"max_seq_len|max_sequence_length)")
    block = r"class \w*(?:Experts|MoE|Moe|Sparse)\w*\(.*?\):\n(.*?)(?=\nclass |\Z)"
    moe, positions, non_gated = [], [], []
    for f in sorted(models.glob("*/modeling_*.py")):
        src = f.read_text()
        if "ForCausalLM(" not in src or not re.search(r"\bexperts\b", src):
            continue
        moe.append(f.parent.name)
        if table.search(src):
            positions.append(f.parent.name)
        # the expert MLPs and the MoE blocks that call them
        blocks = [m.group(1) for m in re.finditer(block, src, re.S)]
        gated = any(re.search(r"gate_up|chunk\(2|\bw3\b|\bv1\b|gate_proj|glu|\* up", b, re.I) for b in blocks)
        config = f.with_name(f.name.replace("modeling_", "configuration_"))
        relu2 = re.search(r"relu2", src + (config.read_text() if config.exists() else ""))
        if not gated and not relu2:
            non_gated.append(f.parent.name)
    assert len(moe) >= 10 and "mixtral" in moe  # the scan found them
    assert positions == [] and non_gated == [], (positions, non_gated)


def test_megatron_moe_weights_under_megatron_names_keep_every_expert(tmp_path: Path) -> None:
    """``--to hf --names megatron`` (the raw tensors the MoE refusal points to) of the MoE fixture: every
    dense parameter and every (layer, expert) slice of the stacked expert keys, equal to what ``ckpt
    show`` reads from the source (the experts were once dropped without a word)."""
    src = MEGATRON / "moe_ep2_dp4_dp_reshardable"
    r = cli("export", src, tmp_path / "hf", "--to", "hf", "--names", "megatron")
    assert r.exit_code == 0, r.stderr
    exported = load_file(tmp_path / "hf" / "model.safetensors")
    ckpt = open_checkpoint(src)
    dense = {name for name, _, _ in module_params(ckpt)}
    stacked = sorted(k for k, e in ckpt.entries.items() if k.startswith("decoder.layers.mlp.experts.experts.")
                     and e.kind == TENSOR)
    assert stacked and dense <= set(exported)
    experts = set(exported) - dense
    for key in stacked:
        full = _shown(src, key)
        layers, n = full.shape[:2]
        for layer in range(layers):
            for e in range(n):
                name = f"decoder.layers.{layer}.mlp.experts.{e}.{key.rsplit('experts.', 1)[1]}"
                experts.discard(name)
                assert torch.equal(exported[name].double(), full[layer, e]), name
    assert not experts, f"unexpected tensors: {sorted(experts)[:3]}"
