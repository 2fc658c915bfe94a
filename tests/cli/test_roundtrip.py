"""``ckpt verify-roundtrip``: real gloo ranks save, fresh ones load, everything compared bit for bit.

The runs are few and small (2 ranks where the topology does not matter, one run of the real 8-rank
default, one 8-rank and one 4-rank PATH run); usage errors are refused before any rank starts.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import assert_error_line, cli, rewrite_metadata, snapshot

from gtp_runtime import launch

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "fixtures" / "gtp"
SMALL = ("--cp", "2", "--gtp-remat", "1", "--dp", "1")  # 2 ranks, folded over CP alone
TRAIN_CHECKS = {"optimizer state after load", "model params after load", "resume losses", "resume grad norms",
                "resume params", "resume optimizer state"}
PATH_CHECKS = {"manifest", "key set", "global shape and dtype", "chunk layout", "model weights", "optimizer state",
               "per_bucket_numel"}


@pytest.fixture(scope="module")
def gtp_fixtures(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """fixtures/gtp (from ``python fixtures/make_fixtures.py``), generated into a temp folder if absent."""
    names = ("fold_cp2_g2_dp2", "fold_cp2_g2_dp2_st")
    if all((FIXTURES / n / "latest_checkpointed_iteration.txt").exists() for n in names):
        return FIXTURES
    out = tmp_path_factory.mktemp("gtp_fixtures")
    proc = subprocess.run([sys.executable, str(ROOT / "fixtures" / "make_fixtures.py"), "--out", str(out),
                           "--only", *names], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def _json(result) -> dict:
    assert result.stdout.lstrip().startswith("{"), result.stdout[:500]
    return json.loads(result.stdout)


def _by_check(doc: dict) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for c in doc["checks"]:
        out.setdefault(c["check"], []).append(c)
    return out


def test_help_has_examples():
    result = cli("verify-roundtrip", "--help")
    assert result.exit_code == 0 and "Examples" in result.stdout and "--format" in result.stdout
    assert "verify-roundtrip" in cli("--help").stdout


def _no_manifest(tmp_path: Path, src: Path) -> Path:
    dst = tmp_path / "no_manifest"
    shutil.copytree(src, dst)
    (dst / "iter_0000002" / "gtp_manifest.json").unlink()
    return dst


def _bad_world(tmp_path: Path, src: Path) -> Path:
    dst = tmp_path / "bad_world"
    shutil.copytree(src, dst)
    path = dst / "iter_0000002" / "gtp_manifest.json"
    doc = json.loads(path.read_text())
    doc["topology"]["world_size"] = 6
    path.write_text(json.dumps(doc))
    return dst


@pytest.mark.parametrize("args,needles", [
    (("--cp", "1"), ("--fold-cp needs --cp > 1", "--no-fold-cp")),
    (("--nproc", "4", "--dp", "2"), ("world size 4 != tp*cp*gtp_remat*dp",)),
    (("--nproc", "6"), ("world size 6 is not a multiple of tp*cp*gtp_remat = 4",)),
    (("--tp", "0", "--dp", "1"), ("--tp must be a positive integer",)),
])
def test_bad_usage_exits_2(args: tuple[str, ...], needles: tuple[str, ...]):
    assert_error_line(cli("verify-roundtrip", *args), 2, *needles)


@pytest.mark.parametrize("make,args,needles", [
    (None, ("--tp", "2", "--steps", "4"), ("--tp, --steps cannot be used with PATH", "manifest")),
    (_no_manifest, (), ("has no gtp_manifest.json", "only gtp_runtime checkpoints")),
    (_bad_world, (), ("gtp_manifest.json", "topology.world_size is 6 but the sizes give 8")),
])
def test_path_refusals_exit_2(tmp_path: Path, gtp_fixtures: Path, make, args: tuple[str, ...],
                              needles: tuple[str, ...]):
    src = gtp_fixtures / "fold_cp2_g2_dp2"
    path = make(tmp_path, src) if make else src
    before = snapshot(path)
    assert_error_line(cli("verify-roundtrip", path, *args), 2, *needles)
    assert snapshot(path) == before


@pytest.fixture
def no_ranks(monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    """Record (and refuse) every attempt to start ranks."""
    started: list[tuple] = []

    def refuse(world: int, fn, args: tuple, workdir, tag: str, timeout: float | None = None) -> list:
        started.append((world, fn.__name__, tag))
        raise launch.RankFailure(0, "exit", "ranks were started; the test forbids it", False)

    monkeypatch.setattr(launch, "run_local_ranks", refuse)
    return started


def _dotdot_storage(folder: Path) -> None:
    """A .metadata storage path that leaves the folder (the ranks' DCP loader would open it)."""
    def escape(md) -> None:
        idx, info = next(iter(md.storage_data.items()))
        md.storage_data[idx] = dataclasses.replace(info, relative_path="../" + info.relative_path)

    rewrite_metadata(folder, escape)
    shutil.copy(folder / "__0_0.distcp", folder.parent / "__0_0.distcp")  # something real to read out there


def _truncated_data_file(folder: Path) -> None:
    path = folder / "__1_0.distcp"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


@pytest.mark.parametrize("damage", [_dotdot_storage, _truncated_data_file])
def test_path_refused_by_verify_before_any_rank_starts(tmp_path: Path, gtp_fixtures: Path, no_ranks: list,
                                                       damage):
    run = tmp_path / "run"
    shutil.copytree(gtp_fixtures / "fold_cp2_g2_dp2", run)
    damage(run / "iter_0000002")
    before = snapshot(tmp_path)
    verify_line = assert_error_line(cli("verify", run), 1, "verify failed")
    line = assert_error_line(cli("verify-roundtrip", run, "--format", "json"), 1)
    assert line == verify_line  # the same reader, the same checks, the same words and exit code
    assert no_ranks == []
    assert snapshot(tmp_path) == before


def test_keys_need_path_and_must_match(gtp_fixtures: Path, no_ranks: list):
    assert_error_line(cli("verify-roundtrip", "--keys", "decoder.*"), 2, "--keys and --ignore", "need PATH")
    assert_error_line(cli("verify-roundtrip", gtp_fixtures / "fold_cp2_g2_dp2", "--keys", "decoder.layers.9*"), 2,
                      "--keys 'decoder.layers.9*' matches no key of")
    assert no_ranks == []


def test_train_config_is_the_launchers():
    """The run verify-roundtrip builds from its options is the one the launcher builds from its flags."""
    from ckpt_tool.roundtrip.training import train_config
    from gtp_runtime.train import build_parser, resolve

    cases = [({}, ["--cp=2", "--gtp-remat=2", "--dp=2", "--fold-cp"]),
             ({"cp": 2, "gtp_remat": 1, "dp": 1}, ["--cp=2", "--dp=1", "--fold-cp"]),
             ({"tp": 2, "cp": 1, "gtp_remat": 2, "fold_cp": False, "nproc": 8}, ["--tp=2", "--gtp-remat=2"])]
    for kw, argv in cases:
        cfg, world = train_config(**kw)
        nproc = kw.get("nproc")
        assert (cfg, world) == resolve(build_parser().parse_args([*argv, "--bucket-size=10000"]), nproc), kw


@pytest.mark.slow
def test_reduced_world_safetensors_all_checks_pass():
    result = cli("verify-roundtrip", *SMALL, "--layout", "safetensors", "--format", "json")
    assert result.exit_code == 0, (result.stdout[-3000:], result.stderr[-3000:])
    doc = _json(result)
    assert doc["ok"] and doc["failed"] == 0 and doc["mode"] == "train"
    assert (doc["config"]["world_size"], doc["config"]["layout"]) == (2, "safetensors")
    checks = _by_check(doc)
    assert set(checks) == TRAIN_CHECKS
    assert [c["rank"] for c in checks["optimizer state after load"]] == [0, 1]
    assert all(c["ok"] and c["differing"] == 0 and c["elements"] > 0 for c in doc["checks"])
    assert len(doc["resume_losses"]) == 2
    # several buckets per buffer: 3 states each plus the two counters
    assert checks["optimizer state after load"][0]["keys"] > 2 * 3 + 2


@pytest.mark.slow
def test_default_config_8_ranks():
    result = cli("verify-roundtrip", "--format", "json")
    assert result.exit_code == 0, (result.stdout[-3000:], result.stderr[-3000:])
    doc = _json(result)
    cfg = doc["config"]
    assert doc["ok"] and cfg["world_size"] == 8 and cfg["layout"] == "torch_dist"
    assert cfg["parallel"] | {"average_in_collective": False} == {
        "tp": 1, "cp": 2, "gtp_remat": 2, "dp": 2, "fold_cp": True, "expert_gtp_remat": 1,
        "average_in_collective": False}
    assert (cfg["steps"], cfg["resume_steps"]) == (3, 2)
    checks = _by_check(doc)
    assert [c["rank"] for c in checks["model params after load"]] == list(range(8))
    assert len(doc["checks"]) == 2 * 8 + 4 and all(c["ok"] for c in doc["checks"])


@pytest.mark.slow
def test_corruption_after_load_fails_naming_rank_and_key(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("GTP_ROUNDTRIP_CORRUPT", "1")
    result = cli("verify-roundtrip", *SMALL)
    line = assert_error_line(result, 1, "round trip differs", "optimizer state after load rank 1",
                             "exp_avg.cp_rank_1", "1 of ")
    assert "optimizer.distributed.dp_group_idx_0" in line
    rows = [x.split() for x in result.stdout.splitlines() if x.startswith("optimizer state after load")]
    assert [r[4:6] for r in rows] == [["0", "ok"], ["1", "DIFFERS"]]
    assert "\x1b[" not in result.stdout  # no progress bar or colour when not on a terminal


@pytest.mark.slow
def test_failing_rank_is_named_not_a_hang(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("GTP_FAULT_INJECT", "after_write:1")  # gtp_runtime kills rank 1 inside the save
    result = cli("verify-roundtrip", *SMALL, "--format", "json")
    assert_error_line(result, 1, "round trip failed while training and saving", "rank 1 exited with code 17")
    assert result.stdout == ""


@pytest.mark.slow
def test_path_mode_fixture_roundtrips(gtp_fixtures: Path):
    src = gtp_fixtures / "fold_cp2_g2_dp2"
    before = snapshot(src)
    result = cli("verify-roundtrip", src, "--format", "json")
    assert result.exit_code == 0, (result.stdout[-3000:], result.stderr[-3000:])
    doc = _json(result)
    assert doc["ok"] and doc["mode"] == "path" and doc["config"]["world_size"] == 8
    assert {c["check"] for c in doc["checks"]} == PATH_CHECKS
    assert all(c["ok"] and not c["expected"] for c in doc["checks"])
    assert snapshot(src) == before, "PATH mode must not write next to the checkpoint"


@pytest.mark.slow
def test_path_mode_reshard_and_corruption(gtp_fixtures: Path, monkeypatch: pytest.MonkeyPatch):
    """Safetensors source loaded at DP=1 (4 ranks) and saved as torch_dist: optimizer chunks are
    re-cut as expected; a corrupted element on rank 2 is the one difference found."""
    monkeypatch.setenv("GTP_ROUNDTRIP_CORRUPT", "2")
    result = cli("verify-roundtrip", gtp_fixtures / "fold_cp2_g2_dp2_st", "--dp", "1", "--layout", "torch_dist",
                 "--format", "json")
    assert_error_line(result, 1, "1 of 7 checks failed", "optimizer state", "exp_avg.cp_rank_0")
    doc = _json(result)
    assert doc["config"]["world_size"] == 4 and doc["config"]["saved_dp"] == 2
    checks = {c["check"]: c for c in doc["checks"]}
    assert [k for k, c in checks.items() if not c["ok"]] == ["optimizer state"]
    bad = checks["optimizer state"]
    assert (bad["differing_keys"], bad["differing"]) == (1, 1) and abs(bad["max_abs_diff"] - 1.0) < 1e-3
    assert "re-cut for the new DP (expected)" in checks["chunk layout"]["expected"]


@pytest.mark.slow
def test_path_mode_compares_only_the_selected_keys(gtp_fixtures: Path, monkeypatch: pytest.MonkeyPatch):
    """The corruption of the test above sits in an ``exp_avg.cp_rank_0`` key: ignoring those keys
    hides it, and the report counts only the keys selected."""
    from gtp_format.reader.checkpoint import open_checkpoint

    monkeypatch.setenv("GTP_ROUNDTRIP_CORRUPT", "2")
    src = gtp_fixtures / "fold_cp2_g2_dp2_st"
    result = cli("verify-roundtrip", src, "--dp", "1", "--ignore", "*.exp_avg.cp_rank_0", "--format", "json")
    assert result.exit_code == 0, (result.stdout[-3000:], result.stderr[-3000:])
    doc = _json(result)
    assert doc["ok"] and doc["selection"] == {"keys": [], "ignore": ["*.exp_avg.cp_rank_0"]}
    keys = open_checkpoint(src).entries
    kept = [k for k in keys if not k.endswith(".exp_avg.cp_rank_0")]
    assert len(kept) < len(keys)
    assert {c["check"]: c["keys"] for c in doc["checks"]}["key set"] == len(kept)


@pytest.mark.slow
def test_path_mode_checks_that_compare_nothing_say_skipped(gtp_fixtures: Path):
    """``--keys`` selecting only model weights: the optimizer-state check compares no key, so it is
    reported as skipped, not as passed."""
    src = gtp_fixtures / "fold_cp2_g2_dp2"
    result = cli("verify-roundtrip", src, "--keys", "decoder.*weight", "--ignore", "*optimizer*")
    assert result.exit_code == 0, (result.stdout[-3000:], result.stderr[-3000:])
    rows = [line.split() for line in result.stdout.splitlines()]
    assert any(r[:3] == ["optimizer", "state", "all"] and r[3] == "skipped" for r in rows if len(r) > 3), \
        result.stdout
    assert "skipped (--keys/--ignore selected none of their keys)" in result.stdout
    doc = _json(cli("verify-roundtrip", src, "--keys", "decoder.*weight", "--ignore", "*optimizer*",
                    "--format", "json"))
    skipped = [c["check"] for c in doc["checks"] if c["skipped"]]
    assert "optimizer state" in skipped and doc["skipped"] == len(skipped)
    assert all(not c["skipped"] for c in doc["checks"] if c["check"] == "model weights")
