"""The learning rate and weight decay megatron-core's ``OptimizerParamScheduler`` gives at a step, without torch.

An import that carries a run's schedule (:mod:`.megatron_run_state`) writes param groups whose ``lr`` and
``weight_decay`` are what megatron-core 0.19.2's scheduler sets at the carried ``num_steps`` (it counts
samples: the global batch size per iteration), so the optimizer state a loader hands back is the one the
run saved (the genuine fixtures' groups hold ``lr`` 0.000999023... at ``num_steps`` 16 of a cosine decay, not
their ``max_lr`` 0.001). The rules, as that release computes them (same operations in the same order, so
the floats are the same bits; ``tests/cli/test_megatron_schedule.py`` compares against the real class):

* warm-up (``lr_warmup_steps`` > 0 and ``num_steps`` <= it): linear from ``init_lr`` to ``max_lr``;
* ``constant``: ``max_lr``; past ``lr_decay_steps``: ``min_lr``;
* ``inverse-square-root``: ``max_lr * sqrt(max(warmup, 1)) / sqrt(max(n, 1))``, at least ``min_lr``;
* ``linear`` / ``cosine`` over ``(n - warmup) / (decay - warmup)`` from ``max_lr`` to ``min_lr``;
* ``WSD``: ``max_lr`` until the last ``wsd_decay_steps`` of the decay, then ``exponential``,
  ``linear``, ``cosine`` or ``minus_sqrt`` down to ``min_lr``;
* weight decay: ``end_wd`` once ``num_steps`` > ``wd_incr_steps`` or for ``constant``, else ``linear`` /
  ``cosine`` from ``start_wd`` to ``end_wd``; a group's ``weight_decay`` is that times its ``wd_mult``.

Three inputs of these rules are not in the scheduler's ``state_dict``: ``init_lr`` (Megatron-LM's
``--lr-warmup-init``, default 0.0), ``wsd_decay_steps`` and ``lr_wsd_decay_style`` (``--lr-wsd-decay-iters``
times the global batch, or ``--lr-wsd-decay-samples``; ``--lr-wsd-decay-style``). They come from the
source's ``args`` (:func:`schedule_args`); where the rate at the carried step needs one the source did not
record, the import is refused naming it (``init_lr`` alone defaults to Megatron-LM's 0.0).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from gtp_format.errors import FormatError

WSD_STYLES = ("exponential", "linear", "cosine", "minus_sqrt")
# the run-state field's keys for the three rule inputs the scheduler's state leaves out
INIT_LR, WSD_STEPS, WSD_STYLE = "lr_warmup_init", "wsd_decay_steps", "lr_wsd_decay_style"
MAX_COUNT = 10**15


def _rate(v: Any) -> bool:
    return type(v) in (int, float) and 0 <= v < 1e6  # a NaN fails the comparison


def _count(v: Any) -> bool:
    return type(v) is int and 0 <= v < MAX_COUNT


def schedule_args(args: Mapping[str, Any]) -> dict[str, Any]:
    """The three rule inputs a Megatron-LM run records in its ``args`` (each only where recorded and sound):
    ``lr_warmup_init``; ``wsd_decay_steps`` as Megatron-LM's ``get_optimizer_param_scheduler`` derives it
    (iteration-based: ``lr_wsd_decay_iters * global_batch_size``; else ``lr_wsd_decay_samples``);
    ``lr_wsd_decay_style``."""
    out: dict[str, Any] = {}
    if _rate(args.get("lr_warmup_init")):
        out[INIT_LR] = float(args["lr_warmup_init"])
    iters, batch = args.get("lr_wsd_decay_iters"), args.get("global_batch_size")
    if args.get("train_iters"):
        steps = iters * batch if _count(iters) and _count(batch) else None
    else:
        steps = args.get("lr_wsd_decay_samples")
    if _count(steps):
        out[WSD_STEPS] = steps
    if args.get("lr_wsd_decay_style") in WSD_STYLES:
        out[WSD_STYLE] = args["lr_wsd_decay_style"]
    return out


def check_schedule_args(doc: Any, where: str, fix: str) -> dict[str, Any]:
    """A run-state field's rule inputs: only the three keys, each of its kind; else refused naming the key."""
    if not isinstance(doc, dict) or not set(doc) <= {INIT_LR, WSD_STEPS, WSD_STYLE}:
        raise FormatError(f"{where}: lr_schedule_args is {str(doc)[:120]!r}, not a map of {INIT_LR}, {WSD_STEPS}, "
                          f"{WSD_STYLE}; {fix}")
    for key, ok in ((INIT_LR, _rate), (WSD_STEPS, _count), (WSD_STYLE, lambda v: v in WSD_STYLES)):
        if key in doc and not ok(doc[key]):
            raise FormatError(f"{where}: lr_schedule_args {key} is {str(doc[key])[:80]!r}, not what Megatron-LM "
                              f"records; {fix}")
    return {k: float(v) if k == INIT_LR else v for k, v in doc.items()}


def lr_at(state: Mapping[str, Any], extra: Mapping[str, Any], where: str = "the carried schedule") -> float:
    """The learning rate megatron-core's scheduler gives a param group whose ``max_lr`` / ``min_lr`` are the
    schedule's, at ``state["num_steps"]`` (``state``: the scheduler's ``state_dict``; ``extra``: the rule inputs
    it leaves out, :func:`schedule_args`)."""
    n, warmup, decay = state["num_steps"], state["lr_warmup_steps"], state["lr_decay_steps"]
    max_lr, min_lr, style = state["max_lr"], state["min_lr"], state["lr_decay_style"]
    if warmup > 0 and n <= warmup:
        init = extra.get(INIT_LR, 0.0)
        return init + (max_lr - init) * float(n) / float(warmup)
    if style == "constant":
        return max_lr
    if n > decay:
        return min_lr
    if style == "inverse-square-root":
        return max(min_lr, max_lr * max(warmup, 1) ** 0.5 / (max(n, 1) ** 0.5))
    ratio = float(n - warmup) / float(decay - warmup)
    if style == "linear":
        coeff = 1.0 - ratio
    elif style == "cosine":
        coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
    elif style == "WSD":
        coeff = _wsd(n, decay, extra, where)
    else:
        raise FormatError(f"{where}: lr_decay_style {style!r} is not one megatron-core computes")
    return min_lr + coeff * (max_lr - min_lr)


def _wsd(n: int, decay: int, extra: Mapping[str, Any], where: str) -> float:
    if WSD_STEPS not in extra or WSD_STYLE not in extra:
        missing = "lr_wsd_decay_iters / lr_wsd_decay_samples" if WSD_STEPS not in extra else "lr_wsd_decay_style"
        raise FormatError(f"{where}: a WSD schedule at step {n}, and the source's args record no {missing}, so the "
                          "learning rate there is unknown; pass --no-optimizer to start a fresh schedule")
    steps, style = extra[WSD_STEPS], extra[WSD_STYLE]
    start = decay - steps
    if n <= start:
        return 1.0
    ratio = float(n - start) / float(steps)
    if style == "linear":
        return 1.0 - ratio
    if style == "cosine":
        return 0.5 * (math.cos(math.pi * ratio) + 1.0)
    if style == "exponential":
        return 2.0 * math.pow(0.5, ratio) - 1.0
    return 1.0 - math.sqrt(ratio)  # minus_sqrt (check_schedule_args admits no other)


def wd_at(state: Mapping[str, Any], where: str = "the carried schedule") -> float:
    """The weight decay megatron-core's scheduler gives at ``state["num_steps"]`` before a group's ``wd_mult``
    (groups without their own ``start_wd`` / ``end_wd``, as the import writes them)."""
    n, steps, style = state["num_steps"], state["wd_incr_steps"], state["wd_incr_style"]
    start, end = state["start_wd"], state["end_wd"]
    if n > steps:
        return end
    if style == "constant":
        if start != end:  # megatron-core asserts here
            raise FormatError(f"{where}: constant weight decay with start_wd {start:g} != end_wd {end:g} "
                              "(megatron-core's scheduler refuses it); pass --no-optimizer")
        return end
    if steps == 0:  # n == 0 here: megatron-core divides by zero
        raise FormatError(f"{where}: {style} weight decay over wd_incr_steps 0; pass --no-optimizer")
    ratio = float(n) / float(steps)
    coeff = ratio if style == "linear" else 0.5 * (math.cos(math.pi * (1 - ratio)) + 1.0)
    return start + coeff * (end - start)
