"""``ckpt verify``: structural checks, and with ``--data`` a full read of every chunk.

Exit 1 when any check finds an error (warnings and infos do not fail it), with a one-line
summary on stderr so a script sees why without parsing the report.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer

from ckpt_tool.locations import checkpoint_arg
from ckpt_tool.output import (
    FormatOption,
    OutputFormat,
    count,
    fail,
    handle_errors,
    print_blocks,
    print_json,
    progress,
    progress_enabled,
    table,
)
from gtp_format.errors import EXIT_CHECK_FAILED

EPILOG = """Examples:

  ckpt verify runs/gpt/checkpoints

  ckpt verify runs/gpt/checkpoints/iter_0000100 --data

  ckpt verify CKPT --cp-size 2 --format json   (declares folded buffers saved with CP=2)

  ckpt verify CKPT --data --workers 2   (leave cores to a training job on the same node)

Checks: chunks in bounds and tiling each tensor (no overlap, no hole); storage present, inside
the folder and within its file; per_bucket_numel against the bucket keys; folded buffers have
every cp_rank; aliasing (cp-less optimizer keys in a folded checkpoint); manifest file sizes;
every key the manifest's bucket layout implies is stored, with its shape.
chunk records (gtp_chunks.json): one per chunk, naming its bytes; NaN/Inf they recorded (error in
weights and fp32 masters, warning in moments); megatron-core's integrity.json where present.
--data adds: every chunk decodes to its declared dtype and shape, its xxh3-128 matches its record,
NaN/Inf counts, zero GTP tail padding, checksums (CRC-32C, SHA-256 of integrity.json).

Exit codes: 0 no errors, 1 errors found, 2 unreadable input."""


@handle_errors
def verify_command(
    path: Annotated[object, typer.Argument(  # a Location (Path or ObjectURL): Typer refuses Union annotations
        parser=checkpoint_arg("PATH"), help="Checkpoint folder (iter_XXXXXXX) or its parent, or s3://BUCKET/PREFIX.",
        show_default=False)],
    data: Annotated[bool, typer.Option("--data", help="Also decode every chunk and check file checksums.")] = False,
    cp_size: Annotated[
        int | None,
        typer.Option("--cp-size", min=1, help="CP degree the folded buffers were saved with; >1 declares folding."),
    ] = None,
    folded: Annotated[
        bool, typer.Option("--folded", help="With --cp-size N: declare CP folded even for a megatron-core "
                           "checkpoint (megatron-core itself never folds).")
    ] = False,
    workers: Annotated[
        int | None,
        typer.Option("--workers", min=1, max=64, show_default="one per core, at most 8 (16 for a bucket)",
                     help="Threads that read, hash and scan with --data."),
    ] = None,
    fmt: FormatOption = OutputFormat.table,
    session: Any = None,  # the command's (handle_errors): no option
) -> None:
    """Check a checkpoint's structure (and with --data its contents); exit 1 on errors."""
    from gtp_format.check.data import data_bytes
    from gtp_format.check.verify import verify
    from gtp_format.reader.checkpoint import open_checkpoint

    if data:  # every byte is read: a bucket's small data objects are fetched whole from the listing on
        from gtp_format.storage import objects
        from gtp_format.storage.base import storage_for

        # what its reads hold in flight anyway
        storage_for(path, session).reads_everything(objects.PART * objects.IN_FLIGHT)
    ckpt = open_checkpoint(path, session=session)
    # in bytes, like every engine that moves data: someone watching a 500 GB verify wants GB/s and an ETA
    with progress(data_bytes(ckpt) if data else 0, "reading", progress_enabled(fmt)) as advance:
        result = verify(ckpt, data=data, cp_size=cp_size, progress=advance, workers=workers,
                        folded=folded)
    errors = [p for p in result.problems if p.severity == "error"]
    warnings = [p for p in result.problems if p.severity == "warning"]
    if fmt == OutputFormat.json:
        print_json({"path": str(ckpt.root), "ok": result.ok, "data": data, "checks": result.checks,
                    "stats": result.stats, "errors": len(errors), "warnings": len(warnings),
                    "problems": [p.to_dict() for p in result.problems]})
    else:
        rows = [(p.severity, p.check, p.key or "-", "-" if p.chunk is None else p.chunk, p.file or "-", p.message)
                for p in result.problems]
        status = "OK" if result.ok else "FAILED"
        print_blocks(
            table(rows, ("severity", "check", "key", "chunk", "file", "message"), "Problems"),
            f"{status}: {count(len(errors), 'error')}, {count(len(warnings), 'warning')} in {ckpt.root} "
            f"({count(result.stats['keys'], 'key')}, {count(result.stats['chunks'], 'chunk')}; checks that ran: "
            f"{', '.join(result.checks)})",
        )
    line = result.failure_line(ckpt.root)
    if line is not None:
        fail(line, EXIT_CHECK_FAILED)


def register(app: typer.Typer) -> None:
    app.command(name="verify", epilog=EPILOG)(verify_command)
