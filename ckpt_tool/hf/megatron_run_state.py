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

Adam's ``betas`` and ``eps`` go along as ``"adam"`` (read from the same opcodes: the floats after those keys),
where every param group holds the same: megatron-core's loader hands the saved groups' values to the optimizer,
so an import that wrote its defaults (0.9 / 0.999) would resume a run saved with ``--adam-beta2 0.95`` (the
genuine fixtures') at 0.999.
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
    adam: dict[str, Any] | None = None  # the param groups' Adam ``betas`` and ``eps``, where every group agrees


def _group_values(root: str, key: str, blob: bytes) -> dict[str, set[Any]]:
    """Every ``step``, ``eps`` and ``betas`` value of a torch.save blob's pickle (its param groups), read from its
    opcodes: the float pushed right after the key (``betas``: the two floats of the tuple after it)."""
    try:
        reader = ViewReader(memoryview(blob))
        pkl = next((small_record(reader, r) for r in zip_records(reader).values() if r.name.endswith("data.pkl")),
                   None)
        ops = list(pickletools.genops(pkl)) if pkl is not None else []
    except (BlobError, ValueError, struct.error) as e:
        raise FormatError(f"{root}: byte object {key} does not decode ({e}); export without --optimizer") from None
    memo: dict[Any, Any] = {}
    out: dict[str, set[Any]] = {"step": set(), "eps": set(), "betas": set()}
    for i, (op, arg, _) in enumerate(ops[:-1]):
        if op.name in _STR and ops[i + 1][0].name in _PUT:
            memo[ops[i + 1][1]] = arg
        name = arg if op.name in _STR else memo.get(arg) if op.name in _GET else None
        if name not in out:
            continue
        after = [o for o in ops[i + 1:i + 8] if o[0].name not in _PUT]  # a value may be memoized as it is pushed
        if name != "betas" and after and after[0][0].name == "BINFLOAT":
            out[name].add(float(after[0][1]))
        elif name == "betas" and [o[0].name for o in after[:3]] == ["BINFLOAT", "BINFLOAT", "TUPLE2"]:
            out[name].add((float(after[0][1]), float(after[1][1])))
    return out


def read(ckpt: Checkpoint) -> dict[str, str]:
    """The ``__metadata__`` field of the optimizer files exported from a megatron-core ``ckpt`` (none where
    it records no single step or no iteration: the import then refuses to carry the moments)."""
    keys = [k for k in ckpt.entries if k == GROUPS or (k.startswith("chained_") and k.split(".", 1)[1] == GROUPS)]
    keys = keys or ([COMMON] if COMMON in ckpt.entries else [])
    found: dict[str, set[Any]] = {"step": set(), "eps": set(), "betas": set()}
    for k in keys:
        e = ckpt.entries[k]
        if e.chunks:
            for name, values in _group_values(str(ckpt.root), k, bytes(chunk_bytes(ckpt, e, e.chunks[0]))).items():
                found[name] |= values
    steps = found["step"]
    if len(steps) != 1 or ckpt.iteration is None:
        return {}
    doc: dict[str, Any] = {"iteration": ckpt.iteration, "step": steps.pop()}
    if len(found["betas"]) == 1 and len(found["eps"]) == 1:  # one Adam setting for every group: carried
        adam = {"betas": list(found["betas"].pop()), "eps": found["eps"].pop()}
        if _adam_ok(adam):
            doc["adam"] = adam
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


def _adam_ok(doc: Any) -> bool:
    betas, eps = (doc.get("betas"), doc.get("eps")) if isinstance(doc, dict) and set(doc) == {"betas", "eps"} \
        else (None, None)
    return isinstance(betas, list) and len(betas) == 2 and all(type(b) is float and 0 <= b < 1 for b in betas) and \
        type(eps) in (int, float) and 0 <= eps < 1


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
    adam = doc.get("adam")
    if adam is not None and not _adam_ok(adam):
        raise FormatError(f"{where}: {FIELD} adam is {str(adam)[:120]!r}, not {{'betas': [b1, b2], 'eps': e}} with "
                          f"values in [0, 1); {fix}")
    return MegatronRunState(it, float(step), sched, consumed, extra,
                            {"betas": tuple(adam["betas"]), "eps": float(adam["eps"])} if adam else None)
