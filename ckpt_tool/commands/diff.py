"""``ckpt diff``: compare two checkpoints key by key, streaming.

Where both sides cut a tensor into the same chunks (the usual case: same topology), chunks are
compared pair by pair and only one pair is in memory at a time. Where the layouts differ (a
resharded checkpoint), the key is assembled whole on both sides, bounded by ``--max-bytes``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

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
    progress,
    progress_enabled,
    table,
)
from gtp_format.errors import EXIT_CHECK_FAILED

if TYPE_CHECKING:
    from gtp_format.model import Checkpoint, Entry

EPILOG = """Examples:

  ckpt diff runs/a/checkpoints runs/b/checkpoints

  ckpt diff A/iter_0000100 B/iter_0000100 --atol 1e-6 --format json

Values match when |a - b| <= atol + rtol * |b| (NaN equals NaN); the default is exact.

Exit codes: 0 identical, 1 different, 2 unreadable input."""


class _Tally:
    """Running result of one key's value comparison."""

    def __init__(self) -> None:
        self.mismatches = 0
        self.max_abs_diff: float | None = None
        self.first: list[int] | None = None

    def add(self, mismatches: int, max_abs_diff: float | None, first: list[int] | None) -> None:
        self.mismatches += mismatches
        if max_abs_diff is not None:
            self.max_abs_diff = max(self.max_abs_diff or 0.0, max_abs_diff)
        if self.first is None and first is not None:
            self.first = first


def _compare_values(ca: Checkpoint, ea: Entry, cb: Checkpoint, eb: Entry, rtol: float, atol: float,
                    max_bytes: int, advance: Any) -> _Tally:
    import torch

    from ckpt_tool.tensors import assemble, compare
    from gtp_format.reader.chunks import load_chunk

    tally = _Tally()
    boxes_b = {(c.offsets, c.sizes): c for c in eb.chunks}
    if sorted(boxes_b) == sorted((c.offsets, c.sizes) for c in ea.chunks):
        for c in ea.chunks:
            res = compare(load_chunk(ca, ea, c), load_chunk(cb, eb, boxes_b[(c.offsets, c.sizes)]), rtol, atol)
            first = None
            if res.first_mismatch is not None:
                local = torch.unravel_index(torch.tensor(res.first_mismatch), c.sizes) if c.sizes else ()
                first = [o + int(i) for o, i in zip(c.offsets, local)]
            tally.add(res.mismatches, res.max_abs_diff, first)
            advance(2)
        return tally
    rows = ea.shape[0] if ea.shape else 0
    a = assemble(ca, ea, 0, rows, max_bytes).tensor
    b = assemble(cb, eb, 0, rows, max_bytes).tensor
    res = compare(a, b, rtol, atol)
    first = None
    if res.first_mismatch is not None:
        first = [int(i) for i in torch.unravel_index(torch.tensor(res.first_mismatch), a.shape)] if a.dim() else []
    tally.add(res.mismatches, res.max_abs_diff, first)
    advance(len(ea.chunks) + len(eb.chunks))
    return tally


def _compare_objects(ca: Checkpoint, ea: Entry, cb: Checkpoint, eb: Entry) -> bool:
    from gtp_format.errors import ChunkError
    from gtp_format.reader.chunks import chunk_bytes, load_object

    if chunk_bytes(ca, ea, ea.chunks[0]) == chunk_bytes(cb, eb, eb.chunks[0]):
        return True
    try:  # torch.save blobs of equal objects can still differ byte-wise
        return bool(load_object(ca, ea) == load_object(cb, eb))
    except (ChunkError, RuntimeError):
        return False


@handle_errors
def diff_command(
    a: Annotated[Path, typer.Argument(help="First checkpoint (folder or its parent).", show_default=False)],
    b: Annotated[Path, typer.Argument(help="Second checkpoint (folder or its parent).", show_default=False)],
    rtol: Annotated[float, typer.Option("--rtol", min=0.0, help="Relative tolerance for values.")] = 0.0,
    atol: Annotated[float, typer.Option("--atol", min=0.0, help="Absolute tolerance for values.")] = 0.0,
    max_bytes: MaxBytesOption = DEFAULT_MAX_BYTES,
    fmt: FormatOption = OutputFormat.table,
) -> None:
    """Compare key sets, shapes, dtypes and values of two checkpoints; exit 1 when they differ."""
    from gtp_format.model import BYTES
    from gtp_format.reader.checkpoint import open_checkpoint

    ca, cb = open_checkpoint(a), open_checkpoint(b)
    only_a = sorted(ca.entries.keys() - cb.entries.keys())
    only_b = sorted(cb.entries.keys() - ca.entries.keys())
    common = [k for k in ca.entries if k in cb.entries]
    diffs: list[dict[str, Any]] = []
    total = sum(len(ca.entries[k].chunks) + len(cb.entries[k].chunks) for k in common)
    with progress(total, "comparing", progress_enabled(fmt)) as advance:
        for key in common:
            ea, eb = ca.entries[key], cb.entries[key]
            if ea.kind != eb.kind:
                diffs.append({"key": key, "what": "kind", "a": ea.kind, "b": eb.kind})
            elif ea.kind == BYTES:
                if not _compare_objects(ca, ea, cb, eb):
                    diffs.append({"key": key, "what": "object", "a": ea.stored_bytes, "b": eb.stored_bytes})
                advance(2)
            elif ea.shape != eb.shape:
                diffs.append({"key": key, "what": "shape", "a": fmt_shape(ea.shape), "b": fmt_shape(eb.shape)})
            elif ea.dtype != eb.dtype:
                diffs.append({"key": key, "what": "dtype", "a": str(ea.dtype), "b": str(eb.dtype)})
            else:
                t = _compare_values(ca, ea, cb, eb, rtol, atol, max_bytes, advance)
                if t.mismatches:
                    diffs.append({"key": key, "what": "values", "mismatches": t.mismatches,
                                  "max_abs_diff": t.max_abs_diff, "first_mismatch": t.first})
    equal = not (only_a or only_b or diffs)
    if fmt == OutputFormat.json:
        print_json({"a": str(ca.root), "b": str(cb.root), "equal": equal, "rtol": rtol, "atol": atol,
                    "compared": len(common), "only_in_a": only_a, "only_in_b": only_b, "differences": diffs})
    else:
        rows = [(k, "only in A", "") for k in only_a] + [(k, "only in B", "") for k in only_b]
        for d in diffs:
            if d["what"] == "values":
                detail = (f"{d['mismatches']} elements differ, max |a-b| {d['max_abs_diff']}, "
                          f"first at {d['first_mismatch']}")
            else:
                detail = f"A: {d['a']}  B: {d['b']}"
            rows.append((d["key"], d["what"], detail))
        verdict = "identical" if equal else "DIFFERENT"
        print_blocks(table(rows, ("key", "difference", "detail"), "Differences"),
                     f"{verdict}: {len(common)} common keys compared, {len(only_a)} only in A, {len(only_b)} only "
                     f"in B, {len(diffs)} differ (rtol={rtol}, atol={atol})")
    if not equal:
        first = (diffs[0]["key"] if diffs else (only_a or only_b)[0])
        fail(f"checkpoints differ: {len(diffs)} keys differ, {len(only_a)} only in {ca.root}, {len(only_b)} only in "
             f"{cb.root}; first: {first}", EXIT_CHECK_FAILED)


def register(app: typer.Typer) -> None:
    app.command(name="diff", epilog=EPILOG)(diff_command)
