"""Virtual pipeline stages (VPP, interleaved 1F1B) in a genuine megatron-core 0.19.2 checkpoint.

``fixtures/megatron/pair_vpp_pp2_dp2_dp_reshardable`` (+ ``_fully_reshardable``): PP2 x VPP2 x DP2,
4 layers, one per model chunk, one training state saved twice. Stage 0 wrote layers 0 and 2, stage 1
layers 1 and 3, and every stage's optimizer has one buffer per model chunk (``gbuf_idx`` 0 and 1 of
one dtype). The reference for the layout is what the generator read from megatron's own buffers
(``expected.json``: ``params_in_bucket``, named as megatron's chunks name them: ``model<chunk>.
decoder.layers.<local layer>``); for the values, megatron's own ``fully_reshardable`` save of the
same state. A checkpoint whose layers' writers do not match a virtual size, or whose args say
another, is refused in one line; nothing reads it as a plain PP checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
from cli_helpers import cli

from ckpt_tool.copying import WEIGHT_STATE
from ckpt_tool.copying.source import open_source
from gtp_format.errors import FormatError
from gtp_format.megatron.topology import common_state, derive, model_chunks
from gtp_format.names import STATES, parse_optimizer_key
from gtp_format.reader.checkpoint import open_checkpoint

MEGATRON = Path(__file__).resolve().parents[2] / "fixtures" / "megatron"
VPP = "pair_vpp_pp2_dp2_dp_reshardable"
TWIN = f"{VPP}_fully_reshardable"
# PP2 x VPP2 x DP1, untied, fp32 layernorms: two buffers per model chunk, each chunk's in its own order
# of first appearance (stage 0: chunk 0 (bf16, fp32) then (fp32, fp32), chunk 1 the reverse)
FP32 = "pair_vpp_fp32norm_untied_pp2_dp_reshardable"


def _global_name(name: str, stage: int, pp: int, per_chunk: int, tied: bool) -> str:
    """``model<v>.decoder.layers.<j>.X`` (megatron's chunk v of stage p) -> the global layer's name."""
    chunk, rest = re.match(r"^model(\d+)\.(.*)$", name).groups()  # type: ignore[union-attr]
    m = re.match(r"^decoder\.layers\.(\d+)\.(.*)$", rest)
    if m is None:
        return "embedding.word_embeddings.weight" if rest == "output_layer.weight" and tied else rest
    return f"decoder.layers.{(int(chunk) * pp + stage) * per_chunk + int(m.group(1))}.{m.group(2)}"


@pytest.mark.parametrize("name", [VPP, FP32])
def test_layout_equals_megatrons_buffers_chunk_by_chunk(name: str) -> None:
    expected = json.loads((MEGATRON / name / "expected.json").read_text())
    topo = expected["topology"]
    pp, vpp, tied = topo["pp"], topo["vpp"], expected["model"]["share_embeddings_and_output_weights"]
    per_chunk = expected["model"]["num_layers"] // (pp * vpp)
    src = open_source(MEGATRON / name, megatron=True)
    checked, gbufs = 0, set()
    for k in expected["keys"]:
        opt = parse_optimizer_key(k["key"])
        if opt is None or opt.state != "param":
            continue
        gbufs.add((opt.dp_group_idx, opt.gbuf_idx))
        for p in k["params_in_bucket"]:
            view = src.views[_global_name(p["param"], opt.dp_group_idx, pp, per_chunk, tied)]
            holder = next(h for h in view.holders if h.ref.key("param") == k["key"])
            assert (holder.ref.bucket_idx, holder.start, holder.start + holder.numel) == (
                opt.bucket_idx, p["start"], p["end"]), p["param"]
            checked += 1
    assert checked == sum(len(v.holders) for v in src.views.values())
    if name == FP32:  # two dtypes: two buffers per model chunk, numbered chunk after chunk
        assert gbufs == {(n, g) for n in range(2) for g in range(4)}
        where = {n: (v.holders[0].ref.dp_group_idx, v.gbuf_idx, v.param_dtype) for n, v in src.views.items()}
        assert where["decoder.layers.2.input_layernorm.weight"] == (0, 2, "torch.float32")
        assert where["decoder.layers.2.mlp.linear_fc1.weight"] == (0, 3, "torch.bfloat16")
        assert where["output_layer.weight"] == (1, 3, "torch.bfloat16")
        return
    assert gbufs == {(0, 0), (0, 1), (1, 0), (1, 1)}  # one buffer per model chunk, one dtype
    # stage 0: chunk 0 holds layer 0 and the embeddings, chunk 1 layer 2; stage 1: layers 1, 3 + the head
    where = {n: (v.holders[0].ref.dp_group_idx, v.gbuf_idx) for n, v in src.views.items()}
    assert [where[f"decoder.layers.{i}.mlp.linear_fc1.weight"] for i in range(4)] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert where["embedding.position_embeddings.weight"] == (0, 0) and where["decoder.final_layernorm.weight"] == (1, 1)


@pytest.mark.parametrize("name", [VPP, FP32])
def test_master_weights_round_to_the_model_weights(name: str) -> None:
    src = open_source(MEGATRON / name, megatron=True)
    for v in src.views.values():
        full = (0,) * len(v.full_shape), v.full_shape
        master = torch.from_numpy(src.read_full_box(v, "param", *full).copy())
        dtype = getattr(torch, v.param_dtype.removeprefix("torch."))  # the fp32 layernorms: their own dtype
        weight = torch.from_numpy(src.read_full_box(v, WEIGHT_STATE, *full).copy()).view(dtype)
        assert torch.equal(master.to(dtype), weight), v.name
        assert (src.read_full_box(v, "exp_avg_sq", *full) != 0).any(), v.name


def test_topology_names_the_virtual_pipeline_size() -> None:
    meg = derive(open_checkpoint(MEGATRON / VPP))
    assert (meg.tp, meg.pp, meg.vpp, meg.dp, meg.cp) == (1, 2, 2, 2, 1)
    assert meg.sources["vpp"] == "the ranks that wrote each layer" and not meg.notes
    assert "pp2 vpp2" in meg.describe()
    assert derive(open_checkpoint(MEGATRON / "pair_pp2_dp2_dp_reshardable")).vpp == 1
    r = cli("inspect", MEGATRON / VPP, "--format", "json")
    assert r.exit_code == 0 and json.loads(r.stdout)["megatron_topology"]["vpp"] == 2


@pytest.mark.parametrize("stages,want", [
    ({0: 0, 1: 0, 2: 1, 3: 1}, (1, {0: 0, 1: 0, 2: 0, 3: 0})),
    ({0: 0, 1: 1, 2: 0, 3: 1}, (2, {0: 0, 1: 0, 2: 1, 3: 1})),
    ({0: 0, 1: 0, 2: 1, 3: 1, 4: 0, 5: 0, 6: 1, 7: 1}, (2, {0: 0, 1: 0, 2: 0, 3: 0, 4: 1, 5: 1, 6: 1, 7: 1})),
])
def test_model_chunks_are_the_runs_of_a_stages_layers(stages: dict[int, int], want: tuple) -> None:
    assert model_chunks(stages, 2) == want


@pytest.mark.parametrize("stages", [{0: 1, 1: 0}, {0: 0, 1: 1, 2: 1, 3: 0}, {0: 0, 1: 1, 2: 0}])
def test_stages_out_of_turn_are_no_virtual_pipeline(stages: dict[int, int]) -> None:
    with pytest.raises(ValueError, match="neither ascending"):
        model_chunks(stages, 2)


def _moved(ckpt: object, layer: int, to_file: str) -> None:
    """Every chunk of ``layer`` re-homed (in memory) in another rank's data file."""
    for k, e in list(ckpt.entries.items()):  # type: ignore[attr-defined]
        if e.kind != "tensor" or not k.startswith("decoder.layers."):
            continue
        chunks = tuple(c._replace(storage=c.storage._replace(file=to_file))
                       if c.offsets[0] == layer and c.storage is not None else c for c in e.chunks)
        ckpt.entries[k] = dataclasses.replace(e, chunks=chunks)  # type: ignore[attr-defined]


def test_writers_that_contradict_the_args_are_refused_in_one_line() -> None:
    """Layer 1 as if stage 0 wrote it: stage 0 then holds layers 0-2 in one run, which reads as PP2
    without VPP; the args record a virtual size of 2, and the view refuses rather than lay out
    stage 0's two buffers as one."""
    from gtp_format.megatron.view import megatron_views

    ckpt = open_checkpoint(MEGATRON / VPP)
    _moved(ckpt, 1, "__0_0.distcp")
    with pytest.raises(FormatError, match="virtual_pipeline_model_parallel_size=2") as err:
        megatron_views(ckpt)
    assert "\n" not in str(err.value) and str(ckpt.root) in str(err.value)
    assert derive(ckpt).vpp == 1 and any("virtual_pipeline_model_parallel_size=2" in n for n in derive(ckpt).notes)


def test_without_recorded_args_the_buffers_still_refuse_a_misread(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same re-homed layer and no args to compare: stage 0's keys have two buffers of one dtype,
    one model chunk of layers has one, so the buffer check refuses in one line."""
    import gtp_format.megatron.topology as mt
    from gtp_format.megatron.view import megatron_views

    ckpt = open_checkpoint(MEGATRON / VPP)
    _moved(ckpt, 1, "__0_0.distcp")
    monkeypatch.setattr(mt, "common_state", lambda ckpt: None)
    with pytest.raises(FormatError, match="one buffer per dtype and model chunk") as err:
        megatron_views(ckpt)
    assert "\n" not in str(err.value)


def test_export_equals_megatrons_own_fully_reshardable_save(tmp_path: Path) -> None:
    """Every tensor of ``ckpt export --to fully_reshardable`` equals megatron-core's own save of the same
    state, bit for bit, but the tied word embeddings' fp32 state, which megatron-core's save writes 64
    elements (one alignment) late at PP > 1, as in ``pair_pp2_dp2`` and ``pair_pp4`` (its ``param``
    then does not round to its own bf16 weight; ours does)."""
    from gtp_format.reader.boxes import BoxReader

    out = tmp_path / "fr"
    assert cli("export", MEGATRON / VPP, out, "--to", "fully_reshardable").exit_code == 0
    r = cli("diff", out, MEGATRON / TWIN, "--bitwise", "--format", "json")
    assert r.exit_code == 1
    doc = json.loads(r.stdout)
    assert not doc["only_in_a"] and all(k.startswith("rng_state/") for k in doc["only_in_b"]), doc["only_in_b"]
    differ = {d["key"] for d in doc["differences"]}
    emb = "embedding.word_embeddings.weight"
    assert differ == {"common_state/shard_0_1", *(f"optimizer.state.{s}.{emb}" for s in STATES)}, differ
    ra, rb = BoxReader(open_checkpoint(out)), BoxReader(open_checkpoint(MEGATRON / TWIN))
    for s in STATES:
        a = ra.read_box(f"optimizer.state.{s}.{emb}", (0, 0), (128, 32)).reshape(-1)
        b = rb.read_box(f"optimizer.state.{s}.{emb}", (0, 0), (128, 32)).reshape(-1)
        assert b[:-64].tobytes() == a[64:].tobytes() and not b[-64:].any(), s
    w = torch.from_numpy(rb.read_box(emb, (0, 0), (128, 32)).copy()).view(torch.bfloat16)
    p = torch.from_numpy(ra.read_box(f"optimizer.state.param.{emb}", (0, 0), (128, 32)).copy())
    assert torch.equal(p.to(torch.bfloat16), w)


def test_export_of_two_buffers_per_chunk_equals_megatrons_own_save_bit_for_bit(tmp_path: Path) -> None:
    """Untied (no shared embedding, so no shifted state in megatron's save) and two dtypes per model
    chunk: every tensor of the export equals megatron-core's own fully_reshardable save."""
    out = tmp_path / "fr"
    assert cli("export", MEGATRON / FP32, out, "--to", "fully_reshardable").exit_code == 0
    doc = json.loads(cli("diff", out, MEGATRON / f"{FP32}_fully_reshardable", "--bitwise", "--format", "json").stdout)
    assert doc["compared"] > 60 and not doc["only_in_a"]
    assert [d["key"] for d in doc["differences"]] == ["common_state/shard_0_1"]  # its args, content_metadata


@pytest.mark.parametrize("name,flags,topo", [(VPP, ("--pp", "2", "--dp", "2"), (1, 2, 2)),
                                             (VPP, ("--tp", "2", "--pp", "1"), (2, 1, 2)),
                                             (FP32, ("--pp", "2"), (1, 2, 1)), (FP32, ("--pp", "1", "--dp", "2"),
                                                                                (1, 1, 2))])
def test_reshard_to_one_chunk_per_stage_keeps_every_bit(name: str, flags: tuple[str, ...], topo: tuple[int, int, int],
                                                        tmp_path: Path) -> None:
    """The output is megatron-core's dp_reshardable layout without virtual pipeline stages (its args
    say so), and its own per-parameter view, derived afresh, holds the source's bits."""
    out = tmp_path / "out"
    r = cli("reshard", MEGATRON / name, out, *flags)
    assert r.exit_code == 0, r.stderr
    assert "virtual pipeline stages" in r.stdout and "vpp2" in r.stdout
    ours = open_checkpoint(out)
    meg = derive(ours)
    assert (meg.tp, meg.pp, meg.dp, meg.vpp) == (*topo, 1)
    args = common_state(ours)["args"].fields()  # type: ignore[index]
    assert args["virtual_pipeline_model_parallel_size"] is None
    assert args["num_layers_per_virtual_pipeline_stage"] is None
    gbufs = {o.gbuf_idx for k in ours.entries if (o := parse_optimizer_key(k)) is not None}
    assert gbufs == ({0} if name == VPP else {0, 1})  # one buffer per dtype: one model chunk per stage
    a, b = open_source(MEGATRON / name, megatron=True), open_source(out, megatron=True)
    assert sorted(a.views) == sorted(b.views)
    for name, v in a.views.items():
        zeros = (0,) * len(v.full_shape)
        for state in (WEIGHT_STATE, *STATES):
            x, y = a.read_full_box(v, state, zeros, v.full_shape), b.read_full_box(b.views[name], state, zeros,
                                                                                 v.full_shape)
            assert x.dtype == y.dtype and x.tobytes() == y.tobytes(), (name, state)
    v = cli("verify", out, "--data")
    assert v.exit_code == 0 and "0 errors, 0 warnings" in v.stdout, v.stdout


@pytest.mark.parametrize("flags,verdict,commands", [
    (("--pp", "2", "--dp", "2", "--vpp", "2"), "works_as_is", 0),
    (("--pp", "2", "--dp", "2"), "needs_reshard", 2),  # --vpp 1 (the default): another bucket layout
    (("--pp", "2", "--dp", "1", "--vpp", "2"), "needs_reshard", 1),  # reshard writes no VPP: export only
    (("--pp", "2", "--dp", "2", "--vpp", "4"), "impossible", 0),  # 4 layers do not make 2 x 4 chunks
])
def test_plan_compares_the_virtual_pipeline_size(flags: tuple[str, ...], verdict: str, commands: int) -> None:
    r = cli("plan", MEGATRON / VPP, "--tp", "1", *flags, "--format", "json")
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["verdict"] == verdict and len(doc["commands"]) == commands, doc
    assert doc["source"]["vpp"] == 2 and doc["target"]["vpp"] == int(dict(zip(flags[::2], flags[1::2])).get("--vpp", 1))
    if commands:
        assert doc["commands"][-1].endswith("--to fully_reshardable")
        assert "virtual" in doc["reason"]


def test_plan_of_a_plain_pp_checkpoint_at_a_virtual_size_is_not_as_is() -> None:
    r = cli("plan", MEGATRON / "pair_pp4_dp_reshardable", "--pp", "2", "--vpp", "2", "--format", "json")
    doc = json.loads(r.stdout)
    assert r.exit_code == 0 and doc["verdict"] == "needs_reshard" and "1 -> 2" in doc["reason"]
    r = cli("plan", MEGATRON / TWIN, "--pp", "2", "--vpp", "2", "--dp", "2", "--format", "json")
    assert json.loads(r.stdout)["verdict"] == "works_as_is"  # fully_reshardable: keys per parameter


def test_moe_with_virtual_pipeline_stages_is_megatrons_layout(tmp_path: Path) -> None:
    """``pair_mixtral_vpp_pp2_dp`` (Mixtral-style: 4 SwiGLU experts, RMSNorm, RoPE, GQA, untied; PP2 x VPP2 x DP2,
    EP 2, 4 layers, megatron-core 0.19.2): each model chunk has its own
    dense and expert buffer (``gbuf_idx`` = the chunk, in the chained_0 and the chained_1 optimizer); the view puts
    every parameter, the experts included, where megatron-core's buffers had it (``params_in_bucket``), every fp32
    master rounds to its bf16 weight, and the fully_reshardable export holds every tensor of megatron-core's own
    fully_reshardable save of that state, bit for bit."""
    name = "pair_mixtral_vpp_pp2_dp_reshardable"
    expected = json.loads((MEGATRON / name / "expected.json").read_text())
    topo, tied = expected["topology"], expected["model"]["share_embeddings_and_output_weights"]
    pp, ep, per = topo["pp"], topo["ep"], topo["num_moe_experts"] // topo["ep"]
    per_chunk = expected["model"]["num_layers"] // (pp * topo["vpp"])
    src = open_source(MEGATRON / name, megatron=True, experts=True)
    checked, gbufs = 0, set()
    for k in expected["keys"]:
        opt = parse_optimizer_key(k["key"])
        if opt is None or opt.state != "param":
            continue
        gbufs.add((opt.prefix, opt.dp_group_idx, opt.gbuf_idx))
        for p in k["params_in_bucket"]:
            m = re.match(r"^(model\d+\.decoder\.layers\.\d+)\.mlp\.experts\.local_experts\.(\d+)\.(.*)$", p["param"])
            if m:  # the expert optimizer: dp_group_idx = pp_rank * EP + ep_rank
                stage, ep_rank = divmod(opt.dp_group_idx, ep)
                layer = _global_name(m.group(1) + ".x", stage, pp, per_chunk, tied).rsplit(".", 1)[0]
                global_name = f"{layer}.mlp.experts.{ep_rank * per + int(m.group(2))}.{m.group(3)}"
            else:
                global_name = _global_name(p["param"], opt.dp_group_idx, pp, per_chunk, tied)
            view = src.views[global_name]
            holder = next(h for h in view.holders if h.ref.key("param") == k["key"])
            assert (holder.ref.bucket_idx, holder.start, holder.start + holder.numel) == (
                opt.bucket_idx, p["start"], p["end"]), p["param"]
            checked += 1
    assert checked == sum(len(v.holders) for v in src.views.values())
    assert {(n, g) for prefix, n, g in gbufs if prefix.startswith("chained_1.")} == {(n, g) for n in range(4)
                                                                                     for g in range(2)}
    for v in src.views.values():
        full = (0,) * len(v.full_shape), v.full_shape
        master = torch.from_numpy(src.read_full_box(v, "param", *full).copy())
        weight = torch.from_numpy(src.read_full_box(v, WEIGHT_STATE, *full).copy()).view(torch.bfloat16)
        assert torch.equal(master.to(torch.bfloat16), weight), v.name
    out = tmp_path / "fr"
    assert cli("export", MEGATRON / name, out, "--to", "fully_reshardable").exit_code == 0
    doc = json.loads(cli("diff", out, MEGATRON / f"{name}_fully_reshardable", "--bitwise", "--format", "json").stdout)
    assert doc["compared"] > 60 and not doc["only_in_a"]
    assert [d["key"] for d in doc["differences"]] == ["common_state/shard_0_1"]  # its args, content_metadata


def test_hf_export_with_optimizer_holds_the_views_state_under_global_layers(tmp_path: Path) -> None:
    """``--to hf --optimizer`` (megatron names): layer ``i``'s weight is the stacked key's layer ``i``
    (``ckpt show``'s), and its master and moments are the per-parameter view's, whichever chunk and
    buffer held them (layer 2: stage 0's second chunk, ``gbuf_idx_1``)."""
    from safetensors.torch import load_file

    from gtp_format.reader.boxes import BoxReader

    out = tmp_path / "hf"
    r = cli("export", MEGATRON / VPP, out, "--to", "hf", "--optimizer", "--names", "megatron")
    assert r.exit_code == 0, r.stderr
    weights, states = load_file(out / "model.safetensors"), load_file(out / "optimizer.safetensors")
    src = open_source(MEGATRON / VPP, megatron=True)
    reader = BoxReader(open_checkpoint(MEGATRON / VPP))
    assert sorted(weights) == sorted(src.views) and len(states) == 3 * len(src.views)
    for name, v in src.views.items():
        zeros = (0,) * len(v.full_shape)
        lead = (v.layer,) if v.layer is not None else ()
        stored = reader.read_box(v.model_key, (*lead, *zeros), (*(1,) * len(lead), *v.full_shape))
        assert weights[name].view(torch.int16).numpy().tobytes() == stored.tobytes(), name
        for state in STATES:
            got = states[f"optimizer.state.{state}.{name}"].numpy()
            assert got.tobytes() == src.read_full_box(v, state, zeros, v.full_shape).tobytes(), (name, state)
