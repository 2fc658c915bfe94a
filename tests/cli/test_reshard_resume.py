"""Resume from a resharded checkpoint on real gloo ranks, through the launcher, with no extra flag.

A is trained and saved at one topology; B = ``ckpt reshard A`` at another. ``--load B`` at B's
topology and ``--load A`` at A's topology then train the same global batches (the micro-batch
keeps ``lanes x micro_batch`` equal). The first resumed step's loss depends on the moved model
weights, the second's on the moved fp32 master weights and Adam moments: both must agree to the
parity tests' fp32 tolerance (different topologies reduce in a different order, so not bitwise).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import cli

TOL = 1e-5  # --reference-tol of the parity tests: relative error of losses
SMALL = ["--hidden", "32", "--ffn-hidden", "48", "--seq-length", "16", "--vocab-size", "96", "--bucket-size", "3000"]


def _train(argv: list[str]) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "gtp_runtime.train", *SMALL, *argv], capture_output=True, text=True,
                       env=env, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]


def _losses(path: Path) -> list[float]:
    return [row["loss"] for row in json.loads(path.read_text())["rows"]]


@pytest.mark.slow
@pytest.mark.parametrize("a_args,b_args,b_flags", [
    (["--cp", "2", "--gtp-remat", "2", "--fold-cp", "--micro-batch", "2"],
     ["--tp", "2", "--cp", "2", "--micro-batch", "4"],
     ["--tp", "2", "--gtp-remat", "1", "--no-fold-cp"]),
    (["--cp", "2", "--dp", "2", "--fold-cp", "--num-experts", "2", "--micro-batch", "2"],
     ["--cp", "4", "--fold-cp", "--expert-gtp-remat", "2", "--num-experts", "2", "--micro-batch", "4"],
     ["--cp", "4", "--dp", "1", "--expert-gtp-remat", "2"]),
], ids=["fold-g2-to-tp2-unfold", "moe-cp2dp2-to-cp4-eg2"])
def test_resume_at_new_topology_matches(tmp_path: Path, a_args: list[str], b_args: list[str],
                                        b_flags: list[str]) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    _train([*a_args, "--nproc-per-node", "4", "--steps", "2", "--save", str(a)])
    r = cli("reshard", a, b, *b_flags, "--format", "json")
    assert r.exit_code == 0, r.stdout + r.stderr
    _train([*a_args, "--nproc-per-node", "4", "--steps", "4", "--load", str(a), "--log-json", str(tmp_path / "a.json")])
    _train([*b_args, "--nproc-per-node", "4", "--steps", "4", "--load", str(b), "--log-json", str(tmp_path / "b.json")])
    la, lb = _losses(tmp_path / "a.json"), _losses(tmp_path / "b.json")
    assert len(la) == len(lb) == 2
    for x, y in zip(la, lb):
        assert abs(x - y) <= TOL * abs(x), (la, lb)


@pytest.mark.slow
def test_reshard_keeps_the_schedule_and_the_data_position(tmp_path: Path) -> None:
    """The lr schedule's state and the data position travel with a reshard: ``ckpt inspect`` shows
    them on B, a resume of B with another data order or schedule is refused (so B's state is read,
    not rebuilt from the iteration), and B resumed at its topology continues A's run."""
    a, b = tmp_path / "a", tmp_path / "b"
    run = ["--data-seed", "7", "--lr", "3e-3", "--lr-warmup-iters", "2", "--lr-decay-style", "cosine",
           "--lr-decay-iters", "5", "--min-lr", "1e-4", "--nproc-per-node", "4", "--steps", "5"]
    a_top = ["--cp", "2", "--gtp-remat", "2", "--fold-cp", "--micro-batch", "2"]
    b_top = ["--tp", "2", "--cp", "2", "--micro-batch", "4"]
    _train([*a_top, *run, "--save", str(a), "--save-interval", "3", "--log-json", str(tmp_path / "a.json")])
    r = cli("reshard", a / "iter_0000003", b, "--tp", "2", "--gtp-remat", "1", "--no-fold-cp", "--format", "json")
    assert r.exit_code == 0, r.stdout + r.stderr
    ma = json.loads((a / "iter_0000003" / "gtp_manifest.json").read_text())
    mb = json.loads((b / "iter_0000003" / "gtp_manifest.json").read_text())
    assert ma["opt_param_scheduler"]["num_steps"] == 3 and ma["data_position"]["consumed_train_samples"] == 12
    for key in ("opt_param_scheduler", "data_position"):
        assert mb[key] == ma[key]
    shown = json.loads(cli("inspect", b, "--format", "json").stdout)
    assert shown["opt_param_scheduler"]["num_steps"] == 3 and shown["data_position"]["dataset"]["seed"] == 7

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for flag, value, needle in (("--data-seed", "8", "data"), ("--lr-warmup-iters", "1", "opt_param_scheduler")):
        argv = [*b_top, *run, "--load", str(b)]
        argv[argv.index(flag) + 1] = value
        p = subprocess.run([sys.executable, "-m", "gtp_runtime.train", *SMALL, *argv], capture_output=True,
                           text=True, env=env, timeout=600)
        assert p.returncode == 2 and needle in p.stderr and "Traceback" not in p.stderr, p.stderr[-2000:]
    _train([*b_top, *run, "--load", str(b), "--log-json", str(tmp_path / "b.json")])
    la, lb = _losses(tmp_path / "a.json")[3:], _losses(tmp_path / "b.json")
    assert len(la) == len(lb) == 2
    for x, y in zip(la, lb):
        assert abs(x - y) <= TOL * abs(x), (la, lb)
