"""The lr and weight decay a carried megatron-core schedule gives at its step (:mod:`ckpt_tool.hf.megatron_schedule`).

Must hold:

* over many schedules of every decay style megatron-core 0.19.2 computes (constant, linear, cosine,
  inverse-square-root, WSD with each of its four anneal styles; warm-up from a non-zero ``init_lr``; a float
  ``lr_warmup_steps``; linear / cosine / constant weight decay) and many steps (the boundaries included), the
  torch-free rates equal megatron-core's own ``OptimizerParamScheduler``'s bit for bit, both after its steps
  and after a ``load_state_dict`` of its state (what Megatron-LM's loader calls; megatron venv, skipped
  without it);
* every genuine fixture's param groups hold the rates its recorded schedule gives; ``export --to hf --optimizer``
  of a genuine save -> ``import --to megatron-core`` writes param groups whose ``lr``, ``weight_decay``, Adam
  ``betas`` / ``eps`` and ``step`` are the genuine groups' (cosine at ``num_steps`` 16: not ``max_lr``; beta2
  0.95: not the default 0.999), in both shardings;
* a WSD schedule whose rule inputs the source did not record, or a malformed ``lr_schedule_args``, is refused
  in one line naming it, nothing written.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
from pathlib import Path
from typing import Any

import pytest
from cli_helpers import assert_error_line, cli

from ckpt_tool.hf.megatron_run_state import FIELD, parse
from ckpt_tool.hf.megatron_schedule import WSD_STYLES, lr_at, schedule_args, wd_at
from gtp_format.errors import FormatError

ROOT = Path(__file__).resolve().parents[2]
MEGATRON = ROOT / "fixtures" / "megatron"
MEGATRON_PY = MEGATRON / "_venv" / "bin" / "python"
HELPER = ROOT / "tests" / "helpers" / "megatron_schedule.py"
STYLES = ("constant", "linear", "cosine", "inverse-square-root", *(("WSD", s) for s in WSD_STYLES))


def _cases(count: int, seed: int = 39) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    out = []
    for i in range(count):
        style = STYLES[i % len(STYLES)]
        wsd = style[1] if isinstance(style, tuple) else None
        decay = rng.choice([1, 7, 100, 800, 12345, 10**7 + 3])
        warmup: int | float = rng.choice([0, 0, rng.randrange(0, decay)])
        if i % 11 == 5 and decay > 1:  # --lr-warmup-fraction: a float count
            warmup = rng.choice([0.01, 0.1, 0.333]) * decay
        max_lr = rng.choice([1e-3, 3e-4, 6.0e-4, rng.uniform(1e-6, 1e-2)])
        min_lr = rng.choice([0.0, max_lr / 10, rng.uniform(0, max_lr), max_lr])
        wd_style = rng.choice(["constant", "linear", "cosine"])
        start_wd = rng.choice([0.0, 0.01, 0.1, rng.uniform(0, 0.1)])
        end_wd = start_wd if wd_style == "constant" else start_wd + rng.choice([0.0, 0.05, rng.uniform(0, 0.2)])
        wd_steps = rng.choice([1, decay, 2 * decay + 1])
        limit = max(decay, wd_steps) + 5
        marks = {0, 1, int(warmup), int(warmup) + 1, decay - 1, decay, decay + 1, wd_steps, wd_steps + 1, limit}
        wsd_steps = rng.randrange(0, decay + 1) if wsd else None
        if wsd_steps is not None:
            marks |= {decay - wsd_steps, decay - wsd_steps + 1}
        marks |= {rng.randrange(0, limit) for _ in range(12)}
        out.append({"init_lr": rng.choice([0.0, 0.0, rng.uniform(0, max_lr)]), "max_lr": max_lr, "min_lr": min_lr,
                    "lr_warmup_steps": warmup, "lr_decay_steps": decay, "lr_decay_style": wsd and "WSD" or style,
                    "start_wd": start_wd, "end_wd": end_wd, "wd_incr_steps": wd_steps, "wd_incr_style": wd_style,
                    "wsd_decay_steps": wsd_steps, "lr_wsd_decay_style": wsd,
                    "steps": sorted(m for m in marks if 0 <= m <= limit)})
    return out


@pytest.mark.skipif(not MEGATRON_PY.exists(), reason="needs the megatron venv (fixtures/megatron/setup_venv.sh)")
def test_rates_equal_megatron_cores_own_scheduler(tmp_path: Path) -> None:
    cases = _cases(400)
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    out = subprocess.run([str(MEGATRON_PY), str(HELPER), str(tmp_path / "cases.json"), str(tmp_path / "out.json")],
                         capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads((tmp_path / "out.json").read_text())
    seen: dict[str, int] = {}
    for case, recs in zip(cases, results, strict=True):
        extra = {"lr_warmup_init": case["init_lr"]}
        if case["wsd_decay_steps"] is not None:
            extra.update(wsd_decay_steps=case["wsd_decay_steps"], lr_wsd_decay_style=case["lr_wsd_decay_style"])
        assert len(recs) == len(case["steps"]) and "error" not in recs[0], (case, recs[0])
        for rec in recs:
            state = rec["state"]
            assert state["num_steps"] == rec["n"]
            lr, wd = lr_at(state, extra), wd_at(state)
            for got in (rec["lr"], rec["loaded_lr"]):
                assert got == [lr, lr], (case, rec)
            for got in (rec["wd"], rec["loaded_wd"]):
                assert got == [wd * 1.0, wd * 0.0], (case, rec)
            key = str(case["lr_wsd_decay_style"] or case["lr_decay_style"])
            phase = "warmup" if 0 < rec["n"] <= case["lr_warmup_steps"] else \
                "after" if rec["n"] > case["lr_decay_steps"] else "decay"
            seen[f"{key}/{phase}"] = seen.get(f"{key}/{phase}", 0) + 1
    # every style met in its decay phase, and warm-up and the tail too, many times each
    for style in ("constant", "linear", "cosine", "inverse-square-root", *WSD_STYLES):
        assert seen.get(f"{style}/decay", 0) >= 50, seen
    assert seen.get("linear/warmup", 0) >= 10 and seen.get("cosine/after", 0) >= 10, seen


def test_rates_known_values() -> None:
    """Hand-checked points (no venv): the genuine fixtures' cosine at 16 of 800, warm-up from init_lr, WSD's
    flat part and anneal, inverse-square-root's floor, linear weight decay."""
    base = {"max_lr": 1e-3, "min_lr": 1e-5, "lr_warmup_steps": 0, "num_steps": 16, "lr_decay_style": "cosine",
            "lr_decay_steps": 800, "start_wd": 0.01, "end_wd": 0.01, "wd_incr_style": "constant", "wd_incr_steps": 800}
    assert lr_at(base, {}) == 0.0009990232305719944  # what the genuine fixtures' param groups hold
    assert lr_at(dict(base, lr_warmup_steps=32), {"lr_warmup_init": 1e-4}) == 1e-4 + (1e-3 - 1e-4) * 16 / 32
    wsd = dict(base, lr_decay_style="WSD")
    assert lr_at(wsd, {"wsd_decay_steps": 100, "lr_wsd_decay_style": "linear"}) == 1e-3
    assert lr_at(dict(wsd, num_steps=750), {"wsd_decay_steps": 100, "lr_wsd_decay_style": "linear"}) == \
        1e-5 + 0.5 * (1e-3 - 1e-5)
    assert lr_at(dict(base, lr_decay_style="inverse-square-root", num_steps=799), {}) >= 1e-5
    assert wd_at(dict(base, wd_incr_style="linear", start_wd=0.0, end_wd=0.1, num_steps=400)) == 0.05
    assert wd_at(dict(base, num_steps=801)) == 0.01


def test_schedule_args_come_from_megatron_lms_args() -> None:
    """Megatron-LM's get_optimizer_param_scheduler: WSD decay steps are iterations times the global batch for an
    iteration-based run, else the samples; unsound values are left out."""
    got = schedule_args({"lr_warmup_init": 1e-5, "train_iters": 100, "lr_wsd_decay_iters": 10, "global_batch_size": 8,
                         "lr_wsd_decay_style": "minus_sqrt"})
    assert got == {"lr_warmup_init": 1e-5, "wsd_decay_steps": 80, "lr_wsd_decay_style": "minus_sqrt"}
    assert schedule_args({"train_samples": 1000, "lr_wsd_decay_samples": 64}) == {"wsd_decay_steps": 64}
    assert schedule_args({"lr_warmup_init": float("nan"), "lr_wsd_decay_style": "os.system",
                          "train_iters": 5, "lr_wsd_decay_iters": -1, "global_batch_size": 8}) == {}


SCHED = {"max_lr": 0.001, "min_lr": 0.0, "lr_warmup_steps": 0, "num_steps": 16, "lr_decay_style": "WSD",
         "lr_decay_steps": 800, "start_wd": 0.01, "end_wd": 0.01, "wd_incr_style": "constant", "wd_incr_steps": 800}


@pytest.mark.parametrize("extra,needle", [
    ({"lr_warmup_init": "0.1"}, "lr_schedule_args lr_warmup_init is '0.1'"),
    ({"wsd_decay_steps": -3}, "lr_schedule_args wsd_decay_steps is '-3'"),
    ({"lr_wsd_decay_style": "exp"}, "lr_schedule_args lr_wsd_decay_style is 'exp'"),
    ({"eval": 1}, "lr_schedule_args is \"{'eval': 1}\", not a map of"),
    ([1], "lr_schedule_args is '[1]', not a map of"),
])
def test_malformed_schedule_args_are_refused(extra: Any, needle: str) -> None:
    doc = {"iteration": 2, "step": 2.0, "scheduler": SCHED, "lr_schedule_args": extra}
    with pytest.raises(FormatError, match="lr_schedule_args") as e:
        parse([{FIELD: json.dumps(doc)}], "hf/optimizer*.safetensors")
    assert needle in str(e.value) and "\n" not in str(e.value)
    for adam in ({"betas": [0.9, 1.5], "eps": 1e-8}, {"betas": [0.9], "eps": 1e-8}, {"betas": [0.9, 0.95]}):
        doc = {"iteration": 2, "step": 2.0, "adam": adam}
        with pytest.raises(FormatError, match="gtp_megatron_run_state adam is"):
            parse([{FIELD: json.dumps(doc)}], "x")
    # a float warm-up count (--lr-warmup-fraction) is taken and stays a float
    doc = {"iteration": 2, "step": 2.0, "scheduler": dict(SCHED, lr_warmup_steps=8.0)}
    state = parse([{FIELD: json.dumps(doc)}], "x").scheduler
    assert state is not None and type(state["lr_warmup_steps"]) is float


def _groups(ckpt: Path) -> list[dict[str, Any]]:
    """Every param group the checkpoint's byte objects hold (dp_reshardable's per-rank objects, or
    fully_reshardable's in common_state), decoded as inert records."""
    from gtp_format.megatron.topology import common_state
    from gtp_format.reader.checkpoint import open_checkpoint
    from gtp_format.reader.inert_object import load_record

    c = open_checkpoint(ckpt)
    out: list[dict[str, Any]] = []
    for k, e in c.entries.items():
        if k.split("/")[0].endswith("distributed.dp_group_idx_0.optimizer"):
            out += load_record(c, e)[0]["param_groups"]
    state = common_state(c)
    assert state is not None
    opt = state["optimizer"]
    for part in (opt.values() if 0 in opt else [opt]):
        out += part.get("optimizer", {}).get("param_groups", [])
    assert out
    return out


def _rates(g: dict[str, Any]) -> tuple[Any, ...]:
    return g["wd_mult"], g["is_expert_parallel"], g["lr"], g["weight_decay"], tuple(g["betas"]), g["eps"], g["step"]


@pytest.mark.parametrize("fixture", ["pair_tp2_dp2_dp_reshardable", "pair_mixtral_ep2_dp_reshardable"])
def test_imported_param_groups_hold_the_genuine_rates(fixture: str, tmp_path: Path) -> None:
    """The imported groups' ``lr``, ``weight_decay``, Adam ``betas`` / ``eps`` and ``step`` are the genuine save's
    (megatron-core's loader hands them to the optimizer as saved: betas 0.9 / 0.95, not the defaults' 0.999)."""
    genuine = [_rates(g) for g in _groups(MEGATRON / fixture)]
    assert {g[2] for g in genuine} == {0.0009990232305719944}  # cosine at 16 of 800: below max_lr 0.001
    assert {g[4] for g in genuine} == {(0.9, 0.95)}
    r = cli("export", MEGATRON / fixture, tmp_path / "hf", "--to", "hf", "--optimizer")
    assert r.exit_code == 0, r.stderr
    moe = ("--ep", "2") if "mixtral" in fixture else ()
    for sharding in ("dp_reshardable", "fully_reshardable"):
        r = cli("import", tmp_path / "hf", tmp_path / sharding, "--from", "hf", "--to", "megatron-core", "--dp", "2",
                *moe, "--sharding", sharding)
        assert r.exit_code == 0, r.stderr
        ours = [_rates(g) for g in _groups(tmp_path / sharding)]
        assert sorted(set(ours)) == sorted(set(genuine)), (sharding, ours, genuine)


def test_a_wsd_schedule_without_its_args_is_refused(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    r = cli("export", MEGATRON / "pair_tp2_dp2_dp_reshardable", tmp_path / "hf", "--to", "hf", "--optimizer")
    assert r.exit_code == 0, r.stderr
    for f in tmp_path.joinpath("hf").glob("optimizer*.safetensors"):
        save_file(load_file(f), f, metadata={FIELD: json.dumps({"iteration": 2, "step": 2.0, "scheduler": SCHED})})
    base = ["import", tmp_path / "hf", tmp_path / "out", "--from", "hf", "--to", "megatron-core"]
    assert_error_line(cli(*base), 2, "WSD schedule at step 16", "lr_wsd_decay_iters / lr_wsd_decay_samples",
                      "--no-optimizer")
    assert not (tmp_path / "out").exists()
    args = {"wsd_decay_steps": 100, "lr_wsd_decay_style": "cosine", "lr_warmup_init": 0.0}
    for f in tmp_path.joinpath("hf").glob("optimizer*.safetensors"):
        save_file(load_file(f), f, metadata={FIELD: json.dumps({"iteration": 2, "step": 2.0, "scheduler": SCHED,
                                                                "lr_schedule_args": args})})
    r = cli(*base)
    assert r.exit_code == 0, r.stderr
    assert {g["lr"] for g in _groups(tmp_path / "out")} == {0.001}  # before the anneal: max_lr
    r = cli("export", tmp_path / "out", tmp_path / "hf2", "--to", "hf", "--optimizer")  # the args go round
    assert r.exit_code == 0, r.stderr
    metas = {json.loads(_meta(f)[FIELD])["lr_schedule_args"] == args for f in (tmp_path / "hf2").glob("optimizer*")
             if f.suffix == ".safetensors"}
    assert metas == {True}


def _meta(path: Path) -> dict[str, str]:
    import struct

    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n])["__metadata__"]


def test_every_genuine_save_holds_the_rates_of_its_schedule() -> None:
    """Every megatron-core fixture that records a scheduler: each of its param groups (dp_reshardable's per-rank
    objects, fully_reshardable's common_state; dense and expert optimizers) holds the lr and weight decay the
    torch-free rules give for that scheduler's state and the run's args, bit for bit."""
    from gtp_format.megatron.topology import common_state
    from gtp_format.reader.checkpoint import open_checkpoint
    from gtp_format.reader.inert_object import InertObject

    checked = 0
    for root in sorted(p for p in MEGATRON.iterdir() if p.is_dir() and any(p.glob("iter_*"))):
        state = common_state(open_checkpoint(root))
        if state is None or "opt_param_scheduler" not in state:
            continue
        sched, args = state["opt_param_scheduler"], state["args"]
        extra = schedule_args(args.fields() if isinstance(args, InertObject) else args)
        lr, wd = lr_at(sched, extra), wd_at(sched)
        groups = _groups(root)
        assert groups and all(g["lr"] == lr and g["weight_decay"] == wd * g["wd_mult"] for g in groups), root.name
        checked += 1
    assert checked >= 40, checked
