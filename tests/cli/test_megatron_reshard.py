"""``ckpt reshard`` of genuine megatron-core 0.19.2 ``dp_reshardable`` checkpoints (fixtures/megatron).

The independent reference for the target layout is megatron-core itself: resharding one fixture
to the topology another fixture was *saved* at by megatron-core (same model) must give that
fixture's key set, every global shape, and its ``per_bucket_numel`` values. The state must move
bit for bit: every parameter's bf16 weight, fp32 master and Adam moments, read back through the
output's own per-parameter view (derived afresh from its keys and chunks), equal the source's.
megatron-core's own loader on the output is ``tests/cli/test_megatron_load.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_helpers import assert_error_line, cli

from ckpt_tool.copying import WEIGHT_STATE as WEIGHT
from ckpt_tool.copying.source import open_source
from gtp_format.megatron.topology import common_state, derive
from gtp_format.names import STATES
from gtp_format.reader.checkpoint import Checkpoint, open_checkpoint
from gtp_format.reader.inert_object import load_record

MEGATRON = Path(__file__).resolve().parents[2] / "fixtures" / "megatron"

# (source, target flags, the fixture megatron-core saved at that topology, (tp, pp, cp, dp))
CASES = [
    ("tp2_dp2_dp_reshardable", ("--tp", "1", "--pp", "2", "--dp", "2"), "pp2_dp2_dp_reshardable", (1, 2, 1, 2)),
    ("tp2_dp2_dp_reshardable", ("--tp", "1", "--cp", "2", "--dp", "2"), "cp2_dp2_dp_reshardable", (1, 1, 2, 2)),
    ("pp2_dp2_dp_reshardable", ("--tp", "2", "--pp", "1", "--dp", "2"), "tp2_dp2_dp_reshardable", (2, 1, 1, 2)),
    ("pair_pp2_tp2_dp_reshardable", ("--pp", "1", "--dp", "2"), "pair_tp2_dp2_dp_reshardable", (2, 1, 1, 2)),
    ("pair_tp2_dp2_dp_reshardable", ("--pp", "2", "--dp", "1"), "pair_pp2_tp2_dp_reshardable", (2, 2, 1, 1)),
    ("pair_pp4_dp_reshardable", ("--pp", "4"), "pair_pp4_dp_reshardable", (1, 4, 1, 1)),
    # MoE (chained dense + expert optimizer, EP2): PP2 x DP2 <-> PP1 x DP4, megatron-core's own saves of one model
    ("moe_pp2_ep2_dp_reshardable", ("--pp", "1", "--dp", "4"), "moe_ep2_dp4_dp_reshardable", (1, 1, 1, 4)),
    ("moe_ep2_dp4_dp_reshardable", ("--pp", "2", "--dp", "2"), "moe_pp2_ep2_dp_reshardable", (1, 2, 1, 2)),
    # untied: no fixture of that model at TP2 x PP1 x DP1; the state check and verify still hold
    ("pair_untied_pp2_dp_reshardable", ("--tp", "2", "--pp", "1"), None, (2, 1, 1, 1)),
    # two buffers (bf16 + fp32 layernorms): at PP2 the second stage starts with a layernorm, so its
    # fp32 buffer is gbuf 0 (megatron-core's own load of it: tests/cli/test_megatron_load.py)
    ("pair_fp32norm_dp2_dp_reshardable", ("--pp", "2", "--dp", "1"), None, (1, 2, 1, 1)),
    ("pair_fp32norm_dp2_dp_reshardable", ("--tp", "2", "--dp", "1"), None, (2, 1, 1, 1)),
    # expert TP (issue 24 leftover c): the TP2 x expert TP2 x EP2 pair onto its own topology must give
    # megatron-core's own save's keys, shapes and per_bucket_numel; to TP1, to TP2 x expert TP1, and the
    # TP1 MoE pair (expert biases: expert TP 1) to TP2
    ("pair_moe_tp2_etp2_dp_reshardable", ("--tp", "2", "--dp", "2", "--ep", "2", "--etp", "2"),
     "pair_moe_tp2_etp2_dp_reshardable", (2, 1, 1, 2)),
    ("pair_moe_tp2_etp2_dp_reshardable", ("--tp", "1", "--dp", "4", "--ep", "2"), None, (1, 1, 1, 4)),
    ("pair_moe_tp2_etp2_dp_reshardable", ("--tp", "2", "--dp", "2", "--ep", "2", "--etp", "1"), None, (2, 1, 1, 2)),
    ("pair_moe_ep2_dp_reshardable", ("--tp", "2", "--dp", "1", "--ep", "2", "--etp", "1"), None, (2, 1, 1, 1)),
    # EP 1 with expert TP = TP (the experts, and Qwen2-MoE's shared expert after them, in the dense buffers and one
    # optimizer) <-> EP 2 (the chained pair): megatron-core's own saves of each model at the other layout
    ("pair_qwen2moe_tp2_ep1_dp_reshardable", ("--tp", "1", "--dp", "2", "--ep", "2", "--etp", "1"),
     "pair_qwen2moe_ep2_dp_reshardable", (1, 1, 1, 2)),
    ("pair_qwen2moe_ep2_dp_reshardable", ("--tp", "2", "--dp", "1", "--ep", "1", "--etp", "2"),
     "pair_qwen2moe_tp2_ep1_dp_reshardable", (2, 1, 1, 1)),
    ("pair_mixtral_tp2_ep1_dp_reshardable", ("--tp", "1", "--dp", "2", "--ep", "2", "--etp", "1"),
     "pair_mixtral_ep2_dp_reshardable", (1, 1, 1, 2)),
    ("pair_mixtral_ep2_dp_reshardable", ("--tp", "2", "--dp", "1", "--ep", "1", "--etp", "2"),
     "pair_mixtral_tp2_ep1_dp_reshardable", (2, 1, 1, 1)),
    ("pair_qwen2moe_tp2_ep1_dp_reshardable", ("--tp", "2", "--dp", "1", "--ep", "1", "--etp", "2"),
     "pair_qwen2moe_tp2_ep1_dp_reshardable", (2, 1, 1, 1)),
    ("pair_qwen2moe_tp2_ep1_dp_reshardable", ("--tp", "1", "--dp", "2", "--ep", "1", "--etp", "1"), None, (1, 1, 1, 2)),
]


def _numels(ckpt: object) -> dict[str, object]:
    return {k: load_record(ckpt, e) for k, e in ckpt.entries.items()  # type: ignore[attr-defined]
            if e.kind == "bytes" and ".per_bucket_numel" in k}


@pytest.mark.parametrize("src,flags,like,topo", CASES)
def test_reshard_gives_megatrons_own_layout_and_the_same_state(src: str, flags: tuple[str, ...], like: str | None,
                                                               topo: tuple[int, int, int, int],
                                                               tmp_path: Path) -> None:
    out = tmp_path / "out"
    r = cli("reshard", MEGATRON / src, out, *flags)
    assert r.exit_code == 0, r.stderr
    assert "rng_state dropped" in r.stdout
    ours, theirs = open_checkpoint(out), open_checkpoint(MEGATRON / (like or src))
    shapes = {k: (e.kind, e.shape, e.dtype) for k, e in ours.entries.items()}
    want = {k: (e.kind, e.shape, e.dtype) for k, e in theirs.entries.items() if not k.startswith("rng_state/")}
    if like is not None:
        assert shapes == want
        assert _numels(ours) == _numels(theirs)
    else:  # the model keys are the same at any topology
        assert {k: v for k, v in shapes.items() if "optimizer." not in k} == \
            {k: v for k, v in want.items() if "optimizer." not in k}
    tp, pp, cp, dp = topo
    meg = derive(ours)
    assert (meg.tp, meg.pp, meg.cp, meg.dp, meg.world, meg.format) == (tp, pp, cp, dp, tp * pp * cp * dp,
                                                                       "dp_reshardable")
    args = common_state(ours)["args"].fields()  # type: ignore[index]
    assert args["tensor_model_parallel_size"] == tp and args["pipeline_model_parallel_size"] == pp
    assert args["context_parallel_size"] == cp and args["data_parallel_size"] == dp and args["no_save_rng"] is True
    a, b = (open_source(p, megatron=True, experts=True, dense_experts=True) for p in (MEGATRON / src, out))
    assert sorted(a.views) == sorted(b.views)
    for name, v in a.views.items():
        zeros = (0,) * len(v.full_shape)
        for state in (WEIGHT, *STATES):
            x = a.read_full_box(v, state, zeros, v.full_shape)
            y = b.read_full_box(b.views[name], state, zeros, v.full_shape)
            assert x.dtype == y.dtype and x.tobytes() == y.tobytes(), (name, state)
    if pp > 1:  # the last stage's tied output layer slot holds the word embeddings' state, bit for bit
        emb = b.views["embedding.word_embeddings.weight"]
        stages = {h.ref.dp_group_idx // tp for h in emb.holders}
        assert stages == {0, pp - 1}
        for h in emb.holders:
            x = b.reader.read_box(h.ref.key("exp_avg"), (h.start,), (h.numel,))
            first = next(g for g in emb.holders if g.spec.tp_rank == h.spec.tp_rank and g.primary)
            assert x.tobytes() == b.reader.read_box(first.ref.key("exp_avg"), (first.start,), (first.numel,)).tobytes()
    for cp_size in (None, str(cp), str(2 * cp)):  # a wrong CP size is a warning, never a false aliasing alarm
        v = cli("verify", out, "--data", *(("--cp-size", cp_size) if cp_size else ()))
        clean = "0 errors, 0 warnings" if cp_size != str(2 * cp) else "0 errors, 1 warning"
        assert v.exit_code == 0 and clean in v.stdout and "alias" not in v.stdout, v.stdout


def _assert_tensors_are_the_source_but_gaps(ours: Checkpoint, theirs: Checkpoint) -> None:
    """Every tensor of ``theirs`` is in ``ours`` with its shape and bytes, but the alignment gaps megatron-core left
    uninitialised in ``theirs``, which ``ours`` holds as zeros."""
    from gtp_format.megatron.padding import padding_ranges
    from gtp_format.reader.boxes import BoxReader

    gaps = padding_ranges(theirs)
    ra, rb = BoxReader(ours), BoxReader(theirs)
    for k, e in theirs.entries.items():
        if e.kind != "tensor":
            continue
        assert ours.entries[k].shape == e.shape, k
        x, y = ra.read_box(k, (0,) * len(e.shape), e.shape), rb.read_box(k, (0,) * len(e.shape), e.shape)
        for lo, hi in gaps.get(k, []):
            assert not x[lo:hi].any(), k
            y = y.copy()
            y[lo:hi] = 0
        assert x.tobytes() == y.tobytes(), k


def test_resharded_output_reshards_back_to_the_source(tmp_path: Path) -> None:
    """tp2 dp2 -> tp1 pp2 dp2 -> tp2 dp2: every tensor of the round trip equals the source's, but the
    alignment gaps megatron left uninitialised (written as zeros) and the dropped rng_state."""

    src = MEGATRON / "tp2_dp2_dp_reshardable"
    assert cli("reshard", src, tmp_path / "a", "--tp", "1", "--pp", "2").exit_code == 0
    r = cli("reshard", tmp_path / "a", tmp_path / "b", "--tp", "2", "--pp", "1")
    assert r.exit_code == 0, r.stderr
    _assert_tensors_are_the_source_but_gaps(open_checkpoint(tmp_path / "b"), open_checkpoint(src))


@pytest.mark.parametrize("pair", ["pair_qwen2moe_tp2_ep1_dp_reshardable", "pair_mixtral_tp2_ep1_dp_reshardable"])
def test_one_optimizer_to_the_chained_pair_and_back_is_the_source(pair: str, tmp_path: Path) -> None:
    """EP 1 with expert TP = TP (one optimizer, the experts in the dense buffers) -> EP 2 x DP 2 at TP 1 (the chained
    dense + expert pair) -> back: every tensor equals the source's but the alignment gaps megatron-core left
    uninitialised (written as zeros); the param groups are the source's bytes; common_state's optimizer part is
    chained at EP 2 and one optimizer's again after."""
    from gtp_format.megatron.padding import padding_ranges
    from gtp_format.reader.chunks import chunk_bytes

    src = MEGATRON / pair
    assert cli("reshard", src, tmp_path / "a", "--tp", "1", "--dp", "2", "--ep", "2", "--etp", "1").exit_code == 0
    mid = common_state(open_checkpoint(tmp_path / "a"))["optimizer"]  # type: ignore[index]
    assert sorted(mid) == [0, 1] and mid[1] == {"param_state_sharding_type": "dp_reshardable"}, mid
    r = cli("reshard", tmp_path / "a", tmp_path / "b", "--tp", "2", "--dp", "1", "--ep", "1", "--etp", "2")
    assert r.exit_code == 0, r.stderr
    ours, theirs = open_checkpoint(tmp_path / "b"), open_checkpoint(src)
    assert padding_ranges(theirs) and all(not k.startswith("chained_") for k in ours.entries)
    for k, e in theirs.entries.items():
        if e.kind != "tensor" and k.endswith(".optimizer/shard_0_1"):  # the param groups: the source's bytes
            assert bytes(chunk_bytes(ours, ours.entries[k], ours.entries[k].chunks[0])) == \
                bytes(chunk_bytes(theirs, e, e.chunks[0])), k
    _assert_tensors_are_the_source_but_gaps(ours, theirs)
    assert common_state(ours)["optimizer"] == common_state(theirs)["optimizer"]  # type: ignore[index]


@pytest.mark.parametrize("pair", ["qwen2moe", "mixtral"])
def test_the_chained_pair_from_ep1_holds_megatron_cores_own_param_groups(pair: str, tmp_path: Path) -> None:
    """EP 1 with expert TP = TP (``pair_<x>_tp2_ep1``, one optimizer) -> TP 1 x DP 2 x EP 2: every optimizer object's
    pickle (the dense groups under ``chained_0.``, the expert optimizer's under ``chained_1.``: the decay group alone,
    the SwiGLU experts having no bias) is megatron-core's own save of the same state at that topology
    (``pair_<x>_ep2``), opcode for opcode; every record of the blob but torch's per-save serialization id."""
    from ckpt_tool.copying.megatron_blobs import blob_records
    from gtp_format.reader.chunks import chunk_bytes

    r = cli("reshard", MEGATRON / f"pair_{pair}_tp2_ep1_dp_reshardable", tmp_path / "a", "--tp", "1", "--dp", "2",
            "--ep", "2", "--etp", "1")
    assert r.exit_code == 0, r.stderr
    ours, theirs = open_checkpoint(tmp_path / "a"), open_checkpoint(MEGATRON / f"pair_{pair}_ep2_dp_reshardable")
    keys = sorted(k for k in theirs.entries if k.endswith(".optimizer/shard_0_1"))
    assert sorted(k for k in ours.entries if k.endswith(".optimizer/shard_0_1")) == keys
    assert any(k.startswith("chained_1.") for k in keys)
    for k in keys:
        a, b = (dict(blob_records(str(c.root), k, bytes(chunk_bytes(c, c.entries[k], c.entries[k].chunks[0])))[1])
                for c in (ours, theirs))
        assert sorted(a) == sorted(b), k
        for name in a:
            assert name == ".data/serialization_id" or a[name] == b[name], (k, name)
        assert len(load_record(ours, ours.entries[k])[0]["param_groups"]) == (1 if k.startswith("chained_1.") else 2)


def test_the_expert_groups_leave_out_the_no_decay_group_exactly() -> None:
    """Without expert biases the expert optimizer keeps only its ``wd_mult`` 1 group (the pickler's one-item list
    form); a no-decay group whose memo entries the kept group refers to, or groups that are not dicts, are refused
    in one line."""
    from ckpt_tool.copying.megatron_blobs import blob_records
    from ckpt_tool.hf.megatron_fresh import param_groups, torch_object
    from ckpt_tool.reshard.megatron_chain import expert_groups
    from gtp_format.errors import FormatError
    from gtp_format.reader.object_blob import load_plain_object
    from gtp_format.reader.zip_blob import ViewReader

    def decode(blob: bytes) -> object:
        return load_plain_object(ViewReader(memoryview(blob)))

    dense = param_groups(1e-3, 1e-5, False, 2.0)
    got = expert_groups("x", "k", torch_object([{"param_groups": dense}]), no_decay=False)
    assert decode(got) == [{"param_groups": [dict(dense[0], is_expert_parallel=True)]}]
    want = torch_object([{"param_groups": param_groups(1e-3, 1e-5, True, 2.0)}])  # the pickler's own bytes of it
    assert dict(blob_records("x", "k", got)[1])["data.pkl"] == dict(blob_records("x", "k", want)[1])["data.pkl"]
    both = expert_groups("x", "k", torch_object([{"param_groups": dense}]))
    assert [g["wd_mult"] for g in decode(both)[0]["param_groups"]] == [1.0, 0.0]  # type: ignore[index]
    for bad, needle in (([dense[1], dense[0]], "share memo entries"), ([dense[0], 3], "other than dicts")):
        with pytest.raises(FormatError, match=needle) as err:
            expert_groups("x", "k", torch_object([{"param_groups": bad}]), no_decay=False)
        assert "\n" not in str(err.value)


def test_the_optimizer_part_edits_are_exact_and_refuse_what_is_not_megatrons() -> None:
    """``common_state``'s optimizer part between one optimizer and the chained pair, on the pickle's opcodes: the
    two edits undo each other (and the rest of the object stays), and a part that is not megatron-core's (no
    ``param_state_sharding_type``, a second field) or param groups with no bool ``is_expert_parallel`` are refused
    in one line, never guessed."""
    from ckpt_tool.hf.megatron_fresh import torch_object
    from ckpt_tool.reshard.megatron_chain import chain_common, expert_groups
    from gtp_format.errors import FormatError
    from gtp_format.reader.object_blob import load_plain_object
    from gtp_format.reader.zip_blob import ViewReader

    def decode(blob: bytes) -> object:
        return load_plain_object(ViewReader(memoryview(blob)))

    one = {"param_state_sharding_type": "dp_reshardable"}
    state = {"iteration": 2, "optimizer": one, "opt_param_scheduler": {"num_steps": 16},
             "content_metadata": {"distrib_optim_sharding_type": "dp_reshardable"}}
    blob = torch_object([state])
    chained = chain_common("x", blob, True)
    assert decode(chained) == [dict(state, optimizer={0: one, 1: one})]
    assert chain_common("x", chained, True) == chained and chain_common("x", blob, False) == blob
    assert decode(chain_common("x", chained, False)) == [state]
    groups = [{"is_expert_parallel": False, "wd_mult": w, "step": 2.0} for w in (1.0, 0.0)]
    assert decode(expert_groups("x", "k", torch_object([{"param_groups": groups}]))) == [
        {"param_groups": [dict(g, is_expert_parallel=True) for g in groups]}]
    for bad, needle in (({"iteration": 2, "optimizer": {"x": 1}}, "records no param_state_sharding_type"),
                        ({"optimizer": dict(one, more=1)}, "holds more than param_state_sharding_type"),
                        ({"optimizer": {"param_state_sharding_type": 3}}, "not a string")):
        with pytest.raises(FormatError, match=needle) as err:
            chain_common("x", torch_object([bad]), True)
        assert "\n" not in str(err.value)
    for bad_groups, needle in (([{"wd_mult": 1.0}], "record no is_expert_parallel"),
                               ([{"is_expert_parallel": 1}], "is not a bool")):
        with pytest.raises(FormatError, match=needle):
            expert_groups("x", "k", torch_object([{"param_groups": bad_groups}]))


@pytest.mark.parametrize("src,flags,needle", [
    ("moe_ep2_dp4_dp_reshardable", ("--tp", "2"), "only at expert TP 1"),
    ("moe_ep2_dp4_dp_reshardable", ("--tp", "2", "--ep", "1"), "only at expert TP 1"),  # EP 1: dense, TP 2
    ("pair_moe_tp2_etp2_dp_reshardable", ("--ep", "2", "--etp", "3"), "does not divide"),
    ("tp2_dp2_dp_reshardable", ("--etp", "2"), "has no experts"),
    ("moe_ep2_dp4_dp_reshardable", ("--ep", "3"), "--ep 3 does not divide"),
    ("dp2_fully_reshardable", ("--dp", "1"), "no dp_reshardable optimizer keys"),
    ("tp2_dp2_dp_reshardable", ("--pp", "3"), "do not split evenly over PP 3"),
    ("tp2_dp2_dp_reshardable", ("--tp", "3"), "does not split over TP 3"),
    ("tp2_dp2_dp_reshardable", ("--gtp-remat", "2"), "--gtp-remat: is for this runtime's checkpoints"),
    ("tp2_dp2_dp_reshardable", ("--ep", "2"), "has no experts"),
])
def test_what_reshard_cannot_do_for_megatron_is_refused_in_one_line(src: str, flags: tuple[str, ...], needle: str,
                                                                    tmp_path: Path) -> None:
    assert_error_line(cli("reshard", MEGATRON / src, tmp_path / "x", *flags), 2, needle)
    assert not list(tmp_path.iterdir())


def test_expert_keys_split_unevenly_are_refused_in_one_line() -> None:
    """Expert TP: every (layer, expert) of an expert key in the same equal parts (megatron-core writes
    one chunk per part). The MoE pair with one (layer, expert) of linear_fc1 split in two (in memory)
    is not what it writes: the view names it in one line."""
    import dataclasses

    from gtp_format.errors import FormatError
    from gtp_format.megatron.view import megatron_views

    ckpt = open_checkpoint(MEGATRON / "pair_moe_ep2_dp_reshardable")
    key = "decoder.layers.mlp.experts.experts.linear_fc1.weight"
    e = ckpt.entries[key]
    c = e.chunks[0]
    half = c.sizes[2] // 2
    halves = [c._replace(offsets=(*c.offsets[:2], i * half, *c.offsets[3:]), sizes=(*c.sizes[:2], half,
                                                                                      *c.sizes[3:]))
              for i in range(2)]
    chunks = [*halves, *e.chunks[1:]]
    ckpt.entries[key] = dataclasses.replace(e, chunks=tuple(ch._replace(index=i) for i, ch in enumerate(chunks)))
    with pytest.raises(FormatError, match="nor split in equal parts") as err:
        megatron_views(ckpt, experts=True)
    assert "\n" not in str(err.value)


def test_moe_with_pp_exports_and_verifies(tmp_path: Path) -> None:
    """MoE at PP 2 (megatron-core's own save): its view is established (so verify --data leaves the
    uninitialised padding out: no NaN alarm), and the fully_reshardable export holds every
    parameter's state as the view reads it (its reshard: ``CASES``)."""
    src = MEGATRON / "moe_pp2_ep2_dp_reshardable"
    v = cli("verify", src, "--data")
    assert v.exit_code == 0 and "0 errors, 0 warnings" in v.stdout, v.stdout
    r = cli("export", src, tmp_path / "fr", "--to", "fully_reshardable")
    assert r.exit_code == 0, r.stderr
    a, b = open_source(src, megatron=True, experts=True), open_checkpoint(tmp_path / "fr")
    from gtp_format.reader.boxes import BoxReader

    rb = BoxReader(b)
    assert any(v.is_expert for v in a.views.values())
    for v in a.views.values():
        for state in STATES:
            key = f"optimizer.state.{state}.{v.model_key}"
            lead = v.lead
            got = rb.read_box(key, (*lead, *(0,) * len(v.full_shape)), (*(1,) * len(lead), *v.full_shape))
            want = a.read_full_box(v, state, (0,) * len(v.full_shape), v.full_shape)
            assert got.tobytes() == want.tobytes(), (v.name, state)
