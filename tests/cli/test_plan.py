"""``ckpt plan``: the verdicts, and the predicted bytes per rank against what a real load reads.

The real load is this project's runtime (``python -m gtp_runtime.train --load``) on gloo ranks, with
``tests/helpers/read_counter`` counting every stored chunk each rank's verified reader decodes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
from cli_helpers import assert_error_line, cli

REPO = Path(__file__).resolve().parents[2]
COUNTER = REPO / "tests" / "helpers" / "read_counter"
MEGATRON = REPO / "fixtures" / "megatron"
SAVED = ["--cp", "2", "--dp", "2", "--fold-cp"]


def _train(argv: list[str], counter: Path | None = None) -> subprocess.CompletedProcess[str]:
    path = [str(COUNTER), str(REPO)] if counter is not None else [str(REPO)]
    path += [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]  # the caller's, after ours
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(path)}
    if counter is not None:
        env["READ_COUNTER_OUT"] = str(counter)
    return subprocess.run([sys.executable, "-m", "gtp_runtime.train", *argv], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("plan") / "ck"
    r = _train(["--nproc-per-node", "4", *SAVED, "--steps", "2", "--save", str(out)])
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def _read_by_rank(counter: Path) -> dict[int, int]:
    total: dict[int, int] = defaultdict(int)
    for f in counter.glob("*.txt"):
        for line in f.read_text().splitlines():
            rank, _key, _chunk, length = line.split("\t")
            total[int(rank)] += int(length)
    return dict(total)


@pytest.mark.parametrize("target", [("--cp", "2", "--dp", "2"), ("--cp", "2", "--dp", "1")])
def test_predicted_bytes_equal_what_the_load_reads(saved: Path, target: tuple[str, ...], tmp_path: Path) -> None:
    r = cli("plan", saved, *target, "--read-gbps", "1", "--format", "json")
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["verdict"] == "works_as_is"
    predicted = {row["rank"]: row["bytes"] for row in doc["ranks"]}
    world = len(predicted)
    counter = tmp_path / "reads"
    counter.mkdir()
    run = _train(["--nproc-per-node", str(world), *target, "--fold-cp", "--steps", "3", "--load", str(saved)],
                 counter)
    assert run.returncode == 0, run.stderr[-3000:]
    assert _read_by_rank(counter) == predicted
    assert doc["estimated_load_seconds"] == pytest.approx(sum(predicted.values()) / 1e9)


def test_other_topologies_need_a_reshard_or_cannot_load(saved: Path) -> None:
    doc = json.loads(cli("plan", saved, "--tp", "2", "--cp", "2", "--dp", "1", "--format", "json").stdout)
    assert doc["verdict"] == "needs_reshard" and not doc["ranks"]
    assert doc["commands"][0] == f"ckpt reshard {saved} DST --tp 2 --cp 2 --gtp-remat 1 --dp 1 --fold-cp"
    doc = json.loads(cli("plan", saved, "--pp", "2", "--cp", "2", "--format", "json").stdout)
    assert doc["verdict"] == "impossible" and "pipeline" in doc["reason"]


def test_megatron_verdicts() -> None:
    src = MEGATRON / "pair_pp2_tp2_dp_reshardable"
    same = json.loads(cli("plan", src, "--tp", "2", "--pp", "2", "--format", "json").stdout)
    assert same["verdict"] == "works_as_is" and same["source"]["pp"] == 2 and same["source"]["tp"] == 2
    other = json.loads(cli("plan", src, "--tp", "1", "--pp", "2", "--dp", "2", "--format", "json").stdout)
    assert other["verdict"] == "needs_reshard"
    assert other["commands"] == [f"ckpt reshard {src} DST --tp 1 --pp 2 --cp 1 --dp 2",
                                 f"ckpt export {src} DST --to fully_reshardable"]
    # Same TP/PP at another DP x CP: the buckets' padding (lcm(dp x cp, 128)) and DP slices change
    dp = json.loads(cli("plan", src, "--tp", "2", "--pp", "2", "--dp", "2", "--format", "json").stdout)
    assert dp["verdict"] == "needs_reshard" and "dp x cp 1 -> 2" in dp["reason"]
    assert dp["commands"][0] == f"ckpt reshard {src} DST --tp 2 --pp 2 --cp 1 --dp 2"
    moe = MEGATRON / "moe_ep2_dp4_dp_reshardable"
    doc = json.loads(cli("plan", moe, "--tp", "1", "--dp", "2", "--ep", "2", "--format", "json").stdout)
    assert doc["verdict"] == "needs_reshard"
    assert doc["commands"][0] == f"ckpt reshard {moe} DST --tp 1 --pp 1 --cp 1 --dp 2 --ep 2 --etp 1"
    doc = json.loads(cli("plan", moe, "--tp", "2", "--dp", "2", "--ep", "2", "--format", "json").stdout)
    assert doc["commands"] == [f"ckpt export {moe} DST --to fully_reshardable"]  # expert biases: expert TP 1 only
    assert "expert TP 1" in doc["reason"]
    doc = json.loads(cli("plan", moe, "--tp", "2", "--dp", "2", "--ep", "2", "--etp", "1", "--format", "json").stdout)
    assert doc["commands"][0] == f"ckpt reshard {moe} DST --tp 2 --pp 1 --cp 1 --dp 2 --ep 2 --etp 1"
    etp = MEGATRON / "pair_moe_tp2_etp2_dp_reshardable"
    doc = json.loads(cli("plan", etp, "--tp", "1", "--dp", "4", "--ep", "2", "--format", "json").stdout)
    assert doc["commands"][0] == f"ckpt reshard {etp} DST --tp 1 --pp 1 --cp 1 --dp 4 --ep 2 --etp 1"
    full = json.loads(cli("plan", MEGATRON / "dp2_fully_reshardable", "--tp", "2", "--format", "json").stdout)
    assert full["verdict"] == "works_as_is"


def test_megatron_expert_tp_is_read_from_the_checkpoint_and_compared(tmp_path: Path) -> None:
    """Expert TP is its own size: a load at another expert TP needs a reshard even where TP/PP/EP/DP
    match, and a checkpoint at expert TP 1 under TP 2 (expert optimizer groups PP x EP x 1) gives EP
    from those groups, not from TP."""
    src = MEGATRON / "pair_moe_tp2_etp2_dp_reshardable"
    same = json.loads(cli("plan", src, "--tp", "2", "--dp", "2", "--ep", "2", "--format", "json").stdout)
    assert same["verdict"] == "works_as_is" and same["source"]["etp"] == 2 and same["source"]["ep"] == 2
    other = json.loads(cli("plan", src, "--tp", "2", "--dp", "2", "--ep", "2", "--etp", "1", "--format",
                           "json").stdout)
    assert other["verdict"] == "needs_reshard" and "expert TP" in other["reason"]
    assert other["commands"][0] == f"ckpt reshard {src} DST --tp 2 --pp 1 --cp 1 --dp 2 --ep 2 --etp 1"
    out = tmp_path / "etp1"
    r = cli("reshard", src, out, "--tp", "2", "--dp", "2", "--ep", "2", "--etp", "1")
    assert r.exit_code == 0, r.stderr
    at1 = json.loads(cli("plan", out, "--tp", "2", "--dp", "2", "--ep", "2", "--etp", "1", "--format",
                         "json").stdout)
    assert (at1["verdict"], at1["source"]["etp"], at1["source"]["ep"]) == ("works_as_is", 1, 2)
    at2 = json.loads(cli("plan", out, "--tp", "2", "--dp", "2", "--ep", "2", "--format", "json").stdout)
    assert at2["verdict"] == "needs_reshard"


def test_megatron_reshard_command_from_the_plan_gives_a_checkpoint_that_loads_as_is(tmp_path: Path) -> None:
    """The command ``ckpt plan`` prints, run as printed (DST filled in), yields a checkpoint whose plan at
    that topology is works_as_is (megatron-core's loader on it: tests/cli/test_megatron_load.py)."""
    src = MEGATRON / "pair_pp2_tp2_dp_reshardable"
    doc = json.loads(cli("plan", src, "--tp", "1", "--pp", "2", "--dp", "2", "--format", "json").stdout)
    words = doc["commands"][0].split()
    assert words[:2] == ["ckpt", "reshard"] and words[3] == "DST"
    dst = tmp_path / "dst"
    r = cli(*words[1:3], dst, *words[4:])
    assert r.exit_code == 0, r.stderr
    again = json.loads(cli("plan", dst, "--tp", "1", "--pp", "2", "--dp", "2", "--format", "json").stdout)
    assert again["verdict"] == "works_as_is", again["reason"]


def test_bad_input_is_one_line(tmp_path: Path) -> None:
    assert_error_line(cli("plan", tmp_path / "nothing", "--tp", "2"), 2, "nothing")
