"""What a megatron-core checkpoint records of its run's progress, read without unpickling: ``ckpt log``'s columns.

megatron-core keeps the iteration, the data position, the optimizer's step counter and the RNG states in
``torch.save`` blobs (DCP byte objects), never in metadata of their own. Each is decoded here as inert
records (:func:`gtp_format.reader.inert_object.load_record`: nothing the pickle names is imported or called,
the pickle's size is budgeted), one small byte object at a time:

* the iteration: ``common_state``'s ``iteration`` (else its ``args.iteration``);
* the data position: ``args.consumed_train_samples`` where recorded, else the learning-rate scheduler's
  ``opt_param_scheduler.num_steps``, which megatron-core advances by the global batch size every step, so it
  counts samples too (the fixtures: 16 at iteration 2 with a global batch of 8);
* the step counter: ``param_groups[*].step`` of the distributed optimizer's common object
  (``optimizer.distributed.dp_group_idx_*.optimizer``; the largest of its groups). An optimizer that keeps
  ``step`` as a tensor per parameter (no distributed optimizer) is not read: tensor data is not read here;
* the RNG: a SHA-256 over the decoded ``rng_state`` objects of the first :data:`MAX_RNG_OBJECTS` ranks
  (Python's and numpy's generator states, which sit inside the pickle); torch's and CUDA's generator states
  are byte tensors whose storages are not read, so they stand in the digest by their size only.

Each object read is a byte object of a few KB (``common_state`` about 2 KiB, an ``rng_state`` 35 KB in the
fixtures), at most :data:`MAX_OBJECT_BYTES` each, and at most ``2 + MAX_RNG_OBJECTS`` per iteration: what a
log reads stays bounded whatever the rank count. A value missing or of the wrong type is left unknown
(``None``) and said in a note, never guessed.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

from gtp_format.errors import FormatError
from gtp_format.model import Checkpoint
from gtp_format.reader.chunks import ChunkError
from gtp_format.reader.inert_object import InertObject, StorageRecord, load_record

MAX_RNG_OBJECTS = 8  # rng_state objects hashed per iteration (one per rank; the first ranks by key)
MAX_OBJECT_BYTES = 1 << 20  # a larger byte object is not decoded (megatron's are a few KB)
MAX_COUNT = 1 << 62
OPTIMIZER_OBJECT = ".optimizer/"  # optimizer.distributed.dp_group_idx_N.optimizer/shard_...


@dataclass
class Progress:
    iteration: int | None = None
    consumed: int | None = None
    step: int | None = None
    rng: str | None = None
    notes: list[str] = field(default_factory=list)


def _fields(obj: Any) -> dict[str, Any]:
    if isinstance(obj, InertObject):
        return obj.fields()
    return obj if isinstance(obj, dict) else {}


def _count(v: Any) -> int | None:
    if type(v) is float and v.is_integer():
        v = int(v)
    return v if type(v) is int and 0 <= v <= MAX_COUNT else None


def _decoded(ckpt: Checkpoint, key: str) -> Any:
    entry = ckpt.entries[key]
    if not entry.chunks or entry.stored_bytes > MAX_OBJECT_BYTES:
        return None
    try:
        obj = load_record(ckpt, entry)
    except (ChunkError, FormatError, RecursionError):
        return None
    return obj[0] if isinstance(obj, list) and len(obj) == 1 else obj  # the ShardedObject wrapper


def _feed(h: Any, obj: Any, budget: list[int]) -> None:
    """A canonical byte stream of a decoded object into ``h`` (bounded by ``budget[0]`` nodes)."""
    budget[0] -= 1
    if budget[0] < 0:
        raise RecursionError("too many nodes")
    if isinstance(obj, StorageRecord):
        h.update(f"<storage {obj.kind} {obj.numel}>".encode())
    elif isinstance(obj, InertObject):
        h.update(f"<{obj.qualname}(".encode())
        _feed(h, list(obj.args), budget)
        _feed(h, obj.state, budget)
        h.update(b")>")
    elif isinstance(obj, dict):
        h.update(b"{")
        for k in sorted(obj, key=repr):
            _feed(h, k, budget)
            _feed(h, obj[k], budget)
        h.update(b"}")
    elif isinstance(obj, (list, tuple)):
        h.update(b"[")
        for v in obj:
            _feed(h, v, budget)
        h.update(b"]")
    elif isinstance(obj, (bytes, bytearray)):
        h.update(b"b%d:" % len(obj) + bytes(obj))
    else:
        h.update(f"{type(obj).__name__}:{obj!r};".encode())


def progress(ckpt: Checkpoint) -> Progress:
    """The iteration, data position, step counter and RNG digest a megatron-core checkpoint records (see the
    module docstring); what it could not read is ``None`` and a note."""
    from gtp_format.megatron.args import recorded_args
    from gtp_format.megatron.topology import common_state

    out = Progress()
    state = common_state(ckpt) or {}
    args = recorded_args(ckpt)
    out.iteration = _count(state.get("iteration"))
    if out.iteration is None:
        out.iteration = _count(args.get("iteration"))
    out.consumed = _count(args.get("consumed_train_samples"))
    if out.consumed is None:
        out.consumed = _count(_fields(state.get("opt_param_scheduler")).get("num_steps"))
        if out.consumed is not None:
            out.notes.append("data position: the LR scheduler's num_steps (samples; args record no "
                             "consumed_train_samples)")
    if out.iteration is None:
        out.notes.append("common_state records no iteration ckpt can read")
    if out.consumed is None:
        out.notes.append("no data position recorded (args.consumed_train_samples, opt_param_scheduler.num_steps)")
    steps = []
    for key in sorted(k for k, e in ckpt.entries.items() if e.kind == "bytes" and OPTIMIZER_OBJECT in k)[:64]:
        groups = _fields(_decoded(ckpt, key)).get("param_groups")
        if isinstance(groups, list):
            steps += [s for g in groups[:1024] if (s := _count(_fields(g).get("step"))) is not None]
    out.step = max(steps) if steps else None
    if out.step is None:
        out.notes.append("no step counter in the optimizer's param groups (a per-parameter step tensor is not read)")
    rng_keys = sorted(k for k, e in ckpt.entries.items() if e.kind == "bytes" and k.startswith("rng_state/"))
    h = hashlib.sha256()
    hashed = 0
    for key in rng_keys[:MAX_RNG_OBJECTS]:
        obj = _decoded(ckpt, key)
        if obj is None:
            continue
        try:
            _feed(h, obj, [100_000])
        except RecursionError:
            continue
        hashed += 1
    if hashed:
        out.rng = h.hexdigest()
        out.notes.append(f"RNG compared by the Python and numpy generator states of {hashed} of "
                         f"{len(rng_keys)} rng_state objects (torch/CUDA generator tensors not read)")
    else:
        out.notes.append("no rng_state ckpt can decode: RNG not compared")
    return out
