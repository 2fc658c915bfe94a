"""``ckpt inspect``: what a checkpoint holds, from its metadata alone.

Inspecting is what people do first with a checkpoint they do not trust, so it must be cheap and
safe: it parses ``.metadata`` through the allow-list and reads no tensor data (only ``stat``), which
keeps it fast on multi-TB checkpoints too. The one exception is a genuine megatron-core checkpoint's
``common_state`` byte object (about 2 KiB, at most 1 MiB read), decoded as inert records for the
parallel sizes and optimizer format megatron recorded there (:mod:`gtp_format.megatron.topology`).
"""

from __future__ import annotations

from typing import Annotated, Any

import typer

from ckpt_tool.locations import checkpoint_arg
from ckpt_tool.output import (
    FormatOption,
    IgnoreOption,
    KeysOption,
    OutputFormat,
    handle_errors,
    print_blocks,
    print_json,
)

EPILOG = """Examples:

  ckpt inspect runs/gpt/checkpoints   (follows latest_checkpointed_iteration.txt)

  ckpt inspect runs/gpt/checkpoints/iter_0000100 --keys 'optimizer.*exp_avg*'

  ckpt inspect CKPT --chunks --format json

  ckpt inspect CKPT --params   (each parameter's bucket, offset, ranks and CP ranks)

  ckpt inspect CKPT --stats   (NaN/Inf/zeros, min, max, RMS per key, recorded at save; --format json: per chunk)

Exit codes: 0 ok, 2 unreadable input."""


@handle_errors
def inspect_command(
    path: Annotated[object, typer.Argument(  # a Location (Path or ObjectURL): Typer refuses Union annotations
        parser=checkpoint_arg("PATH"), help="Checkpoint folder (iter_XXXXXXX) or its parent, or s3://BUCKET/PREFIX.",
        show_default=False)],
    keys: KeysOption = None,
    ignore: IgnoreOption = None,
    chunks: Annotated[bool, typer.Option("--chunks", help="List every chunk: offsets, sizes, file, bytes.")] = False,
    cp_size: Annotated[
        int | None, typer.Option("--cp-size", min=1, help="CP degree of folded buffers, when no manifest says.")
    ] = None,
    folded: Annotated[
        bool, typer.Option("--folded", help="With --cp-size N: declare CP folded even for a megatron-core "
                           "checkpoint (megatron-core itself never folds).")
    ] = False,
    params: Annotated[bool, typer.Option("--params", help="Per parameter: bucket, offset, ranks, CP ranks.")] = False,
    stats: Annotated[bool, typer.Option("--stats", help="Value statistics per key recorded at save (no data read); "
                                        "per chunk with --format json.")] = False,
    fmt: FormatOption = OutputFormat.table,
    session: Any = None,  # the command's (handle_errors): no option
) -> None:
    """Show format, topology, keys and aliasing status of a checkpoint (metadata only)."""
    from ckpt_tool.report_tables import inspect_tables
    from gtp_format.compare import KeyFilter
    from gtp_format.report import inspect_report

    doc = inspect_report(path, KeyFilter.of(keys, ignore), chunks=chunks, cp_size=cp_size, folded=folded,
                         params=params, stats=stats, session=session)
    if fmt == OutputFormat.json:
        print_json(doc)
        return
    print_blocks(*inspect_tables(doc))


def register(app: typer.Typer) -> None:
    app.command(name="inspect", epilog=EPILOG)(inspect_command)
