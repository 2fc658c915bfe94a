"""``ckpt migrate-aliased``: repair a checkpoint written by the pre-fix (aliased) writer.

The heavy lifting lives in :mod:`ckpt_tool.migrate_core`; this module parses options, prints the
report (table or JSON) and maps outcomes to exit codes.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

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
from gtp_format.errors import EXIT_BAD_INPUT, FormatError

if TYPE_CHECKING:
    from ckpt_tool.migrate_core import Outcome, Plan

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

Exit codes: 0 migrated (or nothing to do), 1 lost moments without --reset-lost-moments, or the
migrated copy failed its own verify (nothing committed), 2 bad input, DST exists."""


def _plan_doc(plan: Plan) -> dict[str, Any]:
    from ckpt_tool.migrate_core import lost_dict

    return {
        "source": str(plan.ckpt.root),
        "topology": plan.par.describe() if plan.par else None,
        "status": plan.status,
        "message": plan.message,
        "counts": plan.counts(),
        "param_rebuild": "exact" if not plan.lossy else "lossy",
        "lossy_weights": {n: plan.weight_dtypes[n] for n in plan.lossy},
        "aliased_keys": [{
            "key": k.source_key, "new_keys": k.new_keys,
            "kept": [{"offsets": list(c.offsets), "sizes": list(c.sizes), "file": c.file, "rank": c.rank,
                      "cp_rank": c.cp_rank, "new_key": c.new_key} for c in k.kept],
        } for k in plan.keys],
        "lost": [lost_dict(c) for c in plan.lost],
    }


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
    src: Annotated[Path, typer.Argument(help="Aliased checkpoint: iter_XXXXXXX folder or its parent.",
                                        show_default=False)],
    dst: Annotated[Path | None, typer.Argument(help="Where the migrated checkpoint appears (must not exist); "
                                               "omit with --in-place.", show_default=False)] = None,
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
) -> None:
    """Rename aliased folded optimizer keys to .cp_rank_{i}, rebuild what CP peers lost; SRC is never modified."""
    from ckpt_tool.migrate_core import check_destination, fail_if_moments_lost, plan_migration

    if in_place and dst is not None:
        raise FormatError(f"--in-place replaces SRC and takes no DST (got {dst}); drop one of them")
    if not in_place and dst is None:
        raise FormatError("missing DST: pass where the migrated checkpoint should appear, or --in-place")
    plan = plan_migration(src, cp_size, reset_lost_moments)
    doc = _plan_doc(plan)
    doc.update(mode="dry_run" if dry_run else ("in_place" if in_place else "copy"), written=False,
               destination=None if dst is None else str(dst), backup=None, files=None, notes=[])
    if dst is not None:
        check_destination(dst, plan.source)
    if plan.status != "aliased":
        _finish(doc, fmt, f"nothing to migrate: {plan.message}; nothing written")
        return
    try:
        fail_if_moments_lost(plan)
    except FormatError as e:
        _finish(doc, fmt, "REFUSED: Adam moments were lost; nothing written")
        fail(e.message + (" (dry run)" if dry_run else ""), e.exit_code)
    if dry_run:
        _finish(doc, fmt, "dry run: nothing written")
        return
    outcome = _run(plan, dst, in_place, fmt)
    doc.update(written=True, destination=str(outcome.destination),
               backup=None if outcome.backup is None else str(outcome.backup), notes=outcome.notes,
               files={"linked": outcome.linked, "copied": outcome.copied, "new_data_file": outcome.new_data_file,
                      "new_bytes": outcome.new_bytes})
    where = f"; SRC's old folder kept at {outcome.backup}" if outcome.backup else ""
    _finish(doc, fmt, f"MIGRATED: {outcome.destination}{where}")


def _run(plan: Plan, dst: Path | None, in_place: bool, fmt: OutputFormat) -> Outcome:
    from ckpt_tool.migrate_core import REBUILD, RESET, migrate_in_place, migrate_to
    from gtp_format.names import DCP_METADATA_FILE, MANIFEST_FILE

    carried = [n for n in os.listdir(plan.ckpt.root) if n not in (DCP_METADATA_FILE, MANIFEST_FILE)]
    steps = len(carried) + sum(c.action in (REBUILD, RESET) for c in plan.lost)
    with progress(steps, "migrating", progress_enabled(fmt)) as advance:
        try:
            if in_place:
                return migrate_in_place(plan, advance)
            assert dst is not None
            return migrate_to(plan, dst, advance)
        except OSError as e:
            where = f" {e.filename}" if e.filename else ""
            raise FormatError(f"cannot write{where}: {e.strerror or e}; nothing was committed, SRC is untouched",
                            EXIT_BAD_INPUT) from None


def _finish(doc: dict[str, Any], fmt: OutputFormat, verdict: str) -> None:
    if fmt == OutputFormat.json:
        print_json({**doc, "verdict": verdict})
    else:
        _print_table(doc, verdict)


def register(app: typer.Typer) -> None:
    app.command(name="migrate-aliased", epilog=EPILOG)(migrate_command)

