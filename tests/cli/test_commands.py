"""inspect / verify / show / diff on healthy checkpoints, through the Typer app."""

from __future__ import annotations

import builtins
import json
import os
from pathlib import Path

import ckpt_factory as F
import pytest
from cli_helpers import assert_error_line, cli, snapshot

COMMANDS = ("inspect", "verify", "show", "diff")


@pytest.mark.parametrize("command", COMMANDS)
def test_help_has_examples(command: str):
    result = cli(command, "--help")
    assert result.exit_code == 0 and "Examples" in result.stdout and "--format" in result.stdout


def test_top_level_help_lists_commands():
    result = cli("--help")
    assert result.exit_code == 0 and all(c in result.stdout for c in COMMANDS)


def test_inspect_json(ckpts: Path):
    result = cli("inspect", ckpts / "good", "--format", "json")
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert (doc["layout"], doc["backend"], doc["iteration"]) == ("torch_dist", "megatron torch_dist", 10)
    assert "cp2" in doc["topology"] and doc["parallel_config"]["fold_cp"] is True
    assert doc["counts"]["keys"] == 10 and doc["counts"]["byte_objects"] == 2
    assert doc["counts"]["chunks"] == 2 + 1 + 6 * 6 + 2
    assert doc["aliasing"]["status"] == "ok"
    assert [w["key"] for w in doc["weights"]] == [F.NORM, F.QKV]
    rows = doc["optimizer"]
    assert len(rows) == 6 and all(r["folded"] and r["cp_form"] == "suffix" for r in rows)
    assert [(r["state"], r["cp_rank"]) for r in rows] == [(s, c) for s in F.STATES for c in range(F.CP)]
    assert {o["category"] for o in doc["objects"]} == {"per_bucket_numel"}
    assert "chunks" not in doc


def test_inspect_table_keys_and_chunks(ckpts: Path):
    result = cli("inspect", ckpts / "good", "--keys", "decoder.*", "--chunks")
    assert result.exit_code == 0, result.stderr
    out = result.stdout
    assert "2 matching" in out and F.QKV in out and "Chunks" in out
    assert "[0, 8]" in out or "[8, 0]" in out
    assert "optimizer.distributed" not in out.split("Chunks")[1]
    doc = json.loads(cli("inspect", ckpts / "good", "--keys", "*exp_avg.cp_rank_1", "--chunks",
                         "--format", "json").stdout)
    assert [c["key"] for c in doc["chunks"]] == [F.opt_key("exp_avg", 1)] * 6
    assert all(c["file"].endswith(".distcp") and c["length"] > 0 for c in doc["chunks"])


def test_inspect_never_opens_a_data_file(ckpts: Path, monkeypatch: pytest.MonkeyPatch):
    opened: list[str] = []
    real_open, real_os_open = builtins.open, os.open

    def spy_open(file, *a, **k):
        opened.append(str(file))
        return real_open(file, *a, **k)

    def spy_os_open(path, *a, **k):
        opened.append(str(path))
        return real_os_open(path, *a, **k)

    monkeypatch.setattr(builtins, "open", spy_open)
    monkeypatch.setattr(os, "open", spy_os_open)
    result = cli("inspect", ckpts / "aliased", "--chunks")
    assert result.exit_code == 0, result.stderr
    assert any(p.endswith(".metadata") for p in opened)
    assert not [p for p in opened if p.endswith(".distcp")]


def test_inspect_reports_aliasing(ckpts: Path):
    result = cli("inspect", ckpts / "aliased")
    assert result.exit_code == 0
    assert "aliased:" in result.stdout and "ALIASED" in result.stdout and "6 chunks kept: " in result.stdout
    doc = json.loads(cli("inspect", ckpts / "aliased", "--format", "json").stdout)
    assert doc["aliasing"]["status"] == "aliased"
    assert {a["key"] for a in doc["aliasing"]["keys"]} == {F.opt_key(s, None) for s in F.STATES}


@pytest.mark.parametrize("workers", [[], ["--workers", "1"], ["--workers", "3"]], ids=["default", "w1", "w3"])
def test_verify_good_data(ckpts: Path, workers: list[str]):
    before = snapshot(ckpts / "good")
    result = cli("verify", ckpts / "good", "--data", *workers, "--format", "json")
    assert result.exit_code == 0, result.stdout
    doc = json.loads(result.stdout)
    assert doc["ok"] and doc["errors"] == 0 and doc["warnings"] == 0
    assert "data" in doc["checks"] and doc["stats"]["nonfinite"] == {}
    assert result.stderr == ""
    assert snapshot(ckpts / "good") == before


def test_verify_workers_must_be_positive(ckpts: Path):
    result = cli("verify", ckpts / "good", "--data", "--workers", "0")
    assert result.exit_code == 2 and "--workers" in result.stderr


def test_verify_reports_nan(ckpts: Path):
    doc = json.loads(cli("verify", ckpts / "good2", "--data", "--format", "json").stdout)
    assert doc["ok"] and doc["stats"]["nonfinite"] == {F.opt_key(F.CHANGED_STATE, F.CHANGED_CP): {"nan": 1, "inf": 0}}


def test_verify_aliased_fails_and_names_survivors(ckpts: Path):
    result = cli("verify", ckpts / "aliased", "--format", "json")
    assert_error_line(result, 1, "verify failed", "3 errors", "no cp_rank")
    problems = json.loads(result.stdout)["problems"]
    aliasing = [p for p in problems if p["check"] == "aliasing"]
    assert {p["key"] for p in aliasing} == {F.opt_key(s, None) for s in F.STATES}
    assert all("6 chunks kept: " in p["message"] and "(cp_rank " in p["message"] for p in aliasing)


def test_verify_cp_size_finds_missing_ranks(ckpts: Path):
    result = cli("verify", ckpts / "good", "--cp-size", "4", "--format", "json")
    assert_error_line(result, 1, "cp_rank 2")
    missing = {p["key"] for p in json.loads(result.stdout)["problems"] if p["check"] == "folded_cp_rank"}
    assert missing == {F.opt_key(s, r) for s in F.STATES for r in (2, 3)}


def test_verify_aliased_without_manifest_needs_cp_size(ckpts: Path, copy_ckpt):
    run = copy_ckpt("aliased")
    (run / "iter_0000010" / "gtp_manifest.json").unlink()
    assert cli("verify", run).exit_code == 0  # nothing says it was folded
    assert_error_line(cli("verify", run, "--cp-size", "2"), 1, "no cp_rank")


def test_verify_safetensors(ckpts: Path):
    assert cli("verify", ckpts / "st", "--data").exit_code == 0
    result = cli("verify", ckpts / "st_lossy")
    assert_error_line(result, 1, "elements are in no chunk")


def test_show_tensor_values(ckpts: Path):
    result = cli("show", ckpts / "good", F.QKV, "--values", "--format", "json")
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["values"] == F.qkv_values().tolist() and doc["chunks_read"] == 2 and doc["uncovered"] == 0
    assert doc["min"] == 0.0 and doc["nan"] == 0


def test_show_slice_reads_only_needed_chunks(ckpts: Path):
    result = cli("show", ckpts / "good", F.opt_key("exp_avg", 0), "--cp-rank", "1", "--slice", "2:6",
                 "--values", "--format", "json")
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["key"] == F.opt_key("exp_avg", 1) and doc["chunks_read"] == 2
    assert doc["values"] == F.opt_values("exp_avg", 1)[2:6].tolist()
    table = cli("show", ckpts / "st", F.QKV, "--slice", "-3:")
    assert table.exit_code == 0 and "[13, 16)" in table.stdout and "1 of 2" in table.stdout


def test_show_by_cp_rank_from_canonical_key(ckpts: Path):
    result = cli("show", ckpts / "good", F.opt_key("param", None), "--cp-rank", "0", "--format", "json")
    assert json.loads(result.stdout)["key"] == F.opt_key("param", 0)
    assert_error_line(cli("show", ckpts / "good", F.opt_key("param", None), "--cp-rank", "5"), 2,
                      "no cp_rank 5", "[0, 1]")


def test_show_byte_object(ckpts: Path):
    result = cli("show", ckpts / "good", F.PBN_UNPADDED)
    assert result.exit_code == 0 and f"[{F.UNPADDED}]" in result.stdout


def test_show_unknown_key_suggests(ckpts: Path):
    assert_error_line(cli("show", ckpts / "good", F.QKV + "x"), 2, "not in", "did you mean", F.QKV)


def test_diff_identical_and_nan(ckpts: Path, copy_ckpt):
    assert cli("diff", ckpts / "good", copy_ckpt("good")).exit_code == 0
    result = cli("diff", ckpts / "good", ckpts / "good2", "--format", "json")
    assert_error_line(result, 1, "checkpoints differ", F.opt_key(F.CHANGED_STATE, F.CHANGED_CP))
    doc = json.loads(result.stdout)
    assert doc["equal"] is False and not doc["only_in_a"] and not doc["only_in_b"]
    (d,) = doc["differences"]
    assert d["what"] == "values" and d["mismatches"] == 1 and d["first_mismatch"] == [F.CHANGED_INDEX]
    assert d["max_abs_diff"] is None  # NaN against a number has no finite distance
    # a NaN never matches a number, whatever the tolerance
    assert cli("diff", ckpts / "good", ckpts / "good2", "--atol", "1e9").exit_code == 1


def test_diff_across_layouts(ckpts: Path):
    # torch_dist (3 chunks per DP rank) against safetensors (1): compared per key, values equal
    result = cli("diff", ckpts / "good", ckpts / "st", "--format", "json")
    doc = json.loads(result.stdout)
    assert result.exit_code == 1 and doc["differences"] == []
    assert doc["only_in_a"] == sorted([F.PBN, F.PBN_UNPADDED]) and doc["only_in_b"] == []


def test_diff_key_sets(ckpts: Path):
    doc = json.loads(cli("diff", ckpts / "good", ckpts / "aliased", "--format", "json").stdout)
    assert set(doc["only_in_a"]) == {F.opt_key(s, c) for s in F.STATES for c in range(F.CP)}
    assert set(doc["only_in_b"]) == {F.opt_key(s, None) for s in F.STATES}


def test_gtp_safetensors_verify_and_bucket_numel(ckpts: Path, copy_ckpt):
    assert cli("verify", ckpts / "gtst", "--data").exit_code == 0
    run = copy_ckpt("gtst")
    index = run / "iter_0000010" / "index.json"
    doc = json.loads(index.read_text())
    for key in doc["keys"]:
        if key.startswith(F.opt_key("param", 0).split(".gbuf_idx_")[0] + ".gbuf") and ".bucket_idx_0." in key:
            doc["keys"][key]["shape"] = [F.UNPADDED + 1]  # now longer than per_bucket_numel_unpadded says
    index.write_text(json.dumps(doc))
    before = snapshot(run)
    result = cli("verify", run, "--format", "json")
    assert_error_line(result, 1)
    checks = {p["check"] for p in json.loads(result.stdout)["problems"] if p["severity"] == "error"}
    assert {"bucket_numel", "hole"} <= checks
    assert snapshot(run) == before


def test_manifest_buffers_decide_folding(copy_ckpt):
    run = copy_ckpt("aliased")
    manifest = run / "iter_0000010" / "gtp_manifest.json"
    result = cli("verify", run)
    assert_error_line(result, 1, "manifest says gbuf_idx_0 is folded")
    doc = json.loads(manifest.read_text())
    doc["buffers"][0]["excludes_cp"] = False  # an unfolded buffer needs no cp_rank
    doc["files"].pop("gtp_manifest.json", None)
    manifest.write_text(json.dumps(doc))
    assert cli("verify", run).exit_code == 0
