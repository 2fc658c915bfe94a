"""``ckpt show``: one tensor (or rows of it) assembled from its chunks, with statistics.

Only the chunks that intersect the requested rows are read, and the size of what will be
assembled is checked against ``--max-bytes`` before anything is allocated.
"""

from __future__ import annotations

import difflib
from dataclasses import replace
from typing import TYPE_CHECKING, Annotated, Any

import typer

from ckpt_tool.locations import checkpoint_arg
from ckpt_tool.output import (
    DEFAULT_MAX_BYTES,
    FormatOption,
    MaxBytesOption,
    OutputFormat,
    fail,
    fmt_shape,
    handle_errors,
    print_blocks,
    print_json,
    table,
)
from ckpt_tool.report_tables import model_rows
from gtp_format.errors import EXIT_CHECK_FAILED, FormatError

MAX_VALUES = 10_000

if TYPE_CHECKING:
    from gtp_format.model import Checkpoint, Entry

EPILOG = """Examples:

  ckpt show CKPT decoder.layers.0.mlp.linear_fc1.weight --slice 0:4 --values

  ckpt show CKPT --cp-rank 1 \\
    'optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_(torch.bfloat16, torch.float32).bucket_idx_0.exp_avg'

  ckpt show CKPT optimizer.distributed.dp_group_idx_0.per_bucket_numel/shard_0_1

Exit codes: 0 ok, 1 part of the region is covered by no chunk, 2 unreadable input or bad key."""


def resolve_entry(ckpt: Checkpoint, key: str, cp_rank: int | None) -> Entry:
    """The entry for KEY; with ``--cp-rank`` the same bucket state at that CP rank (either key form)."""
    from gtp_format.names import parse_optimizer_key

    if cp_rank is None:
        if key in ckpt.entries:
            return ckpt.entries[key]
        close = difflib.get_close_matches(key, list(ckpt.entries), n=1, cutoff=0.6)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise FormatError(f"key {key!r} is not in {ckpt.root}; {hint}list the keys with 'ckpt inspect'")
    opt = parse_optimizer_key(key)
    if opt is None:
        raise FormatError(f"--cp-rank needs an optimizer bucket key; {key!r} is not one")
    wanted = replace(opt, cp_rank=cp_rank, cp_form=None)
    present = []
    for k in ckpt.entries:
        other = parse_optimizer_key(k)
        if other is not None and other.bucket_id == opt.bucket_id and other.state == opt.state:
            present.append(other.cp_rank)
            if replace(other, cp_form=None) == wanted:
                return ckpt.entries[k]
    ranks = sorted(r for r in present if r is not None)
    raise FormatError(f"no cp_rank {cp_rank} copy of {key!r} in {ckpt.root}; cp ranks present: {ranks or 'none'}")


def _stacked(ckpt: Checkpoint, name: str) -> tuple[Entry, int, int | None] | None:
    """megatron-core's stacked key for a per-layer name ``decoder.layers.<i>.<rest>`` that
    ``inspect --params`` prints, narrowed to layer ``i`` (rows ``[i, i+1)`` of the leading axis),
    and for a per-expert name ``decoder.layers.<i>.mlp.experts.<e>.<rest>`` to expert ``e`` as well
    (the expert keys stack experts on the second axis)."""
    import re

    from gtp_format.megatron.keys import EXPERT, EXPERT_PREFIX, LAYER

    m = re.fullmatch(r"decoder\.layers\.([0-9]{1,9})\.mlp\.experts\.([0-9]{1,9})\.(.+)", name)
    if m is not None and m.group(3) in EXPERT:
        e = ckpt.entries.get(EXPERT_PREFIX + m.group(3))
        layer, expert = int(m.group(1)), int(m.group(2))
        if e is None or e.shape is None or len(e.shape) < 2 or layer >= e.shape[0] or expert >= e.shape[1]:
            return None
        return e, layer, expert
    m = re.fullmatch(r"decoder\.layers\.([0-9]{1,9})\.(.+)", name)
    if m is None:
        return None
    rest = dict(LAYER).get(m.group(2), m.group(2))
    e = ckpt.entries.get(f"decoder.layers.{rest}")
    if e is None or not e.shape or int(m.group(1)) >= e.shape[0]:
        return None
    return e, int(m.group(1)), None


@handle_errors
def show_command(
    path: Annotated[object, typer.Argument(  # a Location: Typer refuses Union annotations
        parser=checkpoint_arg("PATH"), help="Checkpoint folder (iter_XXXXXXX) or its parent.", show_default=False)],
    key: Annotated[str, typer.Argument(help="Key to show (quote it: keys contain parentheses).", show_default=False)],
    cp_rank: Annotated[
        int | None, typer.Option("--cp-rank", min=0, help="For a folded optimizer key: which CP rank's copy.")
    ] = None,
    slice_: Annotated[
        str | None, typer.Option("--slice", help="Rows a:b of dim 0 (only those chunks are read).")
    ] = None,
    values: Annotated[bool, typer.Option("--values", help=f"Print the values too (at most {MAX_VALUES}).")] = False,
    max_bytes: MaxBytesOption = DEFAULT_MAX_BYTES,
    fmt: FormatOption = OutputFormat.table,
    session: Any = None,  # the command's (handle_errors): no option
) -> None:
    """Assemble one tensor from its chunks and print shape, dtype and statistics."""
    from gtp_format.model import BYTES
    from gtp_format.reader.checkpoint import open_checkpoint

    ckpt = open_checkpoint(path, session=session)
    stacked = _stacked(ckpt, key) if key not in ckpt.entries and cp_rank is None else None
    if stacked is not None and slice_ is not None:
        which = f"layer {stacked[1]}" + (f", expert {stacked[2]}" if stacked[2] is not None else "")
        raise FormatError(f"{key} is {which} of the stacked key {stacked[0].key}; drop --slice, or "
                          f"show {stacked[0].key!r} with --slice")
    entry = stacked[0] if stacked is not None else resolve_entry(ckpt, key, cp_rank)
    model = _model(ckpt)
    if entry.kind == BYTES:
        _show_object(ckpt, entry, fmt, model)
        return
    from ckpt_tool.tensors import parse_slice, summary
    from gtp_format.reader.region import assemble

    if not entry.shape and slice_ is not None:
        raise FormatError(f"{entry.key} is 0-dimensional; drop --slice")
    start, stop = parse_slice(slice_, entry.shape[0]) if entry.shape else (0, 0)
    if stacked is not None:
        start, stop = stacked[1], stacked[1] + 1
    got = assemble(ckpt, entry, start, stop, max_bytes)
    if stacked is not None and stacked[2] is not None:  # one expert of the layer's row
        got = replace(got, tensor=got.tensor[:, stacked[2]:stacked[2] + 1])
    gaps = _padding_in(ckpt, entry.key, start, stop)
    info = summary(_without(got.tensor, gaps, start) if gaps else got.tensor)
    info["shape"] = list(got.tensor.shape)
    info["padding"] = sum(z - a for a, z in gaps)
    doc: dict[str, Any] = {"key": entry.key, "global_shape": list(entry.shape or ()), "dtype": str(entry.dtype),
                           "slice": [start, stop] if entry.shape else None, "chunks": len(entry.chunks),
                           "chunks_read": got.chunks_read, "uncovered": got.missing, **info,
                           "megatron_model": model}
    if values:
        if got.tensor.numel() > MAX_VALUES:
            raise FormatError(f"{entry.key}: {got.tensor.numel()} values is over {MAX_VALUES}; pass --slice a:b")
        doc["values"] = got.tensor.tolist()
    if fmt == OutputFormat.json:
        print_json(doc)
    else:
        rows = [("key", entry.key), ("global shape", fmt_shape(entry.shape)),
                ("rows", f"[{start}, {stop})" if entry.shape else "-"), ("shape", fmt_shape(info["shape"])),
                ("dtype", str(entry.dtype).removeprefix("torch.")),
                ("chunks read", f"{got.chunks_read} of {len(entry.chunks)}"),
                *[(k, "-" if info[k] is None else info[k]) for k in ("min", "max", "mean", "std", "nan", "inf")],
                ("padding", f"{info['padding']} elements (alignment gaps, left out of the statistics)"
                 if info["padding"] else "-"),
                ("uncovered", got.missing), *model_rows(model)]
        blocks = [table(rows, ("tensor", ""))]
        if values:
            blocks.append(str(got.tensor))
        print_blocks(*blocks)
    if got.missing:
        fail(f"{entry.key}: {got.missing} elements of rows [{start}, {stop}) are in no chunk (shown as 0); "
             "run 'ckpt verify' for the holes", EXIT_CHECK_FAILED)


def _padding_in(ckpt: Checkpoint, key: str, start: int, stop: int) -> list[tuple[int, int]]:
    """The alignment gaps of a megatron-core optimizer key inside rows [start, stop)."""
    from gtp_format.megatron.topology import is_megatron_core
    from gtp_format.names import parse_optimizer_key

    if parse_optimizer_key(key) is None or not is_megatron_core(ckpt):
        return []
    from gtp_format.megatron.padding import padding_ranges

    gaps = padding_ranges(ckpt).get(key, [])
    return [(max(a, start), min(z, stop)) for a, z in gaps if a < stop and start < z]


def _without(t: Any, gaps: list[tuple[int, int]], start: int) -> Any:
    import torch

    keep = torch.ones(t.shape[0], dtype=torch.bool)
    for a, z in gaps:
        keep[a - start:z - start] = False
    return t[keep]


def _model(ckpt: Checkpoint) -> dict[str, Any] | None:
    """The model a megatron-core checkpoint holds, as ``inspect`` prints it
    (:func:`gtp_format.report.megatron_model`); None for another checkpoint. Args that disagree with
    the shapes are shown as that disagreement, not refused: ``show`` is how a user reads those args
    (``ckpt show CKPT common_state/shard_0_1``)."""
    from gtp_format.megatron.topology import is_megatron_core
    from gtp_format.report import megatron_model

    if not is_megatron_core(ckpt):
        return None
    try:
        return megatron_model(ckpt)
    except FormatError as e:
        why = str(e).removeprefix(f"{ckpt.root}: ")
        return {"error": why, "text": f"not described: {why}"}


def _show_object(ckpt: Checkpoint, entry: Entry, fmt: OutputFormat, model: dict[str, Any] | None = None) -> None:
    """A byte object as inert records (nothing in it runs): one row per field path."""
    from gtp_format.reader.inert_object import flatten, load_record

    obj = load_record(ckpt, entry)
    rows = flatten(obj)
    text = repr(obj)
    doc = {"key": entry.key, "kind": "bytes", "stored_bytes": entry.stored_bytes, "type": type(obj).__name__,
           "repr": text[:10_000], "fields": [{"path": p, "type": t, "value": v} for p, t, v in rows],
           "megatron_model": model}
    if fmt == OutputFormat.json:
        print_json(doc)
    else:
        head = [("key", entry.key), ("stored bytes", entry.stored_bytes), ("type", type(obj).__name__),
                *model_rows(model)]
        print_blocks(table(head, ("object", "")), table(rows, ("path", "type", "value"), "Fields (inert records)"),
                     *([f"value: {text}"] if len(text) <= 400 else []))


def register(app: typer.Typer) -> None:
    app.command(name="show", epilog=EPILOG)(show_command)
