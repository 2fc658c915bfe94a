"""Data, schedule and eval flags through the launcher: parity with the reference on scheduled lr and
on a megatron-core dataset, bit-exact resume of the data position and the schedule, refusals."""

from __future__ import annotations

import json
import subprocess

import launcher_cases as lc
import numpy as np
import pytest

from gtp_runtime.data.corpus import default_corpus
from gtp_runtime.data.indexed import FLAT_DOC_TOKENS

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("data_runs")
    text = np.fromfile(f"{default_corpus()}.bin", dtype=np.uint8, count=10 * FLAT_DOC_TOKENS + 4000)
    text.astype(np.uint16).tofile(root / "flat.bin")
    return {"{ckpt}": str(root / "ckpt"), "{flat}": str(root / "flat.bin"), "root": root}


def _run(name, paths):
    argv, code = lc.DATA_RUNS[name]
    argv = [paths.get(a, a) for a in argv]
    argv = [a.replace("{ckpt}", paths["{ckpt}"]) for a in argv]
    r = lc.run(name, [*lc.LAUNCHER, *argv], paths["root"] / f"{name}.json")
    assert r.returncode == code, r.explain()
    return r


@pytest.mark.parametrize("name", ["schedule-reference", "megatron-data-reference"])
def test_reference_parity(name, paths):
    r = _run(name, paths)
    assert "reference check PASSED" in r.stdout
    assert len(r.log["rows"]) == int(lc.DATA_RUNS[name][0][lc.DATA_RUNS[name][0].index("--steps") + 1])


def test_resume_is_bit_exact_with_data_position_and_schedule(paths):
    full = _run("flat-save", paths).log["rows"]
    assert [r["step"] for r in full if "valid_loss" in r] == [2, 4, 6]
    assert full[0]["lr"] == 0.0 and full[2]["lr"] == 1e-3 and full[5]["lr"] < full[3]["lr"]  # warmup, then decay
    manifest = json.loads(next((paths["root"] / "ckpt").glob("iter_0000003/gtp_manifest.json")).read_text())
    assert manifest["data_position"]["consumed_train_samples"] == 3 * 2
    assert manifest["opt_param_scheduler"]["num_steps"] == 3
    resumed = _run("flat-load", paths).log["rows"]
    keys = ("step", "loss", "grad_norm", "num_zeros", "lr", "valid_loss")
    assert [{k: r.get(k) for k in keys} for r in resumed] == [{k: r.get(k) for k in keys} for r in full[3:]]
    # ckpt inspect shows the schedule and the data position
    p = subprocess.run([str(lc.REPO / ".venv/bin/ckpt") if (lc.REPO / ".venv/bin/ckpt").exists() else "ckpt",
                        "inspect", paths["{ckpt}"], "--format", "json"], capture_output=True, text=True, env=lc.env())
    doc = json.loads(p.stdout)
    assert doc["opt_param_scheduler"]["lr_decay_style"] == "cosine" and doc["opt_param_scheduler"]["num_steps"] == 6
    assert doc["data_position"]["consumed_train_samples"] == 12


def test_resume_on_other_data_order_is_refused(paths):
    if not (paths["root"] / "ckpt" / "iter_0000003").exists():
        _run("flat-save", paths)
    r = _run("flat-load-other-seed", paths)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "seed saved 3 now 4" in lines[0] and "--data-seed" in lines[0], r.stderr


def test_token_ids_past_the_vocab_are_one_line(paths):
    r = _run("vocab-too-small", paths)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "outside --vocab-size 256" in lines[0], r.stderr


def test_hostile_index_through_the_launcher(paths):
    prefix = paths["root"] / "hostile"
    for ext in (".bin", ".idx"):
        raw = (lc.REPO / "fixtures/megatron/indexed" / f"tokens_uint16{ext}").read_bytes()
        (paths["root"] / f"hostile{ext}").write_bytes(raw if ext == ".bin" else raw[:-9])
    p = subprocess.run([*lc.LAUNCHER, "--data-path", str(prefix)], cwd=lc.REPO, env=lc.env(), capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 2 and p.stdout == ""
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "hostile.idx" in lines[0] and "truncated" in lines[0], p.stderr


def test_verify_roundtrip_resumes_with_the_saved_schedule_and_data(paths):
    """`ckpt verify-roundtrip PATH` rebuilds the run from the manifest alone, schedule and data included."""
    if not (paths["root"] / "ckpt" / "iter_0000006").exists():
        _run("flat-save", paths)
    ckpt = str(lc.REPO / ".venv/bin/ckpt") if (lc.REPO / ".venv/bin/ckpt").exists() else "ckpt"
    p = subprocess.run([ckpt, "verify-roundtrip", str(paths["root"] / "ckpt" / "iter_0000006")], cwd=lc.REPO,
                       env=lc.env(), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
