"""``ckpt import --from hf --to megatron-core --vpp V`` of MoE models: virtual pipeline stages with experts.

Tiny transformers models of 4 layers (built from a config, random init, nothing downloaded; norms perturbed):
MixtralForCausalLM, Qwen3MoeForCausalLM, Qwen2MoeForCausalLM (a gated shared expert). Must hold:

* the layout is megatron-core's: the planner the import runs (:func:`ckpt_tool.copying.megatron_plan.plan_megatron`
  with ``vpp``), over the genuine ``pair_mixtral_vpp_pp2_dp_reshardable`` (PP2 x VPP2 x DP2 x EP2, megatron-core
  0.19.2) and the dense VPP pairs at their own topology, puts every parameter where megatron-core's own buffers
  had it (``expected.json``'s ``params_in_bucket``), with its ``per_bucket_numel`` objects and key shapes;
* import -> ``export --to hf`` is bit-identical, ``verify --data`` passes, the topology read back is the one
  asked for (VPP from the ranks that wrote each layer and the args), both shardings, EP 2 (the chained expert
  optimizer, one expert buffer per model chunk) and EP 1 with expert TP = TP (the experts in the dense buffers);
* the ``dp_reshardable`` import, read by the per-parameter view (checked on megatron-core's own VPP saves) and
  exported ``--to fully_reshardable``, equals the ``fully_reshardable`` import bit for bit;
* a carried optimizer state (masters and moments) goes through the VPP layouts and back byte for byte;
* megatron-core's own loader (megatron venv; skipped without it) builds the model chunks from the checkpoint's
  own args (its ``virtual_pipeline_model_parallel_size``), loads the import with no other flag, and its forward
  over the pipeline equals transformers' logits within 1e-5; the optimizer holds the fresh or carried state (a
  dense tied Llama too: ``--vpp`` with ``dp_reshardable`` was refused for every model before);
* SIGTERM mid-write leaves nothing at DST.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from cli_helpers import cli
from safetensors.torch import load_file, save_file
from test_hf_megatron_import import (
    MEGATRON,
    MEGATRON_PY,
    TOL,
    _carried,
    _fresh_optimizer,
    _megatron,
    _megatron_at,
    assert_same_tensors,
    import_mc,
    sigterm_mid_write_leaves_nothing,
)

os.environ["HF_HUB_OFFLINE"] = "1"
transformers = pytest.importorskip("transformers")

SIZES = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, vocab_size=128)


def moe_model(root: Path, kind: str) -> Path:
    """A 4-layer MoE model (4 experts, top 2), or a dense tied Llama: 2 x 2 model chunks of one layer at PP 2 x
    VPP 2."""
    torch.manual_seed(0)
    if kind == "mixtral":
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
            num_local_experts=4, num_experts_per_tok=2, intermediate_size=32, rope_theta=30000.0, **SIZES))
    elif kind == "qwen3_moe":  # q/k norms, renormalised top-k
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
            intermediate_size=128, **SIZES))
    elif kind == "llama_tied":  # dense, tied: the shared embedding's own bucket in the first and the last chunk
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(intermediate_size=128,
                                                                       tie_word_embeddings=True, **SIZES))
    else:  # qwen2_moe: a shared expert behind a sigmoid gate, q/k/v biases
        model = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
            norm_topk_prob=False, intermediate_size=128, **SIZES))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(root)
    return root


def _gbufs(folder: Path) -> dict[tuple[str, int], set[int]]:
    """(optimizer prefix, dp_group_idx) -> its gbuf_idx values."""
    from gtp_format.names import parse_optimizer_key
    from gtp_format.reader.checkpoint import open_checkpoint

    out: dict[tuple[str, int], set[int]] = {}
    for k in open_checkpoint(folder).entries:
        o = parse_optimizer_key(k)
        if o is not None:
            out.setdefault((o.prefix, o.dp_group_idx), set()).add(o.gbuf_idx)
    return out


VPP_TOPOS = [
    ("mixtral", ("--pp", "2", "--vpp", "2", "--ep", "2", "--dp", "2"), "dp_reshardable"),
    ("mixtral", ("--pp", "2", "--vpp", "2", "--ep", "2", "--dp", "2"), "fully_reshardable"),
    ("qwen3_moe", ("--tp", "2", "--pp", "2", "--vpp", "2", "--ep", "2"), "dp_reshardable"),
    ("qwen2_moe", ("--pp", "2", "--vpp", "2", "--ep", "4", "--dp", "4"), "dp_reshardable"),
    ("qwen2_moe", ("--tp", "2", "--pp", "2", "--vpp", "2", "--ep", "1", "--etp", "2"), "dp_reshardable"),
]


@pytest.mark.parametrize("kind,topo,sharding", VPP_TOPOS)
def test_vpp_moe_hf_megatron_hf_round_trip_is_bit_identical(kind: str, topo: tuple[str, ...], sharding: str,
                                                            tmp_path: Path) -> None:
    from gtp_format.megatron.topology import common_state, derive
    from gtp_format.reader.checkpoint import open_checkpoint

    src = moe_model(tmp_path / "hf", kind)
    import_mc(src, tmp_path / "mc", *topo, "--sharding", sharding)
    r = cli("verify", tmp_path / "mc", "--data")
    assert r.exit_code == 0 and "0 errors, 0 warnings" in r.stdout, r.stdout + r.stderr
    flags = dict(zip(topo[::2], map(int, topo[1::2])))
    ckpt = open_checkpoint(tmp_path / "mc")
    args = common_state(ckpt)["args"].fields()  # type: ignore[index]
    assert args["virtual_pipeline_model_parallel_size"] == 2 and args["num_layers_per_virtual_pipeline_stage"] == 1
    if sharding == "dp_reshardable":
        meg = derive(ckpt)
        assert (meg.pp, meg.vpp, meg.ep) == (2, 2, flags["--ep"])
        gbufs = _gbufs(tmp_path / "mc")
        assert gbufs and all(g == {0, 1} for g in gbufs.values()), gbufs  # one buffer per model chunk, per prefix
        chained = {p for p, _ in gbufs if p.startswith("chained_1.")}
        assert bool(chained) == (flags["--ep"] > 1)  # EP 1 with expert TP = TP: the experts in the dense buffers
    r = cli("export", tmp_path / "mc", tmp_path / "back", "--to", "hf")
    assert r.exit_code == 0, r.stderr
    assert_same_tensors(src, tmp_path / "back")


@pytest.mark.parametrize("kind,topo", [("mixtral", ("--pp", "2", "--vpp", "2", "--ep", "2", "--dp", "2")),
                                       ("qwen2_moe", ("--tp", "2", "--pp", "2", "--vpp", "2", "--ep", "1", "--etp",
                                                      "2"))])
def test_vpp_dp_reshardable_import_is_what_the_views_read(kind: str, topo: tuple[str, ...], tmp_path: Path) -> None:
    """The per-parameter view (megatron-core's own VPP MoE save is its reference) reads the dp_reshardable import:
    its ``export --to hf --optimizer`` (the view's masters and moments) is the fully_reshardable import's, byte for
    byte, and with the chained pair its export --to fully_reshardable equals the fully_reshardable import, every
    tensor bit for bit (at EP 1 with the experts in the dense buffers that export is refused, as for megatron-core's
    own ``pair_mixtral_tp2_ep1``)."""
    src = moe_model(tmp_path / "hf", kind)
    import_mc(src, tmp_path / "dp", *topo, "--sharding", "dp_reshardable")
    import_mc(src, tmp_path / "fr", *topo, "--sharding", "fully_reshardable")
    for d in ("dp", "fr"):
        r = cli("export", tmp_path / d, tmp_path / f"hf_{d}", "--to", "hf", "--optimizer")
        assert r.exit_code == 0, r.stderr
    for f in ("model.safetensors", "optimizer.safetensors"):
        assert (tmp_path / "hf_dp" / f).read_bytes() == (tmp_path / "hf_fr" / f).read_bytes(), f
    if "--ep" in topo and topo[topo.index("--ep") + 1] == "1":
        return
    r = cli("export", tmp_path / "dp", tmp_path / "dp_fr", "--to", "fully_reshardable")
    assert r.exit_code == 0, r.stderr
    doc = json.loads(cli("diff", tmp_path / "dp_fr", tmp_path / "fr", "--bitwise", "--format", "json").stdout)
    assert doc["compared"] > 60 and not doc["only_in_a"] and not doc["only_in_b"]
    assert [d["key"] for d in doc["differences"]] == ["common_state/shard_0_1"]  # its sharding type


def _global(name: str, key: str, pp: int, ep: int, per_expert: int, per_chunk: int, tied: bool) -> str:
    """megatron's buffer name (``model<v>.decoder.layers.<j>.X``, ``local_experts.<k>``) -> the view's name."""
    from gtp_format.names import parse_optimizer_key

    o = parse_optimizer_key(key)
    assert o is not None
    chunk, rest = re.match(r"^model(\d+)\.(.*)$", name).groups()  # type: ignore[union-attr]
    m = re.match(r"^decoder\.layers\.(\d+)\.(.*)$", rest)
    if m is None:
        return "embedding.word_embeddings.weight" if rest == "output_layer.weight" and tied else rest
    e = re.match(r"^mlp\.experts\.local_experts\.(\d+)\.(.*)$", m.group(2))
    stage, ep_rank = divmod(o.dp_group_idx, ep) if e else (o.dp_group_idx, 0)
    layer = (int(chunk) * pp + stage) * per_chunk + int(m.group(1))
    if e:
        return f"decoder.layers.{layer}.mlp.experts.{ep_rank * per_expert + int(e.group(1))}.{e.group(2)}"
    return f"decoder.layers.{layer}.{m.group(2)}"


@pytest.mark.parametrize("fixture", ["pair_mixtral_vpp_pp2_dp_reshardable", "pair_vpp_pp2_dp2_dp_reshardable",
                                     "pair_vpp_fp32norm_untied_pp2_dp_reshardable"])
def test_the_planned_vpp_layout_is_megatron_cores_own(fixture: str) -> None:
    """The planner the dp_reshardable import runs, over megatron-core's own save at its own topology with its
    virtual size: every parameter's slice of every bucket (dense and expert, the shared embedding's own bucket on
    both ends, two dtypes per chunk) is where megatron-core's buffers held it, every bucket key has megatron's
    global shape, and the per_bucket_numel objects hold megatron's numels, chunk after chunk."""
    from ckpt_tool.copying.megatron_plan import plan_megatron
    from ckpt_tool.copying.source import open_source
    from gtp_format.reader.checkpoint import open_checkpoint
    from gtp_format.reader.inert_object import load_record

    expected = json.loads((MEGATRON / fixture / "expected.json").read_text())
    topo, model = expected["topology"], expected["model"]
    pp, vpp, ep = topo["pp"], topo["vpp"], topo.get("ep") or 1
    experts = topo.get("num_moe_experts") or 0
    per_chunk, tied = model["num_layers"] // (pp * vpp), model["share_embeddings_and_output_weights"]
    src = open_source(MEGATRON / fixture, megatron=True, experts=bool(experts))
    files, shapes, numels = plan_megatron(src, topo["tp"], pp, topo["dp"], None, 1 << 20, ep, 1, vpp=vpp)
    planned: dict[tuple[str, str], list[int]] = {}
    for chunks in files.values():
        for c in chunks:
            if c.state == "param" and c.param is not None and ".bucket_idx_" in c.key:
                span = planned.setdefault((c.key, c.param), [c.offsets[0], c.offsets[0] + c.sizes[0]])
                span[0], span[1] = min(span[0], c.offsets[0]), max(span[1], c.offsets[0] + c.sizes[0])
    want: dict[tuple[str, str], list[int]] = {}
    for k in expected["keys"]:
        if k["key"].endswith(".param") and k.get("params_in_bucket"):
            for p in k["params_in_bucket"]:
                name = _global(p["param"], k["key"], pp, ep, experts // ep if experts else 0, per_chunk, tied)
                want[(k["key"], name)] = [p["start"], p["end"]]
    assert planned == want and len(want) > 20
    theirs = open_checkpoint(MEGATRON / fixture)
    bucket_keys = {k for k in theirs.entries if ".bucket_idx_" in k}
    assert {k: tuple(shapes[k][0]) for k in bucket_keys} == {k: tuple(theirs.entries[k].shape) for k in bucket_keys}
    assert not {k for k in shapes if ".bucket_idx_" in k} - bucket_keys
    for prefix, ranks in numels.items():
        for n, bufs in ranks.items():
            key = f"{prefix}.dp_group_idx_{n}.per_bucket_numel_unpadded/shard_0_1"
            got = [list(nums) for _, _, nums in bufs]
            stored = load_record(theirs, theirs.entries[key])[0]  # [{(param dtype, grad dtype): [numel, ...]}, ...]
            assert got == [next(iter(d.values())) for d in stored], key


def _carried_folder(tmp_path: Path) -> Path:
    """A 4-layer Mixtral with an optimizer state to carry: imported, exported with ``--optimizer``, its moments
    replaced by random values (positive second moments) at step 3, and once more through an import (no VPP) and
    export, so that the folder is the exporter's own bytes."""
    src = moe_model(tmp_path / "hf0", "mixtral")
    import_mc(src, tmp_path / "mc0", "--ep", "2", "--dp", "2")
    assert cli("export", tmp_path / "mc0", tmp_path / "hfo", "--to", "hf", "--optimizer").exit_code == 0
    f = tmp_path / "hfo" / "optimizer.safetensors"
    from safetensors import safe_open

    with safe_open(str(f), "pt") as h:
        meta = h.metadata()
    state = json.loads(meta["gtp_megatron_run_state"])
    state.update(step=3.0)
    gen = torch.Generator().manual_seed(1)
    weights = load_file(tmp_path / "hfo" / "model.safetensors")
    # an fp32 model's master is its weight in megatron-core (the main param is the model param): only the moments
    # are the run's own
    opt = {k: weights[k[len("optimizer.state.param."):]] if ".param." in k else
           torch.rand(v.shape, generator=gen) if ".exp_avg_sq." in k else torch.randn(v.shape, generator=gen)
           for k, v in load_file(f).items()}
    save_file(opt, f, metadata={**meta, "gtp_megatron_run_state": json.dumps(state)})
    r = cli("import", tmp_path / "hfo", tmp_path / "mc1", "--from", "hf", "--to", "megatron-core", "--ep", "2",
            "--dp", "2", "--format", "json")
    assert r.exit_code == 0 and json.loads(r.stdout)["optimizer"].startswith("carried (step 3"), r.stderr
    assert cli("export", tmp_path / "mc1", tmp_path / "hf1", "--to", "hf", "--optimizer").exit_code == 0
    return tmp_path / "hf1"


def test_a_carried_optimizer_state_round_trips_through_the_vpp_layouts(tmp_path: Path) -> None:
    """HF (model and optimizer files) -> megatron-core at PP2 x VPP2 x EP2 x DP2, both shardings -> HF: the model
    and optimizer files byte for byte (masters and moments through each chunk's dense and expert buffers);
    megatron-core's loader (venv) loads the carried state."""
    hf1 = _carried_folder(tmp_path)
    topo = ("--pp", "2", "--vpp", "2", "--ep", "2", "--dp", "2")
    for sharding in ("dp_reshardable", "fully_reshardable"):
        r = cli("import", hf1, tmp_path / sharding, "--from", "hf", "--to", "megatron-core", *topo, "--sharding",
                sharding, "--format", "json")
        assert r.exit_code == 0 and json.loads(r.stdout)["optimizer"].startswith("carried (step 3"), r.stderr
        r = cli("export", tmp_path / sharding, tmp_path / f"hf_{sharding}", "--to", "hf", "--optimizer")
        assert r.exit_code == 0, r.stderr
        for f in ("model.safetensors", "optimizer.safetensors"):
            assert (hf1 / f).read_bytes() == (tmp_path / f"hf_{sharding}" / f).read_bytes(), (sharding, f)
    if MEGATRON_PY.exists():  # TP 1: every element of the optimizer state on exactly one rank
        np.save(tmp_path / "tokens.npy", np.zeros((1, 4), dtype=np.int64))
        for sharding in ("dp_reshardable", "fully_reshardable"):
            ranks = _megatron_at(tmp_path / sharding, tmp_path / f"out_{sharding}", (1, 2, 2),
                                 tmp_path / "tokens.npy", 0)
            _carried(ranks, hf1, sharding, 3.0)


@pytest.mark.slow
@pytest.mark.skipif(not MEGATRON_PY.exists(), reason="needs the megatron venv (fixtures/megatron/setup_venv.sh)")
@pytest.mark.parametrize("kind,topo,ep,sharding", [
    ("mixtral", (1, 2, 2), 2, "dp_reshardable"),
    ("qwen3_moe", (2, 2, 1), 2, "fully_reshardable"),
    ("qwen2_moe", (1, 2, 2), 1, "dp_reshardable"),  # EP 1, expert TP = TP: experts and shared expert dense
    ("llama_tied", (1, 2, 2), 0, "dp_reshardable"),  # dense: --vpp with dp_reshardable, tied embeddings
])
def test_megatron_core_loads_the_vpp_import_and_computes_transformers_logits(
        kind: str, topo: tuple[int, int, int], ep: int, sharding: str, tmp_path: Path) -> None:
    """megatron-core builds its model chunks from the checkpoint's args (PP 2 x VPP 2), loads the import with its
    own loader, and its forward, chunk after chunk over the stages, is transformers' logits."""
    src = moe_model(tmp_path / "hf", kind)
    import_mc(src, tmp_path / "mc", "--tp", str(topo[0]), "--pp", str(topo[1]), "--vpp", "2", "--dp", str(topo[2]),
              *(("--ep", str(ep)) if ep else ()), *(("--etp", str(topo[0])) if ep == 1 else ()), "--sharding",
              sharding)
    ids = np.random.default_rng(0).integers(0, 128, (2, 12))
    np.save(tmp_path / "tokens.npy", ids)
    ranks = _megatron(tmp_path / "mc", tmp_path / "out", topo, tmp_path / "tokens.npy")
    assert all(any(k.startswith("model.chunk1.") for k in r) for r in ranks)  # two model chunks on every rank
    _fresh_optimizer(ranks, topo[0], topo[2], sharding, ep or 1)
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    with torch.no_grad():
        want = model(torch.from_numpy(ids)).logits.numpy()
    got = np.load(tmp_path / "out" / "logits.npy")
    assert got.shape == want.shape and np.abs(got - want).max() < TOL, np.abs(got - want).max()


def test_sigterm_mid_vpp_moe_import_removes_the_work_folder(tmp_path: Path) -> None:
    src = moe_model(tmp_path / "hf", "mixtral")
    out = tmp_path / "out"
    out.mkdir()
    sigterm_mid_write_leaves_nothing(out, ["import", str(src), str(out / "dst"), "--from", "hf", "--to",
                                           "megatron-core", "--pp", "2", "--vpp", "2", "--ep", "2", "--dp", "2",
                                           "--workers", "1"], "ckpt_tool.hf.megatron_import:view_rows")
