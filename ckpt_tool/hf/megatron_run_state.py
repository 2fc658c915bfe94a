"""What a megatron-core checkpoint's optimizer files carry besides the tensors, so the import resumes them.

Adam's moments do not resume without the step count (its bias correction divides by ``1 - beta**step``).
megatron-core keeps it in the param groups (``step``), pickled in ``common_state`` (``fully_reshardable``)
or in the per-rank byte objects ``[chained_N.]optimizer.distributed.dp_group_idx_0.optimizer``
(``dp_reshardable``). ``ckpt export --to hf --optimizer`` of a megatron-core checkpoint reads it from
those pickles' *opcodes* (:mod:`pickletools` decodes them without running anything: the float pushed
right after the key ``step``) and writes, in the ``__metadata__`` of every ``optimizer*.safetensors``,
one field :data:`FIELD` holding ``{"iteration": N, "step": S}`` (every param group must hold the same
step, as megatron-core's loader asserts). ``ckpt import --to megatron-core`` reads it back
(:func:`parse`) and writes the carried masters and moments at that iteration and step.

The learning-rate schedule resumes with them: ``common_state``'s ``opt_param_scheduler`` (megatron-core's
``OptimizerParamScheduler.state_dict``: :data:`SCHEDULER` fields, decoded as inert records, nothing the pickle
names is run) goes into the same field as ``"scheduler"``, and the data position as
``"consumed_train_samples"`` (``args.consumed_train_samples``, else the scheduler's ``num_steps``, which
megatron-core advances by the global batch size each iteration: samples too). The import writes both back
(``common_state``'s scheduler and ``args.consumed_train_samples``) and takes the param groups' ``max_lr`` /
``min_lr`` from the carried scheduler (megatron-core pairs saved and live groups by them), and their ``lr`` /
``weight_decay`` from the rates the scheduler gives at its ``num_steps`` (:mod:`.megatron_schedule`; the three
rule inputs the scheduler's state leaves out go along as ``"lr_schedule_args"``, from the source's ``args``).
``lr_warmup_steps`` may be a float (Megatron-LM's ``--lr-warmup-fraction`` times the decay steps) and stays one.
"""

from __future__ import annotations

import json
import pickletools
import struct
from dataclasses import dataclass
from typing import Any

from ckpt_tool.hf.megatron_schedule import check_schedule_args, schedule_args
from gtp_format.errors import FormatError
from gtp_format.reader.checkpoint import Checkpoint
from gtp_format.reader.chunks import chunk_bytes
from gtp_format.reader.zip_blob import BlobError, ViewReader, small_record, zip_records
from gtp_format.safe_json import loads

FIELD = "gtp_megatron_run_state"
COMMON = "common_state/shard_0_1"
GROUPS = "optimizer.distributed.dp_group_idx_0.optimizer/shard_0_1"
_STR = ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE", "BINUNICODE8")
_PUT = ("BINPUT", "LONG_BINPUT", "PUT")
_GET = ("BINGET", "LONG_BINGET", "GET")


# megatron-core's OptimizerParamScheduler.state_dict(): field -> its type (0.19.2's ten fields, the fixtures')
SCHEDULER: dict[str, type] = {"max_lr": float, "lr_warmup_steps": int, "num_steps": int, "lr_decay_style": str,
                              "lr_decay_steps": int, "min_lr": float, "start_wd": float, "end_wd": float,
                              "wd_incr_style": str, "wd_incr_steps": int}
STYLES = {"lr_decay_style": ("constant", "linear", "cosine", "inverse-square-root", "WSD"),
          "wd_incr_style": ("constant", "linear", "cosine")}
MAX_COUNT = 10**15


@dataclass(frozen=True)
class MegatronRunState:
    iteration: int
    step: float
    scheduler: dict[str, Any] | None = None  # opt_param_scheduler's state, where the source recorded one
    consumed: int | None = None  # args.consumed_train_samples (samples), where known
    schedule_args: dict[str, Any] | None = None  # the rule inputs the scheduler's state leaves out, where recorded


def _steps(root: str, key: str, blob: bytes) -> set[float]:
    """Every ``step`` value of a torch.save blob's pickle, read from its opcodes."""
    try:
        reader = ViewReader(memoryview(blob))
        pkl = next((small_record(reader, r) for r in zip_records(reader).values() if r.name.endswith("data.pkl")),
                   None)
        ops = list(pickletools.genops(pkl)) if pkl is not None else []
    except (BlobError, ValueError, struct.error) as e:
        raise FormatError(f"{root}: byte object {key} does not decode ({e}); export without --optimizer") from None
    memo: dict[Any, Any] = {}
    out: set[float] = set()
    for i, (op, arg, _) in enumerate(ops[:-1]):
        if op.name in _STR and ops[i + 1][0].name in _PUT:
            memo[ops[i + 1][1]] = arg
        is_step = (op.name in _STR and arg == "step") or (op.name in _GET and memo.get(arg) == "step")
        if is_step and ops[i + 1][0].name == "BINFLOAT":
            out.add(float(ops[i + 1][1]))
    return out


def read(ckpt: Checkpoint) -> dict[str, str]:
    """The ``__metadata__`` field of the optimizer files exported from a megatron-core ``ckpt`` (none where
    it records no single step or no iteration: the import then refuses to carry the moments)."""
    keys = [k for k in ckpt.entries if k == GROUPS or (k.startswith("chained_") and k.split(".", 1)[1] == GROUPS)]
    keys = keys or ([COMMON] if COMMON in ckpt.entries else [])
    steps: set[float] = set()
    for k in keys:
        e = ckpt.entries[k]
        if e.chunks:
            steps |= _steps(str(ckpt.root), k, bytes(chunk_bytes(ckpt, e, e.chunks[0])))
    if len(steps) != 1 or ckpt.iteration is None:
        return {}
    doc: dict[str, Any] = {"iteration": ckpt.iteration, "step": steps.pop()}
    doc.update(_schedule(ckpt))
    return {FIELD: json.dumps(doc, sort_keys=True, separators=(",", ":"))}


def _plain(obj: Any) -> dict[str, Any]:
    from gtp_format.reader.inert_object import InertObject

    return obj.fields() if isinstance(obj, InertObject) else obj if isinstance(obj, dict) else {}


def _schedule(ckpt: Checkpoint) -> dict[str, Any]:
    """``{"scheduler": ..., "consumed_train_samples": N}`` of ``common_state``, each where it checks out (a
    scheduler of other fields or types is left out, and the import then writes a fresh one)."""
    from gtp_format.megatron.topology import common_state

    state = common_state(ckpt) or {}
    out: dict[str, Any] = {}
    sched = _plain(state.get("opt_param_scheduler"))
    try:
        out["scheduler"] = check_scheduler(sched, "")
    except FormatError:
        pass
    args = _plain(state.get("args"))
    consumed = args.get("consumed_train_samples")
    extra = schedule_args(args) if "scheduler" in out else {}
    if extra:
        out["lr_schedule_args"] = extra
    if consumed is None and "scheduler" in out:
        consumed = out["scheduler"]["num_steps"]
    if type(consumed) is int and 0 <= consumed < MAX_COUNT:
        out["consumed_train_samples"] = consumed
    return out


def check_scheduler(doc: Any, where: str) -> dict[str, Any]:
    """megatron-core's scheduler state: exactly the :data:`SCHEDULER` fields, each of its type (an int where a
    float is due is taken), counts within ``[0, 10**15)``, rates finite and non-negative, the styles megatron-core
    names; else refused naming the field."""
    fix = "export the megatron-core checkpoint again, or pass --no-optimizer"
    if not isinstance(doc, dict) or set(doc) != set(SCHEDULER):
        got = sorted(doc)[:12] if isinstance(doc, dict) else type(doc).__name__
        raise FormatError(f"{where}: {FIELD} scheduler is {got!r}, not megatron-core's {sorted(SCHEDULER)}; {fix}")
    out: dict[str, Any] = {}
    for key, kind in SCHEDULER.items():
        v = doc[key]
        if key == "lr_warmup_steps" and type(v) is float and 0 <= v < MAX_COUNT:  # --lr-warmup-fraction's
            out[key] = v
            continue
        ok = (kind is str and isinstance(v, str) and v in STYLES[key]) or \
            (kind is int and type(v) is int and 0 <= v < MAX_COUNT) or \
            (kind is float and type(v) in (int, float) and 0 <= v < 1e6)  # a NaN fails both comparisons
        if not ok:
            want = "one of " + ", ".join(STYLES[key]) if kind is str else "a count" if kind is int else "a rate"
            raise FormatError(f"{where}: {FIELD} scheduler {key} is {str(v)[:80]!r}, not {want} megatron-core "
                              f"writes; {fix}")
        out[key] = float(v) if kind is float else v
    return out


def parse(metas: list[dict[str, str]], where: str) -> MegatronRunState:
    """The run state of a set of optimizer files (every file must carry the same one)."""
    texts = {m.get(FIELD) for m in metas}
    fix = "export the megatron-core checkpoint with this tool's `ckpt export --to hf --optimizer`, or pass " \
          "--no-optimizer to start the moments at zero"
    if None in texts:
        raise FormatError(f"{where}: has no {FIELD!r} in its safetensors __metadata__ (megatron-core's Adam step "
                          f"and iteration), so its moments cannot resume; {fix}")
    if len(texts) != 1:
        raise FormatError(f"{where}: its files carry different {FIELD!r} metadata (files of different exports); {fix}")
    text = texts.pop()
    assert text is not None
    doc = loads(text, f"{where} ({FIELD})", fix)
    it, step = (doc.get(k) if isinstance(doc, dict) else None for k in ("iteration", "step"))
    if isinstance(it, bool) or not isinstance(it, int) or not 0 <= it < 10**12 or isinstance(step, bool) or \
            not isinstance(step, (int, float)) or not 0 <= step < 1e15 or float(step) != int(step):
        raise FormatError(f"{where}: {FIELD} is {text[:200]!r}, not {{'iteration': N, 'step': S}} with whole "
                          f"numbers >= 0; {fix}")
    assert isinstance(doc, dict)
    sched = check_scheduler(doc["scheduler"], where) if "scheduler" in doc else None
    consumed = doc.get("consumed_train_samples")
    if consumed is not None and (type(consumed) is not int or not 0 <= consumed < MAX_COUNT):
        raise FormatError(f"{where}: {FIELD} consumed_train_samples is {str(consumed)[:80]!r}, not a count; {fix}")
    extra = check_schedule_args(doc["lr_schedule_args"], where, fix) if "lr_schedule_args" in doc else None
    return MegatronRunState(it, float(step), sched, consumed, extra)
