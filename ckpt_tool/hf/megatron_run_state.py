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
"""

from __future__ import annotations

import json
import pickletools
import struct
from dataclasses import dataclass
from typing import Any

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


@dataclass(frozen=True)
class MegatronRunState:
    iteration: int
    step: float


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
    doc = {"iteration": ckpt.iteration, "step": steps.pop()}
    return {FIELD: json.dumps(doc, sort_keys=True, separators=(",", ":"))}


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
    return MegatronRunState(it, float(step))
