"""``ckpt import --from hf``: an HF folder becomes a checkpoint the runtime resumes, bit-exactly.

The HF models are built by transformers itself from an ``ArceeConfig`` (random init, nothing
downloaded) and saved with ``save_pretrained``. HF -> import -> export -> HF must give the same
bytes for every tensor; the imported checkpoint must hold fp32 master weights equal to the weights
and zero moments, and resume under ``python -m gtp_runtime.train --load`` on gloo ranks at two
topologies with the same losses.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from cli_helpers import assert_error_line, cli
from safetensors.torch import load_file, save_file

from ckpt_tool.copying import WEIGHT_STATE
from ckpt_tool.copying.source import open_source

os.environ["HF_HUB_OFFLINE"] = "1"
transformers = pytest.importorskip("transformers")

SIZES = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=16)
TRAIN = ["--vocab-size", "96", "--hidden", "32", "--ffn-hidden", "48", "--num-layers", "2", "--num-heads", "4",
         "--seq-length", "16", "--bucket-size", "3000"]
TOL = 1e-5  # the parity tests' relative loss tolerance (different topologies reduce in another order)


def hf_model(root: Path, dtype: torch.dtype = torch.float32, shard: str | None = None, **over: object) -> Path:
    torch.manual_seed(0)
    cfg = transformers.ArceeConfig(hidden_act="gelu", bos_token_id=None, eos_token_id=None, **{**SIZES, **over})
    model = transformers.ArceeForCausalLM(cfg).to(dtype)
    with torch.no_grad():  # norms start at ones: make them non-trivial so a swapped norm shows
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(root, **({"max_shard_size": shard} if shard else {}))
    return root


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("model*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("dtype,shard,topo", [
    (torch.float32, None, ["--tp", "2", "--cp", "2", "--fold-cp", "--gtp-remat", "2"]),
    (torch.bfloat16, "20KB", ["--cp", "2", "--fold-cp", "--dp", "2"]),
    (torch.bfloat16, None, ["--tp", "2", "--gtp-remat", "2", "--layout", "safetensors"]),
], ids=["fp32-tp2-cp2fold-g2", "bf16-sharded-cp2fold-dp2", "bf16-tp2-g2-safetensors"])
def test_hf_import_export_round_trip_is_bit_identical(dtype: torch.dtype, shard: str | None, topo: list[str],
                                                      tmp_path: Path) -> None:
    src = hf_model(tmp_path / "hf", dtype, shard)
    if shard:
        assert (src / "model.safetensors.index.json").is_file()
    r = cli("import", src, tmp_path / "ckpt", "--from", "hf", *topo, "--bucket-size", "3000", "--format", "json")
    assert r.exit_code == 0, r.stderr
    assert cli("verify", tmp_path / "ckpt").exit_code == 0
    source = open_source(tmp_path / "ckpt")
    assert source.manifest.iteration == 0 and source.manifest.optimizer.step == 0
    for v in source.views.values():
        box = ((0,) * len(v.full_shape), v.full_shape)
        w = source.read_full_box(v, WEIGHT_STATE, *box).copy()
        w32 = torch.from_numpy(w.view(np.int16) if dtype == torch.bfloat16 else w).view(dtype).float()
        assert torch.equal(torch.from_numpy(source.read_full_box(v, "param", *box).copy()), w32), v.name
        for state in ("exp_avg", "exp_avg_sq"):
            assert not source.read_full_box(v, state, *box).any(), (v.name, state)
    r = cli("export", tmp_path / "ckpt", tmp_path / "back", "--to", "hf")
    assert r.exit_code == 0, r.stderr
    a, b = tensors(src), tensors(tmp_path / "back")
    assert a.keys() == b.keys() and len(a) == 3 + 8 * 2  # embed, final norm, lm_head + 8 per layer
    for k in a:
        assert a[k].dtype == b[k].dtype == dtype and torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)), k
    cfg_a, cfg_b = (json.loads((d / "config.json").read_text()) for d in (src, tmp_path / "back"))
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps", "tie_word_embeddings",
                "max_position_embeddings", "attention_bias", "mlp_bias", "model_type", "architectures"):
        assert cfg_a[key] == cfg_b[key], key


def _train(argv: list[str], log: Path) -> list[float]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "gtp_runtime.train", *TRAIN, *argv, "--log-json", str(log)],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return [row["loss"] for row in json.loads(log.read_text())["rows"]]


@pytest.mark.slow
def test_imported_checkpoint_resumes_on_gloo_ranks(tmp_path: Path) -> None:
    src = hf_model(tmp_path / "hf")
    runs = {"fold": ["--cp", "2", "--fold-cp"], "tp": ["--tp", "2"]}
    losses = {}
    for name, flags in runs.items():
        r = cli("import", src, tmp_path / name, "--from", "hf", *flags, "--bucket-size", "3000")
        assert r.exit_code == 0, r.stderr
        losses[name] = _train([*flags, "--nproc-per-node", "2", "--micro-batch", "2", "--steps", "2",
                               "--load", str(tmp_path / name)], tmp_path / f"{name}.json")
    a, b = losses["fold"], losses["tp"]
    assert len(a) == len(b) == 2 and all(np.isfinite(a + b))
    for x, y in zip(a, b):  # step 1 reads the imported weights, step 2 the fp32 masters and moments after one step
        assert abs(x - y) <= TOL * abs(x), (a, b)
    assert 3.0 < a[0] < 6.0  # a random init of vocab 96 starts near ln 96 = 4.56: the weights were loaded


def _edit_config(folder: Path, **change: object) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(change)
    (folder / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("case,needles", [
    ("silu", ["hidden_act is 'silu'"]),
    ("llama", ["model_type 'llama'", "ArceeForCausalLM"]),
    ("tied", ["tie_word_embeddings is True"]),
    ("gqa", ["num_key_value_heads is 2"]),
    ("eps", ["rms_norm_eps is 1e-06", "no flag"]),
    ("rope", ["rope_theta is 500000.0"]),
    ("missing", ["19 tensors", "holds 18"]),
    ("extra", ["19 tensors", "holds 20"]),
    ("renamed", ["has tensor 'lm_head.weights'"]),
    ("layers", ["says 1000000000 layers"]),
    ("vocab", ["'model.embed_tokens.weight' is [96, 32]", "[97, 32]"]),
    ("shape", ["'model.norm.weight' is [31]", "[32]"]),
    ("f16", ["float16", "float32 or bfloat16"]),
    ("index_path", ["'../outside.safetensors'", "plain file name"]),
    ("symlink", ["symlink"]),
    ("topology", ["--num-heads 4 must be a multiple of --tp 3"]),
    ("bad_header", ["header of"]),
])
def test_import_refusals(case: str, needles: list[str], tmp_path: Path) -> None:
    src = hf_model(tmp_path / "hf", torch.float16 if case == "f16" else torch.float32)
    st = src / "model.safetensors"
    if case in ("silu", "llama", "tied", "gqa", "rope", "layers", "vocab", "eps"):
        change = {"silu": {"hidden_act": "silu"}, "llama": {"model_type": "llama"},
                  "tied": {"tie_word_embeddings": True}, "gqa": {"num_key_value_heads": 2},
                  "rope": {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}},
                  "layers": {"num_hidden_layers": 10**9}, "vocab": {"vocab_size": 97},
                  "eps": {"rms_norm_eps": 1e-6}}[case]
        _edit_config(src, **change)
    elif case in ("missing", "extra", "shape", "renamed"):
        t = load_file(st)
        if case == "missing":
            del t["lm_head.weight"]
        elif case == "renamed":
            t["lm_head.weights"] = t.pop("lm_head.weight")
        elif case == "extra":
            t["model.extra.weight"] = torch.zeros(2)
        else:
            t["model.norm.weight"] = torch.zeros(31)
        save_file(t, st)
    elif case == "index_path":
        (src / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {}, "weight_map": {"lm_head.weight": "../outside.safetensors"}}))
    elif case == "symlink":
        st.rename(tmp_path / "real.safetensors")
        st.symlink_to(tmp_path / "real.safetensors")
    elif case == "bad_header":
        st.write_bytes((10**12).to_bytes(8, "little") + b"{}")
    before = sorted(p.name for p in tmp_path.iterdir())
    args = ["--tp", "3"] if case == "topology" else []
    assert_error_line(cli("import", src, tmp_path / "out", *args), 2, *needles)
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written, SRC untouched


def test_import_refuses_an_existing_destination_and_other_formats(tmp_path: Path) -> None:
    src = hf_model(tmp_path / "hf")
    (tmp_path / "out").mkdir()
    assert_error_line(cli("import", src, tmp_path / "out"), 2, "already exists")
    assert_error_line(cli("import", src, tmp_path / "o2", "--from", "gguf"), 2, "--from 'gguf'")
    assert list((tmp_path / "out").iterdir()) == [] and not (tmp_path / "o2").exists()


def test_import_and_hf_export_import_neither_torch_nor_the_runtime(tmp_path: Path) -> None:
    src = hf_model(tmp_path / "hf")
    probe = ("import json, sys\nfrom ckpt_tool.cli import run\ncode = run(sys.argv[1:])\n"
             "print(json.dumps([code, sorted(m.split('.')[0] for m in sys.modules if m.split('.')[0] in "
             "('torch', 'gtp_runtime', 'transformers'))]))")
    for args in (["import", str(src), str(tmp_path / "ckpt"), "--cp", "2", "--fold-cp"],
                 ["export", str(tmp_path / "ckpt"), str(tmp_path / "back"), "--to", "hf"]):
        out = subprocess.run([sys.executable, "-c", probe, *args], capture_output=True, text=True, timeout=300,
                             cwd=Path(__file__).resolve().parents[2], check=False)
        assert json.loads(out.stdout.strip().splitlines()[-1]) == [0, []], (args, out.stderr[-2000:])


# -- the optimizer files of `export --to hf --optimizer` ----------------------------------------------

def _st_files(folder: Path, prefix: str) -> dict[str, tuple[dict[str, str], dict[str, bytes]]]:
    """Per file of a set: its __metadata__ and every tensor's raw bytes (the safetensors library reads them)."""
    from safetensors import safe_open

    out = {}
    for f in sorted(folder.glob(f"{prefix}*.safetensors")):
        with safe_open(f, "pt") as g:
            out[f.name] = (g.metadata(), {k: g.get_tensor(k).view(torch.uint8).numpy().tobytes() for k in g.keys()})
    return out


@pytest.mark.slow
def test_import_restores_the_optimizer_and_resumes_bit_exactly(tmp_path: Path) -> None:
    """Trained A -> export --optimizer -> import B -> export again: every tensor of both sets, and the
    run state, identical; then A and B resumed on gloo ranks at A's topology give bit-identical losses
    (the second resumed step reads the restored masters, moments and Adam step; the lr schedule and
    data position must match too, or the runtime refuses the resume or trains other batches)."""
    flags = ["--cp", "2", "--fold-cp", "--nproc-per-node", "2", "--micro-batch", "2"]
    sched = ["--lr", "3e-3", "--lr-warmup-iters", "1", "--lr-decay-style", "cosine", "--lr-decay-iters", "6",
             "--min-lr", "1e-4"]
    a = tmp_path / "a"
    _train([*flags, *sched, "--steps", "3", "--save", str(a)], tmp_path / "a0.json")
    r = cli("export", a, tmp_path / "hf", "--to", "hf", "--optimizer")
    assert r.exit_code == 0, r.stderr
    r = cli("import", tmp_path / "hf", tmp_path / "b", "--cp", "2", "--fold-cp", "--bucket-size", "3000",
            "--format", "json")
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["optimizer"] == "restored" and doc["iteration"] == 3
    assert (tmp_path / "b" / "iter_0000003").is_dir() and cli("verify", tmp_path / "b").exit_code == 0
    ma, mb = (json.loads((d / "iter_0000003" / "gtp_manifest.json").read_text()) for d in (a, tmp_path / "b"))
    for key in ("optimizer", "opt_param_scheduler", "data_position", "iteration"):
        assert mb[key] == ma[key], key
    assert ma["optimizer"]["step"] == 3
    r = cli("export", tmp_path / "b", tmp_path / "hf2", "--to", "hf", "--optimizer")
    assert r.exit_code == 0, r.stderr
    for prefix in ("model", "optimizer"):
        one, two = _st_files(tmp_path / "hf", prefix), _st_files(tmp_path / "hf2", prefix)
        assert one.keys() == two.keys() and one
        for name in one:
            assert one[name][0] == two[name][0], (name, "metadata")
            assert one[name][1].keys() == two[name][1].keys()
            for k, raw in one[name][1].items():
                assert raw == two[name][1][k], k
    moments = _st_files(tmp_path / "hf", "optimizer")
    assert any(any(raw) for f in moments.values() for k, raw in f[1].items() if ".exp_avg_sq." in k)
    la = _train([*flags, *sched, "--steps", "5", "--load", str(a)], tmp_path / "a.json")
    lb = _train([*flags, *sched, "--steps", "5", "--load", str(tmp_path / "b")], tmp_path / "b.json")
    assert len(la) == len(lb) == 2 and la == lb, (la, lb)


def test_import_refuses_optimizer_files_it_cannot_resume(tmp_path: Path) -> None:
    """Optimizer files without the run state (or not matching the model) are refused in one line naming
    the fix; ``--no-optimizer`` imports the weights with zero moments."""
    src = hf_model(tmp_path / "hf")
    weights = load_file(src / "model.safetensors")
    states = {f"optimizer.state.{s}.{k}": v.float().clone() for k, v in weights.items()
              for s in ("param", "exp_avg", "exp_avg_sq")}
    save_file(states, src / "optimizer.safetensors", metadata={"format": "pt"})
    before = sorted(p.name for p in tmp_path.iterdir())
    assert_error_line(cli("import", src, tmp_path / "out"), 2, "gtp_run_state", "--no-optimizer")
    run = {"gtp_run_state": json.dumps({"iteration": 2, "optimizer": {"type": "muon", "step": 2}})}
    save_file(states, src / "optimizer.safetensors", metadata={"format": "pt", **run})
    assert_error_line(cli("import", src, tmp_path / "out"), 2, "'muon'", "AdamW")
    del states["optimizer.state.exp_avg.lm_head.weight"]
    run = {"gtp_run_state": json.dumps({"iteration": 2, "optimizer": {"type": "adamw", "step": 2, "lr": 1e-3}})}
    save_file(states, src / "optimizer.safetensors", metadata={"format": "pt", **run})
    assert_error_line(cli("import", src, tmp_path / "out"), 2, "lacks tensor 'optimizer.state.exp_avg.lm_head.weight'")
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written
    r = cli("import", src, tmp_path / "out", "--no-optimizer", "--format", "json")
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["optimizer"] == "moments at zero" and (tmp_path / "out" / "iter_0000000").is_dir()


def test_import_places_sharded_optimizer_files_by_the_name_table(tmp_path: Path) -> None:
    """Optimizer states in two files with an index land at the runtime's parameters (q/k/v fused back per
    head) at a GTP/TP-sharded topology, with the exported step; against the states written, element for element."""
    src = hf_model(tmp_path / "hf")
    weights = load_file(src / "model.safetensors")
    gen = torch.Generator().manual_seed(3)
    states = {f"optimizer.state.{s}.{k}": torch.randn(v.shape, generator=gen) for k, v in weights.items()
              for s in ("param", "exp_avg", "exp_avg_sq")}
    names = sorted(states)
    run = {"format": "pt", "gtp_run_state": json.dumps({"iteration": 7, "optimizer": {"type": "adamw", "step": 7,
                                                                                         "lr": 1e-3}})}
    halves = {"optimizer-00001-of-00002.safetensors": names[::2], "optimizer-00002-of-00002.safetensors": names[1::2]}
    for f, keys in halves.items():
        save_file({k: states[k] for k in keys}, src / f, metadata=run)
    (src / "optimizer.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: f for f, keys in halves.items() for k in keys}}))
    r = cli("import", src, tmp_path / "ckpt", "--tp", "2", "--gtp-remat", "2", "--bucket-size", "3000")
    assert r.exit_code == 0, r.stderr
    source = open_source(tmp_path / "ckpt")
    assert source.manifest.iteration == 7 and source.manifest.optimizer.step == 7
    hd = SIZES["hidden_size"] // SIZES["num_attention_heads"]
    for i in range(SIZES["num_hidden_layers"]):
        v = source.views[f"decoder.layers.{i}.self_attention.linear_qkv.weight"]
        for state in ("param", "exp_avg", "exp_avg_sq"):
            fused = torch.from_numpy(source.read_full_box(v, state, (0, 0), v.full_shape).copy())
            per_head = fused.view(SIZES["num_attention_heads"], 3, hd, -1)
            for j, proj in enumerate("qkv"):
                want = states[f"optimizer.state.{state}.model.layers.{i}.self_attn.{proj}_proj.weight"]
                assert torch.equal(per_head[:, j].reshape(want.shape), want), (i, proj, state)
    v = source.views["output_layer.weight"]
    got = torch.from_numpy(source.read_full_box(v, "exp_avg_sq", (0, 0), v.full_shape).copy())
    assert torch.equal(got, states["optimizer.state.exp_avg_sq.lm_head.weight"])
