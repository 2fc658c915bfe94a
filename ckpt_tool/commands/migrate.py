"""``ckpt migrate-aliased``: repair a checkpoint written by the pre-fix (aliased) writer.

The work is :func:`ckpt_tool.migrate.run.migrate_aliased` (one call); this module holds the
options, prints its report (table or JSON) and exits with its error, if any.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer

from ckpt_tool.locations import checkpoint_arg
from ckpt_tool.output import (
    FormatOption,
    OutputFormat,
    fail,
    fmt_bytes,
    handle_errors,
    print_blocks,
    print_json,
    progress,
    progress_enabled,
    table,
)

EPILOG = """Examples:

  ckpt migrate-aliased runs/gpt/checkpoints runs/gpt/checkpoints-fixed --dry-run

  ckpt migrate-aliased runs/gpt/checkpoints runs/gpt/checkpoints-fixed --reset-lost-moments

  ckpt migrate-aliased runs/gpt/checkpoints/iter_0000100 --in-place --reset-lost-moments --format json

What it does: each surviving chunk of a folded optimizer key without .cp_rank_{i} is renamed to
{key}.cp_rank_{w}, w being the CP rank of the rank that wrote it (from the __{rank}_{k}.distcp file
name and the manifest topology). Only .metadata and gtp_manifest.json are rewritten; every data
file is hard-linked into DST (copied where links fail, e.g. across filesystems). Do not edit the
linked files in place afterwards: they are the same files as SRC's.

What was lost: the other CP ranks' copy of every chunk. Their fp32 master params are rebuilt from
the model weights of the same checkpoint (bit-exact with fp32 weights; recorded as lossy
otherwise). Their Adam moments are gone: without --reset-lost-moments the command lists them and
exits 1 without writing anything; with it they are written as zeros. Rebuilt and reset chunks go
to one new data file (__{world}_0.distcp), and the manifest records all of it under "notes" and
"migration".

SRC and DST: SRC is an iter_XXXXXXX folder or a parent holding latest_checkpointed_iteration.txt;
from a parent only the iteration it names is migrated, and DST is created as a parent with that
iter_XXXXXXX folder and its own latest_checkpointed_iteration.txt (other iterations are not
copied). Otherwise DST is the migrated iteration folder itself. DST must not exist and its parent
must; it appears at once (built in a hidden sibling folder, fsynced, renamed). SRC is never
modified. --in-place takes no DST: the migrated folder replaces SRC's iteration folder, and the
old one is kept next to it as <name>.pre-migrate-<timestamp> (printed). --dry-run writes nothing
and exits as the real run would. A checkpoint with no aliased key is left alone (exit 0).
A gtp_manifest.json is required: only it says which buffers folded, maps writer ranks to CP
ranks and holds the bucket layout; --cp-size is checked against it.

Exit codes: 0 migrated (or nothing to do), 1 SRC fails verify apart from its aliasing, lost moments
without --reset-lost-moments, or the migrated copy failed its own verify (nothing committed), 2 bad
input, DST exists."""


def _print_table(doc: dict[str, Any], verdict: str) -> None:
    c = doc["counts"]
    summary = [
        ("source", doc["source"]),
        ("destination", doc.get("destination") or "-"),
        ("topology", doc["topology"] or "-"),
        ("status", doc["message"]),
        ("aliased keys", f"{c['aliased_keys']} -> {c['new_keys']} keys with .cp_rank_{{i}}"),
        ("surviving chunks", f"{c['kept_chunks']} (renamed to their writer's CP rank, data hard-linked)"),
        ("lost chunks", f"{c['lost_chunks']} ({c['lost_elements']} elements)"),
        ("fp32 masters rebuilt", f"{c['rebuilt_param_chunks']} chunks ({doc['param_rebuild']})"),
        ("moments reset to 0", c["reset_moment_chunks"]),
        ("moments lost, not written", c["unrecoverable_moment_chunks"]),
    ]
    files = doc.get("files")
    if files:
        summary.append(("files", f"{files['linked']} hard-linked, {files['copied']} copied, new "
                                 f"{files['new_data_file'] or '-'} ({fmt_bytes(files['new_bytes'])})"))
    if doc.get("backup"):
        summary.append(("backup of SRC", doc["backup"]))
    renamed = [(k["key"], len(k["kept"]), ", ".join(f"cp_rank {r}: {sum(x['cp_rank'] == r for x in k['kept'])}"
                                                    for r in range(len(k["new_keys"]))))
               for k in doc["aliased_keys"]]
    lost = [(x["key"], x["state"], x["cp_rank"], list(x["offsets"]), list(x["sizes"]),
             f"rank {x['kept_from_rank']} (cp_rank {x['kept_cp_rank']})", x["action"]) for x in doc["lost"]]
    print_blocks(
        table(summary, ("migrate-aliased", "")),
        table(renamed, ("aliased key", "chunks", "kept per CP rank"), "Aliased keys"),
        table(lost, ("lost key", "state", "cp_rank", "offsets", "sizes", "kept copy from", "action"),
              "Lost CP-peer chunks"),
        *[f"note: {n}" for n in doc.get("notes", [])],
        verdict,
    )


@handle_errors
def migrate_command(
    src: Annotated[object, typer.Argument(  # a Location: Typer refuses Union annotations
        parser=checkpoint_arg("SRC"), help="Aliased checkpoint: iter_XXXXXXX folder or its parent (or "
        "s3://BUCKET/PREFIX; not with --in-place).", show_default=False)],
    dst: Annotated[object | None, typer.Argument(  # a Location: Typer refuses Union annotations
        parser=checkpoint_arg("DST"), help="Where the migrated checkpoint appears (must not exist): a folder or "
        "s3://BUCKET/PREFIX; omit with --in-place.", show_default=False)] = None,
    cp_size: Annotated[
        int | None, typer.Option("--cp-size", min=1, help="CP degree of the run; checked against the manifest.")
    ] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Report what would happen; write nothing.")] = False,
    in_place: Annotated[bool, typer.Option("--in-place", help="Replace SRC, keeping the old folder as a backup.")
                        ] = False,
    reset_lost_moments: Annotated[
        bool, typer.Option("--reset-lost-moments", help="Write lost Adam moments as zeros (recorded in the manifest).")
    ] = False,
    fmt: FormatOption = OutputFormat.table,
    session: Any = None,  # the command's (handle_errors): no option
) -> None:
    """Rename aliased folded optimizer keys to .cp_rank_{i}, rebuild what CP peers lost; SRC is never modified."""
    from ckpt_tool.migrate.run import migrate_aliased

    report = migrate_aliased(src, dst, cp_size=cp_size, in_place=in_place, dry_run=dry_run,
                             reset_lost_moments=reset_lost_moments,
                             progress=lambda steps: progress(steps, "migrating", progress_enabled(fmt), "steps"),
                             session=session)
    _finish(report.doc, fmt, report.verdict)
    if report.error is not None:
        fail(report.error.message, report.error.exit_code)


def _finish(doc: dict[str, Any], fmt: OutputFormat, verdict: str) -> None:
    if fmt == OutputFormat.json:
        print_json({**doc, "verdict": verdict})
    else:
        _print_table(doc, verdict)


def register(app: typer.Typer) -> None:
    app.command(name="migrate-aliased", epilog=EPILOG)(migrate_command)

