"""What an HF folder's optimizer files carry besides the tensors, so ``ckpt import`` can resume them.

Adam's moments alone do not resume a run: the update divides them by ``1 - beta**step`` (the bias
correction), so moments restored at step 0 would take a far larger first step than the run they
came from; the learning rate follows the schedule's own step count, and the data continues at the
consumed sample count. ``ckpt export --to hf --optimizer`` therefore writes, in the
``__metadata__`` of every ``optimizer*.safetensors`` file (safetensors' own place for string
metadata, read with the header and never unpickled), one field :data:`FIELD` holding a JSON
object: the checkpoint's iteration, its manifest's ``optimizer`` section (type, step,
hyperparameters) and, where the checkpoint has them, the lr schedule's state and the data
position, verbatim. ``ckpt import`` parses it with the manifest's own checks
(:func:`gtp_format.manifest.parse_optimizer`) and writes it back into the new manifest, so
``python -m gtp_runtime.train --load`` resumes exactly where the exported checkpoint would have.
A megatron-core source has no manifest: its optimizer files carry no run state, and import refuses
their moments in one line (``--no-optimizer`` starts them at zero instead).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from gtp_format.errors import FormatError
from gtp_format.manifest import Manifest, OptimizerInfo, parse_optimizer
from gtp_format.names import DATA_POSITION_KEY, SCHEDULER_KEY
from gtp_format.safe_json import loads

FIELD = "gtp_run_state"
CARRIED = (SCHEDULER_KEY, DATA_POSITION_KEY)  # manifest fields kept verbatim (the runtime checks them on load)


@dataclass(frozen=True)
class RunState:
    iteration: int
    optimizer: OptimizerInfo
    extra: dict[str, Any]


def metadata(manifest: Manifest | None) -> dict[str, str]:
    """The ``__metadata__`` fields of an optimizer file exported from a checkpoint with ``manifest``."""
    if manifest is None or manifest.optimizer is None:
        return {}
    doc: dict[str, Any] = {"iteration": manifest.iteration, "optimizer": manifest.optimizer.to_json()}
    doc.update({k: manifest.extra[k] for k in CARRIED if k in manifest.extra})
    return {FIELD: json.dumps(doc, sort_keys=True, separators=(",", ":"))}


def parse(metas: list[dict[str, str]], where: str) -> RunState:
    """The run state of a set of optimizer files (every file must carry the same one)."""
    texts = {m.get(FIELD) for m in metas}
    if None in texts:
        raise FormatError(f"{where}: has no {FIELD!r} in its safetensors __metadata__ (the Adam step count and lr "
                          "schedule), so its moments cannot resume; export the checkpoint with this tool's `ckpt "
                          "export --to hf --optimizer`, or pass --no-optimizer to start the moments at zero")
    if len(texts) != 1:
        raise FormatError(f"{where}: its files carry different {FIELD!r} metadata; the optimizer files come from "
                          "different exports: copy one export's files")
    text = texts.pop()
    assert text is not None
    doc = loads(text.encode(), where, "export the checkpoint again")
    if not isinstance(doc, dict):
        raise FormatError(f"{where}: {FIELD!r} is not a JSON object; export the checkpoint again")
    it = doc.get("iteration")
    if type(it) is not int or it < 0:
        raise FormatError(f"{where}: {FIELD!r} iteration is {it!r}, not a non-negative integer; export it again")
    opt = parse_optimizer(doc.get("optimizer"), f"{where}: {FIELD}")
    if opt.type != "adamw" or opt.param_optimizers:
        raise FormatError(f"{where}: the optimizer is {opt.type!r}; ckpt import restores AdamW moments only "
                          "(pass --no-optimizer to start from the weights)")
    extra = {}
    for k in CARRIED:
        if k in doc:
            if not isinstance(doc[k], dict):
                raise FormatError(f"{where}: {FIELD!r} {k} is not a JSON object; export the checkpoint again")
            extra[k] = doc[k]
    return RunState(it, opt, extra)
