"""Genuine megatron-core checkpoints (fixtures/megatron, no manifest): topology from the checkpoint, no false alarm.

megatron-core never folds CP, so no CP size given on the command line may turn its cp-less
optimizer keys into an aliasing alarm; the topology ``inspect`` prints must equal what the fixture
generator recorded from megatron's own ``parallel_state`` (``expected.json``: ``topology``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_helpers import cli

MEGATRON = Path(__file__).resolve().parents[2] / "fixtures" / "megatron"
GENUINE = sorted(p.name for p in MEGATRON.iterdir()
                 if (p / "expected.json").is_file() and (p / "iter_0000002").is_dir())


def test_there_are_genuine_fixtures() -> None:
    assert len(GENUINE) >= 8, GENUINE


@pytest.mark.parametrize("name", GENUINE)
@pytest.mark.parametrize("cp_args", [(), ("--cp-size", "2"), ("--cp-size", "4")])
def test_every_genuine_checkpoint_verifies_clean(name: str, cp_args: tuple[str, ...]) -> None:
    r = cli("verify", MEGATRON / name, *cp_args, "--format", "json")
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["errors"] == 0
    assert not [p for p in doc["problems"] if p["check"] in ("aliasing", "folded_cp_rank")], doc["problems"]


@pytest.mark.parametrize("name", GENUINE)
def test_topology_is_read_from_the_checkpoint(name: str) -> None:
    expected = json.loads((MEGATRON / name / "expected.json").read_text())
    want = expected["topology"]
    for cp_args in ((), ("--cp-size", "2")):
        r = cli("inspect", MEGATRON / name, *cp_args, "--format", "json")
        assert r.exit_code == 0, r.stderr
        doc = json.loads(r.stdout)
        meg = doc["megatron_topology"]
        got = {k: meg[k] for k in ("tp", "pp", "cp", "dp")}
        assert got == {k: want[k] for k in ("tp", "pp", "cp", "dp")}
        assert meg["world"] == want["world_size"] and meg["ep"] == want.get("ep", 1)
        assert meg["vpp"] == want.get("vpp", 1)  # virtual pipeline stages: from the ranks that wrote each layer
        assert meg["format"] == expected["distrib_optim_sharding_type"]
        assert meg["folded"] is False and "not folded" in doc["topology"]
        assert doc["aliasing"]["status"] in ("not_folded", "no_optimizer")
        assert "pass --cp-size" not in r.stdout


def test_cp_size_contradicting_the_checkpoint_is_a_warning_not_an_alarm() -> None:
    r = cli("verify", MEGATRON / "tp2_dp2_dp_reshardable", "--cp-size", "2", "--format", "json")
    doc = json.loads(r.stdout)
    assert r.exit_code == 0 and doc["errors"] == 0
    assert any("records cp=1" in p["message"] for p in doc["problems"] if p["severity"] == "warning")


def test_explicit_folded_flag_still_declares_folding() -> None:
    """Folding comes from our manifest or an explicit flag: --folded with --cp-size 2 is that flag,
    and then the cp-less keys of a CP=2 save are what an aliased save looks like."""
    r = cli("verify", MEGATRON / "cp2_dp2_dp_reshardable", "--cp-size", "2", "--folded")
    assert r.exit_code == 1
    assert "no cp_rank" in r.stderr


def test_topology_without_common_state_comes_from_keys() -> None:
    """The keys alone (rng_state's shape, data files, dp_group_idx) fix TP, PP and dp x cp."""
    from gtp_format.megatron.topology import derive
    from gtp_format.reader.checkpoint import open_checkpoint

    for name, (tp, pp, dp_cp) in {"tp2_dp2_dp_reshardable": (2, 1, 2), "pp2_dp2_dp_reshardable": (1, 2, 2),
                                  "cp2_dp2_dp_reshardable": (1, 1, 4)}.items():
        topo = derive(open_checkpoint(MEGATRON / name), read_common_state=False)
        assert (topo.tp, topo.pp, topo.dp_cp) == (tp, pp, dp_cp), name
        assert "dp x cp" in topo.describe() and "not folded" in topo.describe()


def test_migrate_aliased_does_not_treat_a_megatron_checkpoint_as_aliased(tmp_path: Path) -> None:
    from cli_helpers import assert_error_line

    for args in ((), ("--cp-size", "2")):
        assert_error_line(cli("migrate-aliased", MEGATRON / "cp2_dp2_dp_reshardable", tmp_path / "dst", *args), 2,
                          "megatron-core does not fold CP", "nothing to migrate")
    assert not list(tmp_path.iterdir())
