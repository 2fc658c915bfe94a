"""Genuine megatron-core checkpoints (fixtures/megatron): padding is padding, every format named,
``show`` takes the names ``inspect --params`` prints and shows byte objects as inert records."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_helpers import cli

from gtp_format.megatron.padding import padding_ranges
from gtp_format.reader.checkpoint import open_checkpoint

MEGATRON = Path(__file__).resolve().parents[2] / "fixtures" / "megatron"
BUCKETED = ["tp2_dp2_dp_reshardable", "cp2_dp2_dp_reshardable", "pp2_dp2_dp_reshardable",
            "moe_ep2_dp4_dp_reshardable", "pair_pp2_tp2_dp_reshardable", "pair_pp4_dp_reshardable",
            "pair_qwen2moe_tp2_ep1_dp_reshardable"]  # EP 1: the experts in the dense buffer


@pytest.mark.parametrize("name", BUCKETED)
def test_padding_gaps_are_the_generators_padding_chunks(name: str) -> None:
    """The gaps the view leaves are exactly the chunks megatron's own buffers marked as padding."""
    expected = json.loads((MEGATRON / name / "expected.json").read_text())
    gaps = padding_ranges(open_checkpoint(MEGATRON / name))
    for k in expected["keys"]:
        if "params_in_bucket" not in k:
            continue
        want = sorted((c["offsets"][0], c["offsets"][0] + c["sizes"][0]) for c in k["chunk_list"] if c["padding"])
        got = [g for g in gaps[k["key"]] if g[0] < g[1]]
        covered = sorted((a, z) for a, z in want)
        assert sum(z - a for a, z in got) == sum(z - a for a, z in covered), k["key"]
        assert all(any(a <= x and y <= z for a, z in got) for x, y in covered), k["key"]


@pytest.mark.parametrize("name", BUCKETED)
def test_verify_data_counts_no_padding_nan_as_data(name: str) -> None:
    r = cli("verify", MEGATRON / name, "--data", "--format", "json")
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["warnings"] == 0 and not doc["stats"]["nonfinite"], doc["problems"]


def test_show_leaves_padding_out_of_the_statistics() -> None:
    key = "optimizer.distributed.dp_group_idx_1.gbuf_idx_0.dtype_(torch.bfloat16, torch.float32).bucket_idx_0.exp_avg"
    r = cli("show", MEGATRON / "tp2_dp2_dp_reshardable", key, "--format", "json")
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["padding"] > 0 and doc["nan"] == 0 and doc["inf"] == 0
    assert abs(doc["min"]) < 1.0 and abs(doc["max"]) < 1.0  # trained Adam moments, not 1e35 garbage


@pytest.mark.parametrize("name,fmt", [("tp2_dp2_dp_reshardable", "dp_reshardable"),
                                      ("dp2_fully_reshardable", "fully_reshardable"),
                                      ("dp2_dp_zero_gather_scatter", "dp_zero_gather_scatter")])
def test_inspect_names_the_format_and_lists_no_optimizer_state_as_weights(name: str, fmt: str) -> None:
    r = cli("inspect", MEGATRON / name, "--format", "json")
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["optimizer_format"] == fmt
    assert not [w for w in doc["weights"] if w["key"].startswith("optimizer.")]
    if fmt == "fully_reshardable":
        assert len(doc["optimizer_state"]) == 3 * len(doc["weights"])
    table = cli("inspect", MEGATRON / name).stdout
    assert fmt in table


def test_show_takes_the_names_inspect_params_prints() -> None:
    src = MEGATRON / "pp2_dp2_dp_reshardable"
    names = [p["name"] for p in json.loads(cli("inspect", src, "--params", "--format", "json").stdout)["params"]]
    assert "decoder.layers.1.self_attention.linear_qkv.weight" in names
    for name in names:
        r = cli("show", src, name, "--format", "json")
        assert r.exit_code == 0, (name, r.stderr)
        doc = json.loads(r.stdout)
        if name.startswith("decoder.layers."):
            layer = int(name.split(".")[2])
            assert doc["slice"] == [layer, layer + 1] and doc["uncovered"] == 0


@pytest.mark.parametrize("key", ["common_state/shard_0_1", "rng_state/shard_0.1_1.2",
                                 "decoder.layers.mlp.linear_fc1._extra_state/shard_0_2"])
def test_show_byte_objects_as_inert_records(key: str) -> None:
    r = cli("show", MEGATRON / "tp2_dp2_dp_reshardable", key, "--format", "json")
    assert r.exit_code == 0, r.stderr
    fields = {f["path"]: f for f in json.loads(r.stdout)["fields"]}
    if key.startswith("common_state"):
        assert fields["[0].args"]["type"] == "argparse.Namespace"
        assert fields["[0].args.tensor_model_parallel_size"]["value"] == "2"
    if key.startswith("rng_state"):
        assert any("not read" in f["value"] for f in fields.values())  # the RNG tensors' bytes are not decoded
    text = cli("show", MEGATRON / "tp2_dp2_dp_reshardable", key)
    assert text.exit_code == 0 and "\x1b" not in text.stdout and "weights_only" not in text.stdout + text.stderr
