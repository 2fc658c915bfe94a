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


@pytest.mark.slow
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


def _init_and_batches(seed: int | None) -> tuple[list, list, list]:
    import torch

    from gtp_format.layout.config import ModelConfig, ParallelConfig
    from gtp_runtime.data.source import DataConfig
    from gtp_runtime.training import TrainConfig, Trainer

    model = ModelConfig(vocab_size=128, hidden=32, num_layers=2, num_heads=4, ffn_hidden=64, seq_length=32)
    t = Trainer(TrainConfig(par=ParallelConfig(cp=2), model=model, micro_batch=2, data=DataConfig(seed=seed)))
    params = [p.detach().clone() for p in t.model.parameters()]
    train = [torch.cat(t.global_batch(s)) for s in (1, 2)]
    valid = [torch.cat(t.data.valid_batch(i, t.cfg.global_batch_size)) for i in (0, 1)]
    return params, train, valid


def test_noise_run_changes_only_the_data_order():
    """The convergence benchmark's noise runs pass ``--data-seed``: the initial weights and the
    validation batches must be those of the reference run, only the training batches differ."""
    from dist_harness import run_ranks

    ref, other = run_ranks(2, _init_and_batches, None), run_ranks(2, _init_and_batches, 1235)
    for rank in range(2):
        (p0, t0, v0), (p1, t1, v1) = ref[rank], other[rank]
        assert len(p0) == len(p1) and all(a.equal(b) for a, b in zip(p0, p1))
        assert all(a.equal(b) for a, b in zip(v0, v1))
        assert not any(a.equal(b) for a, b in zip(t0, t1))
