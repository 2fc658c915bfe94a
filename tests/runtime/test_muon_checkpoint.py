"""Muon checkpoints end to end: save, bit-exact resume, the manifest's owners, inspect, verify,
reshard to another DP size and back, verify-roundtrip --optimizer muon, and the refusals.

One 4-rank Muon run (cp2 dp2 folded, several buckets) saves at iterations 2 and 4; the other runs
load what it wrote. The launcher command lines are ``launcher_cases.MUON_CHECKPOINT_RUNS``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import launcher_cases as lc
import pytest
from cli_helpers import assert_error_line, cli

from gtp_format.names import MANIFEST_FILE
from gtp_runtime.muon import muon_owned


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("muon_ckpt")
    ckpt, resharded = tmp / "ckpt", tmp / "resharded"
    out = {}
    for name, (argv, _) in lc.MUON_CHECKPOINT_RUNS.items():  # in order: save before the loads
        argv = [a.replace("{ckpt}", str(ckpt)) for a in argv]
        out[name] = lc.run(name, [*lc.LAUNCHER, *argv], tmp / f"{name}.json")
    out["reshard"] = cli("reshard", str(ckpt / "iter_0000002"), str(resharded), "--dp", "1", "--format", "json")
    argv = [a.replace("{resharded}", str(resharded)) for a in lc.MUON_RESHARDED_LOAD[0]]
    out["resharded-load"] = lc.run("resharded-load", [*lc.LAUNCHER, *argv], tmp / "resharded-load.json")
    out["ckpt"], out["resharded"] = ckpt, resharded
    return out


def _rows(res: lc.RunResult) -> list[tuple]:
    return [(r["step"], r["loss"], r["grad_norm"], r["num_zeros"]) for r in res.log["rows"]]


def test_save_and_resume_bit_for_bit(runs):
    save, load = runs["save"], runs["load"]
    assert save.returncode == 0, save.explain()
    assert load.returncode == 0, load.explain()
    assert "at iteration 2" in load.stdout
    assert _rows(load) == _rows(save)[2:]  # losses, grad norms and zero counts, exactly


def test_manifest_names_every_params_optimizer(runs):
    doc = json.loads((runs["ckpt"] / "iter_0000004" / MANIFEST_FILE).read_text())
    opt = doc["optimizer"]
    assert doc["format_version"] == 2 and opt["type"] == "muon" and opt["step"] == 4
    assert opt["muon_lr"] == 0.02 and opt["muon_momentum"] == 0.95 and opt["muon_ns_steps"] == 5
    names = {p["name"] for b in doc["buffers"] for k in b["buckets"] for p in k["params"]}
    assert opt["param_optimizers"] == {n: "muon" if muon_owned(n) else "adamw" for n in names}
    assert sorted(opt["param_optimizers"].values()).count("muon") == 8  # 4 linears x 2 layers


def test_inspect_shows_owners(runs):
    res = cli("inspect", str(runs["ckpt"]), "--params", "--format", "json")
    assert res.exit_code == 0, res.stdout + res.stderr
    doc = json.loads(res.stdout)
    assert doc["optimizer_info"]["type"] == "muon" and doc["optimizer_info"]["params"] == {"adamw": 7, "muon": 8}
    assert all(r["optimizer"] == ("muon" if muon_owned(r["name"]) else "adamw") for r in doc["params"])
    table = cli("inspect", str(runs["ckpt"]), "--params")
    assert "muon at step 4 (adamw 7 params, muon 8 params)" in table.stdout


def test_verify_passes_and_catches_a_wrong_owner_table(runs, tmp_path: Path):
    ok = cli("verify", str(runs["ckpt"]), "--data", "--format", "json")
    assert ok.exit_code == 0, ok.stdout + ok.stderr
    bad = tmp_path / "bad"
    shutil.copytree(runs["ckpt"] / "iter_0000004", bad)
    path = bad / MANIFEST_FILE
    doc = json.loads(path.read_text())
    del doc["optimizer"]["param_optimizers"]["decoder.layers.0.mlp.linear_fc1.weight"]
    doc["optimizer"]["param_optimizers"]["output_layer.bias"] = "adamw"
    path.write_text(json.dumps(doc))
    res = cli("verify", str(bad), "--format", "json")
    assert res.exit_code == 1, res.stdout + res.stderr
    found = [p for p in json.loads(res.stdout)["problems"] if p["check"] == "param_optimizers"]
    assert any("output_layer.bias" in p["message"] for p in found), found
    assert any("linear_fc1.weight" in p["message"] and "unnamed" in p["message"] for p in found), found


def test_loading_muon_state_as_adam_is_refused(runs):
    res = runs["load-as-adam"]
    assert res.returncode == 2, res.explain()
    err = [line for line in res.stderr.splitlines() if line.startswith("error: ")]
    assert len(err) == 1 and "saved with --optimizer muon" in err[0] and "pass --optimizer muon" in err[0], res.stderr


def test_gather_format_refused_with_folded_muon_buffers(runs):
    res = runs["refuse-dp-zero-gather-scatter"]
    assert res.returncode == 2, res.explain()
    assert "dp_zero_gather_scatter" in res.stderr and "dp_reshardable" in res.stderr
    assert not list(runs["ckpt"].parent.glob("ckpt-refused/iter_*"))


def test_reshard_keeps_owners_and_state_and_resumes_at_another_dp(runs, tmp_path: Path):
    """Iteration 2 resharded to dp 1 keeps the owner table, verifies, resumes there; resharded
    back to dp 2 it is bit for bit the checkpoint the run wrote (momentum and moments included)."""
    assert runs["reshard"].exit_code == 0, runs["reshard"].stdout + runs["reshard"].stderr
    src = json.loads((runs["ckpt"] / "iter_0000002" / MANIFEST_FILE).read_text())["optimizer"]
    dst = json.loads((runs["resharded"] / "iter_0000002" / MANIFEST_FILE).read_text())
    assert dst["format_version"] == 2 and dst["optimizer"] == src and dst["topology"]["dp"] == 1
    assert cli("verify", str(runs["resharded"]), "--data").exit_code == 0
    res = runs["resharded-load"]
    assert res.returncode == 0, res.explain()
    assert "at iteration 2" in res.stdout and [r[0] for r in _rows(res)] == [3, 4]
    back = tmp_path / "back"
    assert cli("reshard", str(runs["resharded"]), str(back), "--dp", "2").exit_code == 0
    diff = cli("diff", str(runs["ckpt"] / "iter_0000002"), str(back), "--format", "json")
    assert diff.exit_code == 0, diff.stdout[-3000:]
    assert json.loads(diff.stdout)["equal"] is True


def test_export_of_muon_optimizer_state_is_refused_weights_export(runs, tmp_path: Path):
    """Megatron's Adam state names would mislabel Muon's momentum: refused in one line; weights export."""
    for argv in (["--to", "fully_reshardable"], ["--to", "hf", "--optimizer"]):
        res = cli("export", str(runs["ckpt"]), str(tmp_path / "out"), *argv)
        assert_error_line(res, 2, "Muon checkpoint", "export the weights only")
        assert not (tmp_path / "out").exists()
    ok = cli("export", str(runs["ckpt"]), str(tmp_path / "hf"), "--to", "hf")
    assert ok.exit_code == 0, ok.stdout + ok.stderr
    assert list((tmp_path / "hf").glob("*.safetensors"))


@pytest.mark.slow
def test_verify_roundtrip_muon_bit_exact():
    """Every rank's Muon momentum, AdamW moments, master params and model shards come back bit for
    bit in fresh processes, and the resumed run equals the uninterrupted one (4 ranks, cp2 dp2
    folded: two owners per matrix's pieces, .cp_rank_{i} keys)."""
    res = cli("verify-roundtrip", "--optimizer", "muon", "--cp", "2", "--gtp-remat", "1", "--dp", "2",
              "--format", "json")
    assert res.exit_code == 0, res.stdout[-3000:] + res.stderr[-3000:]
    doc = json.loads(res.stdout)
    assert doc["ok"] and doc["config"]["optimizer"] == "muon" and doc["config"]["world_size"] == 4
    assert len(doc["checks"]) == 2 * 4 + 4 and all(c["ok"] and c["differing"] == 0 for c in doc["checks"])
    assert len(doc["resume_losses"]) == 2
