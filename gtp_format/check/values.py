"""What the saved values say: NaN/Inf by kind of state, and GTP tail padding that is not zero.

Why severities differ: a NaN or Inf in a model weight or an fp32 master weight is a checkpoint
that cannot train (the next forward pass spreads it); in an Adam moment it is a warning, since
``exp_avg_sq`` can overflow on its own and the step guards against it only at use. The counts come
from the chunk records' statistics (no data read) or, with ``--data``, from the scan of every
element, which is the authority when both exist.

Padding: a GTP-sharded weight's dim 0 is padded at the tail so every shard has the same rows
(:mod:`gtp_format.layout.shard`), and its bucket slice in each optimizer key ends with the same
padding rows. The runtime keeps them zero; any other value is the bug class of Megatron-LM
#7168 (padding that leaked into the weights and blew up the grad norm). Only those elements are
read: for each parameter, its padding range in every optimizer state key and its padding rows
in the model weight key.
"""

from __future__ import annotations

import numpy as np

from gtp_format.check.analysis import MODEL, OPTIMIZER, KeyClass
from gtp_format.errors import ChunkError, FormatError
from gtp_format.integrity.records import Records
from gtp_format.model import Checkpoint, Problem
from gtp_format.names import STATES
from gtp_format.reader.boxes import BoxReader
from gtp_format.views.ours import param_views
from gtp_format.views.records import ParamView

WEIGHT_STATES = ("param",)  # optimizer states that are weights (fp32 masters); the rest are moments


def nonfinite_severity(cls: KeyClass | None, roles_known: bool) -> str:
    """``error`` for model weights and master weights, ``warning`` for moments and anything else.

    ``roles_known``: the checkpoint is ours or Megatron's (a manifest or ``metadata.json``), so a key
    that is not optimizer state is a model weight; in a foreign DCP checkpoint it may be anything.
    """
    if cls is None or not roles_known:
        return "warning"
    if cls.category == MODEL or (cls.category == OPTIMIZER and cls.opt is not None and cls.opt.state in WEIGHT_STATES):
        return "error"
    return "warning"


def _what(cls: KeyClass | None, roles_known: bool) -> str:
    if cls is not None and cls.category == MODEL and roles_known:
        return "model weight"
    if cls is not None and cls.opt is not None:
        return "master weight" if cls.opt.state in WEIGHT_STATES else f"optimizer moment {cls.opt.state}"
    return "state"


def nonfinite_problem(key: str, nan: int, posinf: int, neginf: int | None, cls: KeyClass | None,
                      source: str, roles_known: bool = True, padding_unknown: str | None = None) -> Problem:
    """One line per key; ``neginf`` None: ``posinf`` counts infinities of both signs.

    ``padding_unknown``: why a megatron-core checkpoint's parameter layout could not be established.
    Its distributed-optimizer bucket keys then hold alignment padding (uninitialised memory, NaN as
    often as not) that cannot be told from data, so their non-finite values are *not attributed*: a
    warning that says so, never "the run diverged" (which would tell the user to discard a good
    checkpoint).
    """
    sev = nonfinite_severity(cls, roles_known)
    inf = f"{posinf} Inf" if neginf is None else f"{posinf} +Inf and {neginf} -Inf"
    what = _what(cls, roles_known)
    if padding_unknown is not None and cls is not None and cls.opt is not None:
        return Problem("warning", "nonfinite", f"{what} holds {nan} NaN and {inf} values ({source}), not attributed: "
                       "the parameter layout is unknown, so they may be megatron-core's uninitialised alignment "
                       f"padding rather than the model's (layout: {padding_unknown})", key=key)
    fix = "; the run diverged before this save: resume from an earlier checkpoint" if sev == "error" else ""
    return Problem(sev, "nonfinite", f"{what} holds {nan} NaN and {inf} values ({source}){fix}", key=key)


def stats_nonfinite(records: Records, classes: dict[str, KeyClass]) -> list[Problem]:
    """NaN/Inf per key from the recorded statistics: no data file is read."""
    per_key: dict[str, list[int]] = {}
    for rec in records.by_chunk.values():
        if rec.stats is not None and rec.stats.nonfinite:
            acc = per_key.setdefault(rec.key, [0, 0, 0])
            acc[0] += rec.stats.nan
            acc[1] += rec.stats.posinf
            acc[2] += rec.stats.neginf
    return [nonfinite_problem(k, *v, classes.get(k), "recorded at save") for k, v in sorted(per_key.items())]


def _pad_rows(view: ParamView) -> list[tuple[int, int]]:
    """Row ranges [a, b) of dim 0 of the model weight key that are tail padding."""
    spec = view.holders[0].spec if view.holders else None
    if spec is None or spec.shard_kind is None:
        return []
    rows, padded = spec.tp_local_shape[0], spec.padded_rows
    if rows == padded:
        return []
    parts = spec.tp_size if spec.tp_mode in ("column", "vocab") else 1
    return [(t * padded + rows, (t + 1) * padded) for t in range(parts)]


def _nonzero(arr: np.ndarray) -> int:
    """Elements whose stored bits are not all zero (so ``-0.0`` and NaN count: padding is written as 0)."""
    return int(np.count_nonzero(arr.reshape(-1)))


def check_padding(ckpt: Checkpoint) -> list[Problem]:
    """Every padding element the manifest's layout places, in the optimizer state and model weight keys, is zero."""
    m = ckpt.manifest
    if m is None or m.buffers is None or m.topology is None:
        return []
    try:
        views = param_views(m)
    except FormatError:
        return []  # a layout the view cannot place: the manifest checks report it
    out: list[Problem] = []
    reader = BoxReader(ckpt)
    try:
        for view in views.values():
            for h in view.holders:
                pad = h.numel - h.valid_numel
                for state in STATES if pad else ():
                    key, lo = h.ref.key(state), h.start + h.valid_numel
                    _check_box(reader, ckpt, key, (lo,), (pad,), f"{view.name}'s padding elements [{lo}, {lo + pad})",
                               out)
            entry = ckpt.entries.get(view.model_key)
            if entry is None or entry.shape is None or entry.shape[0] != view.global_shape[0] or view.layer is not None:
                continue
            for a, b in _pad_rows(view):
                _check_box(reader, ckpt, view.model_key, (a, *[0] * (len(entry.shape) - 1)),
                           (b - a, *entry.shape[1:]), f"padding rows [{a}, {b})", out)
    finally:
        reader.close()
    return out


def _check_box(reader: BoxReader, ckpt: Checkpoint, key: str, offsets: tuple[int, ...], sizes: tuple[int, ...],
               what: str, out: list[Problem]) -> None:
    if key not in ckpt.entries:
        return
    try:
        n = _nonzero(reader.read_box(key, offsets, sizes))
    except ChunkError:
        return  # unreadable chunks are the data pass's problems, reported there once
    if n:
        out.append(Problem("error", "tail_padding", f"{n} of {what} are not zero: GTP tail padding must stay zero "
                           "(a layout bug leaked values into it, Megatron-LM #7168); find the writer that filled it",
                           key=key))
