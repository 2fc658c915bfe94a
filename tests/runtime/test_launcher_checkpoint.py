"""The launcher's checkpoint flags, end to end: save at an interval, resume, refuse a format.

The checkpoint format itself is tested elsewhere; this file proves the flags reach it and that a
resumed run continues bit for bit where the uninterrupted one went.
"""

from __future__ import annotations

import launcher_cases as lc
import pytest


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ckpt_runs")
    ckpt = tmp / "ckpt"
    out = {}
    for name, (argv, _) in lc.CHECKPOINT_RUNS.items():  # in order: save before load
        argv = [a.replace("{ckpt}", str(ckpt)) for a in argv]
        out[name] = lc.run(name, [*lc.LAUNCHER, *argv], tmp / f"{name}.json")
    out["ckpt"] = ckpt
    return out


def test_save_at_interval(runs):
    res, ckpt = runs["save"], runs["ckpt"]
    assert res.returncode == 0, res.explain()
    assert sorted(p.name for p in ckpt.iterdir() if p.is_dir()) == ["iter_0000002", "iter_0000004"]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    assert [r["step"] for r in res.log["rows"]] == [1, 2, 3, 4]


def test_resume_continues_bit_for_bit(runs):
    full, resumed = runs["save"], runs["load"]
    assert resumed.returncode == 0, resumed.explain()
    assert "at iteration 2" in resumed.stdout
    got = [(r["step"], r["loss"], r["grad_norm"], r["num_zeros"]) for r in resumed.log["rows"]]
    want = [(r["step"], r["loss"], r["grad_norm"], r["num_zeros"]) for r in full.log["rows"][2:]]
    assert got == want


def test_gather_format_refused_with_folded_buffers(runs):
    res = runs["refuse-fully-reshardable"]
    assert res.returncode == lc.CHECKPOINT_RUNS["refuse-fully-reshardable"][1], res.explain()
    err = [line for line in res.stderr.splitlines() if line.startswith("error: ")]
    assert len(err) == 1 and "fully_reshardable" in err[0] and "dp_reshardable" in err[0], res.stderr
    assert not (runs["ckpt"].parent / "ckpt-refused").exists() or not any(
        (runs["ckpt"].parent / "ckpt-refused").glob("iter_*"))
