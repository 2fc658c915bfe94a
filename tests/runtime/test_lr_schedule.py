"""The learning-rate schedule against genuine megatron-core's ``OptimizerParamScheduler``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gtp_format.layout.config import ConfigError
from gtp_runtime.lr_schedule import LRConfig, LRScheduler

MEGATRON = json.loads((Path(__file__).resolve().parents[2] / "fixtures/megatron/indexed/lr_schedule.json").read_text())


def _cfg(kw: dict) -> LRConfig:
    return LRConfig(max_lr=kw["max_lr"], min_lr=kw["min_lr"], warmup_iters=kw["lr_warmup_steps"],
                    decay_iters=kw["lr_decay_steps"], decay_style=kw["lr_decay_style"])


@pytest.mark.parametrize("name", sorted(MEGATRON["schedules"]))
def test_every_step_equals_megatron_bit_for_bit(name):
    s = MEGATRON["schedules"][name]
    sched = LRScheduler(_cfg(s["config"]))
    got = []
    for _ in s["lr"]:
        got.append(sched.get_lr())
        sched.step()
    assert got == s["lr"]  # exact floats, not approximately
    mine, theirs = sched.state_dict(), s["state_dict"]
    for key in ("max_lr", "min_lr", "lr_warmup_steps", "lr_decay_steps", "lr_decay_style", "num_steps"):
        assert mine[key] == theirs[key], key


def test_resume_takes_position_and_refuses_another_schedule():
    cfg = _cfg(MEGATRON["schedules"]["warmup-cosine"]["config"])
    a = LRScheduler(cfg)
    for _ in range(17):
        a.step()
    saved = json.loads(json.dumps(a.state_dict()))  # through JSON, as in the manifest
    b = LRScheduler(cfg)
    b.load_state_dict(saved, "ckpt")
    assert b.num_steps == 17 and b.get_lr() == a.get_lr()
    other = LRScheduler(LRConfig(max_lr=cfg.max_lr, min_lr=0.0, warmup_iters=10, decay_iters=50, decay_style="cosine"))
    with pytest.raises(ConfigError, match="min_lr is 3e-05, this run has 0.0; pass --min-lr 3e-05"):
        other.load_state_dict(saved, "ckpt")
    with pytest.raises(ConfigError, match="num_steps"):
        b.load_state_dict({**saved, "num_steps": -1}, "ckpt")


@pytest.mark.parametrize("kw,words", [
    (dict(decay_style="step"), "--lr-decay-style 'step'"),
    (dict(warmup_iters=-1), "non-negative"),
    (dict(min_lr=1.0), "--min-lr 1.0 must be in"),
    (dict(decay_style="cosine", warmup_iters=5, decay_iters=5), "must exceed --lr-warmup-iters"),
])
def test_bad_schedules_are_one_line(kw, words):
    with pytest.raises(ConfigError, match=words.replace("(", r"\(")):
        LRConfig(**kw).validate()
