"""``ckpt export --to fully_reshardable`` of a genuine megatron-core ``dp_reshardable`` checkpoint
writes every key megatron-core's own ``fully_reshardable`` save of the same training state has
(fixtures/megatron/pair_*), rng_state apart: the ``_extra_state`` byte objects as stored, and a
``common_state`` that decodes (as inert records) to megatron's own but for ``args``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from cli_helpers import assert_error_line, cli

from gtp_format.megatron.topology import common_state
from gtp_format.reader.checkpoint import open_checkpoint
from gtp_format.reader.chunks import chunk_bytes

MEGATRON = Path(__file__).resolve().parents[2] / "fixtures" / "megatron"
PAIRS = ["pair_tp2_dp2_dp_reshardable", "pair_pp2_tp2_dp_reshardable", "pair_pp4_dp_reshardable",
         "pair_moe_ep2_dp_reshardable", "pair_untied_pp2_dp_reshardable", "pair_pp2_dp2_dp_reshardable",
         "pair_cp2_dp2_dp_reshardable", "pair_fp32norm_dp2_dp_reshardable", "pair_moe_tp2_etp2_dp_reshardable"]


def _plain(state: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in state.items() if k != "args"}  # args name the fixture and its format flag


@pytest.mark.parametrize("pair", PAIRS)
def test_export_has_every_key_of_megatrons_own_save(pair: str, tmp_path: Path) -> None:
    out = tmp_path / "fr"
    r = cli("export", MEGATRON / pair, out, "--to", "fully_reshardable", "--format", "json")
    assert r.exit_code == 0, r.stderr
    ours, theirs = open_checkpoint(out), open_checkpoint(MEGATRON / f"{pair}_fully_reshardable")
    rng = {k for k in theirs.entries if k.startswith("rng_state/")}
    assert rng and set(ours.entries) == set(theirs.entries) - rng
    for k, e in ours.entries.items():
        t = theirs.entries[k]
        assert (e.kind, e.shape, e.dtype) == (t.kind, t.shape, t.dtype), k
        if "._extra_state/" in k:
            assert chunk_bytes(ours, e, e.chunks[0]) == chunk_bytes(theirs, t, t.chunks[0]), k
    mine, own = common_state(ours), common_state(theirs)
    assert mine is not None and own is not None
    chained = "pair_moe" in pair  # MoE: {0: dense, 1: experts}, each with its own param_groups
    assert chained == (sorted(mine["optimizer"]) == [0, 1])
    for sub in (mine["optimizer"].values() if chained else [mine["optimizer"]]):
        assert sub["param_state_sharding_type"] == "fully_reshardable" and sub["optimizer"]["param_groups"]
    assert mine["content_metadata"]["distrib_optim_sharding_type"] == "fully_reshardable"
    assert repr(_plain(mine)) == repr(_plain(own))  # param_groups (step 2.0), scheduler, iteration
    assert '"rng_state_dropped"' in r.stdout
    line = cli("export", MEGATRON / pair, tmp_path / "fr2", "--to", "fully_reshardable").stdout
    assert f"{len(rng)} rng_state" in line and "--no-load-rng" in line, line
    v = cli("verify", out, "--data")
    assert v.exit_code == 0 and "0 errors, 0 warnings" in v.stdout, v.stdout


def test_common_state_of_another_structure_is_refused(tmp_path: Path) -> None:
    from ckpt_tool.reshard.megatron_objects import fully_reshardable_common
    from gtp_format.errors import FormatError

    ckpt = open_checkpoint(MEGATRON / "pair_tp2_dp2_dp_reshardable")
    c = ckpt.entries["common_state/shard_0_1"]
    blob = bytes(chunk_bytes(ckpt, c, c.chunks[0]))
    e = ckpt.entries["optimizer.distributed.dp_group_idx_0.optimizer/shard_0_1"]
    opt = bytes(chunk_bytes(ckpt, e, e.chunks[0]))
    with pytest.raises(FormatError, match="not supported"):  # the common state given twice: no sharding type
        fully_reshardable_common("src", blob, [opt], "fully_sharded_model_space")
    with pytest.raises(FormatError, match="not a one-element list|optimizer entries"):
        fully_reshardable_common("src", blob, [blob], "dp_reshardable")
    assert_error_line(cli("export", MEGATRON / "dp2_fully_reshardable", tmp_path / "x", "--to",
                          "fully_reshardable"), 2, "dp_reshardable")


@pytest.mark.parametrize("key", ["common_state/shard_0_1", "decoder.layers.mlp.linear_fc1._extra_state/shard_1_2"])
def test_damaged_byte_object_is_refused_not_copied(key: str, tmp_path: Path) -> None:
    import shutil

    src = tmp_path / "src"
    shutil.copytree(MEGATRON / "pair_tp2_dp2_dp_reshardable", src)
    ref = open_checkpoint(src).entries[key].chunks[0].storage
    assert ref is not None
    path = src / "iter_0000002" / ref.file
    raw = bytearray(path.read_bytes())
    raw[ref.offset + 70] ^= 0x01  # inside data.pkl: its CRC-32 no longer matches
    path.write_bytes(bytes(raw))
    assert_error_line(cli("export", src, tmp_path / "fr", "--to", "fully_reshardable"), 2, key)
    assert not (tmp_path / "fr").exists()
