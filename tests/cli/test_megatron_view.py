"""The per-parameter view of genuine megatron-core 0.19.2 checkpoints (fixtures/megatron, no manifest).

The layout is rebuilt from the model keys and megatron-core's bucketing rules; here it must equal
what the fixture generator recorded from megatron's own buffers (``expected.json``:
``params_in_bucket``), the fp32 master weights it finds must round to exactly the bf16 model
weights megatron published from them, and the fully_reshardable export must have megatron-core's
own fully_reshardable key set, global shapes and dtypes.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from cli_helpers import assert_error_line, cli

from ckpt_tool.copying import WEIGHT_STATE
from ckpt_tool.copying.source import open_source
from gtp_format.names import STATES, parse_optimizer_key
from gtp_format.reader.checkpoint import open_checkpoint

MEGATRON = Path(__file__).resolve().parents[2] / "fixtures" / "megatron"
DENSE = ["tp2_dp2_dp_reshardable", "cp2_dp2_dp_reshardable", "pp2_dp2_dp_reshardable",
         "pair_pp2_tp2_dp_reshardable", "pair_pp4_dp_reshardable", "pair_untied_pp2_dp_reshardable",
         "pair_fp32norm_dp2_dp_reshardable"]
EMB = "embedding.word_embeddings.weight"
PAIRS = ["pair_tp2_dp2_dp_reshardable", "pair_pp2_tp2_dp_reshardable", "pair_pp4_dp_reshardable",
         "pair_moe_ep2_dp_reshardable", "pair_untied_pp2_dp_reshardable", "pair_pp2_dp2_dp_reshardable",
         "pair_cp2_dp2_dp_reshardable", "pair_fp32norm_dp2_dp_reshardable", "pair_moe_tp2_etp2_dp_reshardable",
         "pair_qwen2moe_ep2_dp_reshardable"]


# megatron-core's own fully_reshardable saves that shift the tied embedding's fp32 state by 64 elements
SHIFTED = ("pair_pp4_dp_reshardable", "pair_pp2_dp2_dp_reshardable")


def _global_name(name: str, stage: int, layers_per_stage: int) -> str:
    """expected.json names module params as megatron's modules do: layers numbered per stage."""
    m = re.match(r"^decoder\.layers\.(\d+)\.(.*)$", name)
    if m is None:
        return "embedding.word_embeddings.weight" if name == "output_layer.weight" and stage > 0 else name
    return f"decoder.layers.{int(m.group(1)) + stage * layers_per_stage}.{m.group(2)}"


def _recorded_slices(expected: dict) -> list[tuple[Any, str, dict]]:
    """(parsed key, key, slice) of every parameter slice the generator read from megatron's buffers."""
    out = []
    for k in expected["keys"]:
        opt = parse_optimizer_key(k["key"])
        if opt is not None and opt.state == "param":
            out += [(opt, k["key"], p) for p in k["params_in_bucket"]]
    return out


@pytest.mark.parametrize("name", DENSE)
def test_layout_equals_megatron_buffers(name: str) -> None:
    expected = json.loads((MEGATRON / name / "expected.json").read_text())
    topo = expected["topology"]
    per_stage = expected["model"]["num_layers"] // topo["pp"]
    src = open_source(MEGATRON / name, megatron=True)
    checked = 0
    for opt, _, p in _recorded_slices(expected):
        own = p["param"] == "output_layer.weight" and p["param"] in src.views  # untied: a parameter of its own
        view = src.views[p["param"] if own else _global_name(p["param"], opt.dp_group_idx // topo["tp"], per_stage)]
        holder = next(h for h in view.holders if h.ref.dp_group_idx == opt.dp_group_idx)
        got = (holder.ref.bucket_idx, holder.start, holder.start + holder.numel)
        assert got == (opt.bucket_idx, p["start"], p["end"]), p["param"]
        checked += 1
    assert checked == sum(len(v.holders) for v in src.views.values())


def test_tied_output_layer_of_the_last_stage_holds_the_embeddings_state() -> None:
    """PP2, tied: the last stage's output_layer.weight has its own bucket slot (no key of its own);
    the view reads it as a replica of the word embeddings, which megatron keeps bit-identical
    (its gradients are all-reduced over the embedding group before every step)."""
    src = open_source(MEGATRON / "pp2_dp2_dp_reshardable", megatron=True)
    view = src.views["embedding.word_embeddings.weight"]
    assert [(h.ref.dp_group_idx, h.ref.bucket_idx, h.primary) for h in view.holders] == [(0, 1, True), (1, 0, False)]
    for state in STATES:
        rows = [src.reader.read_box(h.ref.key(state), (h.start,), (h.numel,)) for h in view.holders]
        assert rows[0].tobytes() == rows[1].tobytes(), state


@pytest.mark.parametrize("name", DENSE)
def test_master_weights_round_to_the_model_weights(name: str) -> None:
    src = open_source(MEGATRON / name, megatron=True)
    for view in src.views.values():
        full = (0,) * len(view.full_shape), view.full_shape
        master = torch.from_numpy(src.read_full_box(view, "param", *full).copy())
        dtype = getattr(torch, view.param_dtype.removeprefix("torch."))  # fp32norm: the layernorms are fp32
        weight = torch.from_numpy(src.read_full_box(view, WEIGHT_STATE, *full).copy()).view(dtype)
        assert torch.equal(master.to(dtype), weight), view.name
        for state in ("exp_avg_sq",):
            assert (src.read_full_box(view, state, *full) != 0).any(), view.name  # trained: moments are set


def test_fully_reshardable_export_has_megatrons_own_keys_and_shapes(tmp_path: Path) -> None:
    out = tmp_path / "fr"
    r = cli("export", MEGATRON / "cp2_dp2_dp_reshardable", out, "--to", "fully_reshardable")
    assert r.exit_code == 0, r.stderr
    ours, theirs = open_checkpoint(out), open_checkpoint(MEGATRON / "dp2_fully_reshardable")
    shape = {k: (e.shape, e.dtype) for k, e in ours.entries.items() if e.kind == "tensor"}
    assert shape == {k: (e.shape, e.dtype) for k, e in theirs.entries.items() if e.kind == "tensor"}
    import torch.distributed.checkpoint as dcp

    folder = out / "iter_0000002"
    md = dcp.FileSystemReader(folder).read_metadata()
    sd = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype) for k, v in md.state_dict_metadata.items()
          if hasattr(v, "size")}  # the byte objects (common_state, _extra_state) are not loaded here
    dcp.load(sd, storage_reader=dcp.FileSystemReader(folder), no_dist=True)
    src = open_source(MEGATRON / "cp2_dp2_dp_reshardable", megatron=True)
    for view in src.views.values():
        full = (0,) * len(view.full_shape), view.full_shape
        for state in STATES:
            got = sd[f"optimizer.state.{state}.{view.model_key}"]
            got = got[view.layer] if view.layer is not None else got
            assert np.ascontiguousarray(got.numpy()).tobytes() == src.read_full_box(view, state, *full).tobytes()


def test_hf_export_of_megatron_loads(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    out = tmp_path / "hf"
    r = cli("export", MEGATRON / "tp2_dp2_dp_reshardable", out, "--to", "hf", "--names", "megatron")
    assert r.exit_code == 0, r.stderr
    loaded = load_file(out / "model.safetensors")  # 46 KiB: one file, named as Hugging Face names it
    assert "decoder.layers.1.input_layernorm.weight" in loaded and len(loaded) == 28
    assert loaded["decoder.layers.0.self_attention.linear_qkv.weight"].shape == (96, 32)
    assert loaded["embedding.word_embeddings.weight"].dtype == torch.bfloat16


@pytest.mark.parametrize("name", ["moe_ep2_dp4_dp_reshardable", "pair_moe_ep2_dp_reshardable",
                                  "moe_pp2_ep2_dp_reshardable", "pair_moe_tp2_etp2_dp_reshardable",
                                  "pair_mixtral_ep2_dp_reshardable", "pair_qwen2moe_ep2_dp_reshardable",
                                  # EP 1 with expert TP = TP: the experts (and the shared expert) in the dense buffer
                                  "pair_mixtral_tp2_ep1_dp_reshardable", "pair_qwen2moe_tp2_ep1_dp_reshardable"])
def test_moe_layout_equals_megatron_buffers(name: str) -> None:
    """MoE EP2 (x DP4, x DP2, x PP2, and TP2 x expert TP2): the dense (chained_0) and expert
    (chained_1, one buffer per (stage, EP rank, expert-TP rank)) buffers are where megatron's own
    buffers had them, and every fp32 master rounds to its bf16 weight (experts read straight from
    the stacked (layer, expert) key, in expert-TP parts where it is split)."""
    from gtp_format.views.checkpoint import param_views_of

    expected = json.loads((MEGATRON / name / "expected.json").read_text())
    ckpt = open_checkpoint(MEGATRON / name)
    views = param_views_of(ckpt)
    topo = expected["topology"]
    per, ep, tp = topo["num_moe_experts"] // topo["ep"], topo["ep"], topo["tp"]
    etp = max(c["etp"] for c in expected["rank_coords"]) + 1 if "etp" in expected["rank_coords"][0] else 1
    per_stage = expected["model"]["num_layers"] // topo["pp"]
    checked = 0
    for opt, key, p in _recorded_slices(expected):
        m = re.match(r"^decoder\.layers\.(\d+)\.mlp\.experts\.local_experts\.(\d+)\.(.*)$", p["param"])
        if m:  # expert buffers: dp_group_idx = pp_rank * EP + ep_rank; megatron numbers layers per stage
            stage, rest = divmod(opt.dp_group_idx, ep * etp)  # expert model-parallel rank: etp fastest
            ep_rank = rest // etp
            ours = (f"decoder.layers.{int(m.group(1)) + stage * per_stage}.mlp.experts."
                    f"{ep_rank * per + int(m.group(2))}.{m.group(3)}")
        else:
            ours = _global_name(p["param"], opt.dp_group_idx // tp, per_stage)
        # a gated linear_fc1 (the shared expert's) has two holders per rank, its gate and up halves, back to back
        held = [h for h in views[ours].holders if h.ref.key("param") == key]
        assert held and len({h.ref.bucket_idx for h in held}) == 1, p["param"]
        assert (held[0].ref.bucket_idx, min(h.start for h in held), max(h.start + h.numel for h in held)) == (
            opt.bucket_idx, p["start"], p["end"]), p["param"]
        assert sum(h.numel for h in held) == p["end"] - p["start"], p["param"]
        checked += len(held)
    assert checked == sum(len(v.holders) for v in views.values())
    src = open_source(MEGATRON / name, megatron=True, experts=True, dense_experts=True)
    for v in src.views.values():
        full = (0,) * len(v.full_shape), v.full_shape
        master = torch.from_numpy(src.read_full_box(v, "param", *full).copy())
        weight = torch.from_numpy(src.read_full_box(v, WEIGHT_STATE, *full).copy()).view(torch.bfloat16)
        assert torch.equal(master.to(torch.bfloat16), weight), v.name


@pytest.mark.parametrize("name,needle", [("moe_ep2_dp4_dp_reshardable", "MoE"),
                                         ("dp2_fully_reshardable", "no dp_reshardable optimizer keys")])
def test_uncovered_megatron_checkpoints_are_refused(name: str, needle: str, tmp_path: Path) -> None:
    if name != "moe_ep2_dp4_dp_reshardable":  # inspect --params shows MoE; export refuses it
        assert_error_line(cli("inspect", MEGATRON / name, "--params"), 2, needle)
    # --optimizer needs the per-parameter view; a weights-only export does not (tests/cli/test_hf_megatron.py), nor
    # one of a fully_reshardable save, whose states are per-parameter keys (tests/cli/test_megatron_fr_optimizer.py)
    if name != "dp2_fully_reshardable":
        assert_error_line(cli("export", MEGATRON / name, tmp_path / "x", "--to", "hf", "--optimizer"), 2, needle)
    assert_error_line(cli("reshard", MEGATRON / name, tmp_path / "y", "--tp", "2"), 2, needle)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("pair", PAIRS)
def test_export_equals_megatrons_own_fully_reshardable_save_of_the_same_state(pair: str, tmp_path: Path) -> None:
    """fixtures/megatron/pair_*: one megatron-core training state saved as dp_reshardable and as
    fully_reshardable. Exporting the first must give the second's optimizer.state.* tensors, bit
    for bit (compared here directly: `ckpt diff --keys` is not on this branch). MoE (EP2: the
    chained dense + expert optimizer, expert keys stacked by (layer, expert)) and untied embeddings
    (PP2: the output layer a key and a parameter of its own) included.

    One exception, megatron-core's own: in PP4 x DP1 and PP2 x DP2 (tied embeddings on the first and
    last stage) its fully_reshardable save writes the tied
    word embeddings' fp32 state 64 elements (one alignment) off, with 64 zeros at the end, so
    its ``param`` does not even round to its own bf16 weight, while the dp_reshardable buffer
    (and our export of it) does. That key is checked for exactly this shift."""
    from gtp_format.reader.boxes import BoxReader

    src = MEGATRON / pair
    out = tmp_path / "fr"
    r = cli("export", src, out, "--to", "fully_reshardable")
    assert r.exit_code == 0, r.stderr
    ours, theirs = open_checkpoint(out), open_checkpoint(MEGATRON / f"{pair}_fully_reshardable")
    keys = sorted(k for k in theirs.entries if k.startswith("optimizer.state."))
    assert keys and keys == sorted(k for k in ours.entries if k.startswith("optimizer.state."))
    ra, rb = BoxReader(ours), BoxReader(theirs)
    for k in keys + [k for k, e in theirs.entries.items() if e.kind == "tensor" and not k.startswith("optimizer.")]:
        shape = theirs.entries[k].shape
        assert shape is not None and ours.entries[k].shape == shape, k
        a, b = ra.read_box(k, (0,) * len(shape), shape), rb.read_box(k, (0,) * len(shape), shape)
        if pair in SHIFTED and k.startswith("optimizer.state.") and k.endswith(EMB):
            flat_a, flat_b = a.reshape(-1), b.reshape(-1)
            assert flat_b[:-64].tobytes() == flat_a[64:].tobytes() and not flat_b[-64:].any(), k
            continue
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), k
    if pair in SHIFTED:  # ours rounds to the model weight, megatron's own save does not
        w = torch.from_numpy(rb.read_box(EMB, (0, 0), (128, 32)).copy()).view(torch.bfloat16)
        for reader, rounds in ((ra, True), (rb, False)):
            p = torch.from_numpy(reader.read_box(f"optimizer.state.param.{EMB}", (0, 0), (128, 32)).copy())
            assert torch.equal(p.to(torch.bfloat16), w) is rounds


def test_several_buffers_follow_megatrons_dtype_grouping() -> None:
    """fp32norm: megatron-core made a (bf16, fp32) and an (fp32, fp32) buffer (gbuf 0 and 1, in order
    of first appearance); every bf16 parameter sits in the first, every layernorm in the second, and
    the fp32 buffer's master is the fp32 model weight itself (megatron's optimizer steps it in place)."""
    src = open_source(MEGATRON / "pair_fp32norm_dp2_dp_reshardable", megatron=True)
    for v in src.views.values():
        norm = "layernorm" in v.name
        assert (v.gbuf_idx, v.param_dtype) == ((1, "torch.float32") if norm else (0, "torch.bfloat16")), v.name
        assert {h.ref.dtype for h in v.holders} == {f"({v.param_dtype}, torch.float32)"}, v.name
        if norm:
            full = (0,) * len(v.full_shape), v.full_shape
            assert src.read_full_box(v, "param", *full).tobytes() == src.read_full_box(v, WEIGHT_STATE, *full).tobytes()


def test_buffers_out_of_megatrons_order_are_refused_in_one_line() -> None:
    """megatron-core numbers a stage's buffers in order of first appearance; the fp32norm pair with its
    two gbuf indices swapped (in memory) is not what it writes, and is refused naming both orders."""
    import dataclasses

    from gtp_format.errors import FormatError
    from gtp_format.megatron.view import megatron_views

    ckpt = open_checkpoint(MEGATRON / "pair_fp32norm_dp2_dp_reshardable")
    swap = {"gbuf_idx_0.dtype_(torch.bfloat16": "gbuf_idx_1.dtype_(torch.bfloat16",
            "gbuf_idx_1.dtype_(torch.float32": "gbuf_idx_0.dtype_(torch.float32"}

    def renamed(k: str) -> str:
        return next((k.replace(a, b) for a, b in swap.items() if a in k), k)

    ckpt.entries = {renamed(k): dataclasses.replace(e, key=renamed(e.key)) for k, e in ckpt.entries.items()}
    with pytest.raises(FormatError, match="hold param dtypes") as err:
        megatron_views(ckpt)
    assert "\n" not in str(err.value)


def test_expert_tp_parts_are_megatrons_column_and_row_splits() -> None:
    """TP2 x expert TP2 (megatron-core's own save): each expert's linear_fc1 is split along its output
    axis and linear_fc2 along its input axis over the two expert-TP ranks, every part in the buffer
    of its own expert model-parallel rank (``dp_group_idx = etp_rank + ETP x ep_rank``)."""
    src = open_source(MEGATRON / "pair_moe_tp2_etp2_dp_reshardable", megatron=True, experts=True)
    experts = [v for v in src.views.values() if v.is_expert]
    assert len(experts) == 8
    for v in experts:
        assert v.tp_mode == ("column" if "linear_fc1" in v.name else "row"), v.name
        ep_rank = (v.expert or 0) // 2
        assert [(h.ref.dp_group_idx, h.spec.tp_rank, h.primary) for h in v.holders] == \
            [(2 * ep_rank, 0, True), (2 * ep_rank + 1, 1, True)], v.name
