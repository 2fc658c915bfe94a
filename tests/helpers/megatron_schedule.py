"""Run megatron-core's own ``OptimizerParamScheduler`` over schedules and steps (the megatron venv's python).

Usage: ``megatron_schedule.py CASES.json OUT.json``. Each case names the constructor's arguments (``init_lr``,
``max_lr``, ..., ``wsd_decay_steps``, ``lr_wsd_decay_style``) and ``steps``, an ascending list of sample counts;
the scheduler is built over an optimizer stand-in with megatron-core's two default groups (``wd_mult`` 1 and 0,
``max_lr`` / ``min_lr`` the schedule's) and stepped to each count, recording its ``state_dict()`` and the
groups' ``lr`` and ``weight_decay``. Then a second scheduler of the same arguments, with Megatron-LM's default
flags (neither ``--use-checkpoint-opt_param-scheduler`` nor ``--override-opt_param-scheduler``: every saved value
must equal the run's), loads that state (``load_state_dict``: what Megatron-LM's loader calls) and its groups'
rates are recorded too. A case megatron-core
refuses (an assertion or an exception) records the error's type instead.
"""

from __future__ import annotations

import json
import sys
from typing import Any

ARGS = ("init_lr", "max_lr", "min_lr", "lr_warmup_steps", "lr_decay_steps", "lr_decay_style", "start_wd", "end_wd",
        "wd_incr_steps", "wd_incr_style", "wsd_decay_steps", "lr_wsd_decay_style")


class Groups:
    def __init__(self, max_lr: float, min_lr: float) -> None:
        self.param_groups = [{"wd_mult": wd, "lr_mult": 1.0, "max_lr": max_lr, "min_lr": min_lr} for wd in (1.0, 0.0)]


def run(case: dict[str, Any]) -> list[dict[str, Any]]:
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    def build(**flags: bool) -> tuple[Any, Groups]:
        opt = Groups(case["max_lr"], case["min_lr"])
        return OptimizerParamScheduler(opt, **{k: case[k] for k in ARGS}, **flags), opt

    out: list[dict[str, Any]] = []
    try:
        sched, opt = build()
    except Exception as e:  # noqa: BLE001 - the class's own refusal is the record
        return [{"error": type(e).__name__}]
    done = 0
    for n in case["steps"]:
        try:
            sched.step(increment=n - done)
        except Exception as e:  # noqa: BLE001
            out.append({"n": n, "error": type(e).__name__})
            sched, opt = build()
            done = 0
            continue
        done = n
        state = sched.state_dict()
        rec = {"n": n, "state": state, "lr": [g["lr"] for g in opt.param_groups],
               "wd": [g["weight_decay"] for g in opt.param_groups]}
        # Megatron-LM's default load: neither --use-checkpoint- nor --override-opt_param-scheduler, so every saved
        # value must equal the run's (asserted), then the scheduler steps to num_steps
        again, opt2 = build(use_checkpoint_opt_param_scheduler=False, override_opt_param_scheduler=False)
        again.load_state_dict(dict(state))
        rec["loaded_lr"] = [g["lr"] for g in opt2.param_groups]
        rec["loaded_wd"] = [g["weight_decay"] for g in opt2.param_groups]
        out.append(rec)
    return out


def main() -> None:
    cases = json.loads(open(sys.argv[1]).read())
    with open(sys.argv[2], "w") as f:
        json.dump([run(c) for c in cases], f)


if __name__ == "__main__":
    main()
