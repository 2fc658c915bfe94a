"""The short CPU version of benchmarks/convergence.py: a tiny model, 100 steps, real text.

Folded (cp2) and gtp_remat 2 (cp2 x g2, folded, half the micro-batch so the global batch is the
same) against unfolded cp2, with a different-data-seed run as the noise yardstick. In fp32 on CPU
the topologies differ by reduction order only, so their validation losses must stay far inside
the noise at every evaluation, while the noise run's must not (the yardstick itself is real).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import convergence  # noqa: E402

pytestmark = pytest.mark.slow


def test_folded_and_g2_follow_unfolded_within_noise(tmp_path):
    code = convergence.main(["--preset", "cpu", "--steps", "100", "--eval-interval", "10", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "convergence.json").read_text())
    s = result["summary"]
    assert code == 0 and s["passed"], s
    assert set(s["compared"]) == {"folded", "g2-folded"}
    assert len(s["eval_steps"]) == 10
    assert min(s["noise_diff"]) > 1e-3  # another data order moves the curve measurably
    for c in s["compared"].values():
        assert c["max_valid_diff"] < 1e-4  # reduction order only
    rows = result["runs"]["unfolded"]["rows"]
    first = [r["valid_loss"] for r in rows if "valid_loss" in r]
    assert first[-1] < first[0] - 0.5  # it learns: real text, not noise
