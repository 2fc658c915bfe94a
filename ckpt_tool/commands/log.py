"""``ckpt log RUN``: every iteration of a run folder in order, its recorded identity, what changed, what is wrong.

Metadata only: each iteration's manifest and chunk records (``gtp_chunks.json``) are read, never a
data file, so a long run logs in the time of its small side files. The checks are the format
package's (:mod:`gtp_format.check.lineage`), the same ones ``--load`` refuses on.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Annotated, Any

import typer

from ckpt_tool.locations import checkpoint_arg
from ckpt_tool.output import (
    FormatOption,
    OutputFormat,
    handle_errors,
    print_blocks,
    print_json,
    progress,
    progress_enabled,
    table,
)

EPILOG = """Examples:

  ckpt log runs/gpt/checkpoints   (every iter_* folder, oldest first)

  ckpt log s3://bucket/runs/gpt --format json   (one object per iteration: iteration, run_id, parent,
  root_hash, topology, changed, problems)

What it reports as a problem (exit 1), naming the iteration: a recorded iteration or data position that
disagrees with the folder name or goes backwards; content equal to an earlier iteration's although steps
were taken (a stale save; weights alone unchanged, as with --lr 0, is not one); optimizer state that
restarted inside a run (step counter back, moments all zero); a latest marker that names something other
than the newest complete iteration; another run's iteration mixed in (run id changes without a recorded
--load from it).

Exit codes: 0 the history is consistent, 1 a problem was found, 2 unreadable input."""

SHORT = {"changed": "C", "unchanged": "=", "n/a": "-", "first": "."}


def _changed(c: dict[str, str]) -> str:
    return " ".join(f"{k[0] if k != 'masters' else 'M'}{SHORT.get(v, '?')}" for k, v in c.items())


def _parent(p: dict[str, Any] | None) -> str:
    if p is None:
        return "-"
    return f"{p['via']} {(p['run_id'] or '?')[:8]}@{p['iteration'] if p['iteration'] is not None else '?'}"


def log_tables(doc: dict[str, Any]) -> list[str]:
    rows = []
    for e in doc["iterations"]:
        if not e["complete"]:
            rows.append((e["folder"], "-", "-", "-", "-", "-", "incomplete", "; ".join(e["notes"])[:120]))
            continue
        att = e["attestation"]
        rows.append((e["folder"], "-" if e["recorded_iteration"] is None else e["recorded_iteration"],
                     (e["run_id"] or "-")[:8], _parent(e["parent"]) + (f" [{att['command']}]" if att else ""),
                     (e["root_hash"] or "-")[:12], e["topology"] or "-", _changed(e["changed"]),
                     "; ".join(e["problems"]) or "ok"))
    blocks = [table(rows, ("folder", "iteration", "run", "parent", "root hash", "topology", "changed", "problems"),
                    f"Run {doc['run']} (latest: {doc['latest'] if doc['latest'] is not None else '-'})")]
    blocks.append("changed: w weights, M fp32 masters, m moments, s step counter, r RNG, d data position; "
                  "C changed, = unchanged, - not recorded")
    notes = sorted({n for e in doc["iterations"] for n in e["notes"] if e["complete"]}) + doc["notes"]
    blocks += [f"note: {n}" for n in notes]
    blocks += [f"problem: {p}" for p in doc["problems"]]
    bad = sum(bool(e["problems"]) for e in doc["iterations"]) + len(doc["problems"])
    blocks.append(f"{len(doc['iterations'])} iterations; " + (f"{bad} problem(s) found" if bad else "no problems"))
    return blocks


@handle_errors
def log_command(
    run: Annotated[object, typer.Argument(parser=checkpoint_arg("RUN"), show_default=False,
                                          help="Run folder holding iter_XXXXXXX folders, or s3://BUCKET/PREFIX.")],
    fmt: FormatOption = OutputFormat.table,
    session: Any = None,  # the command's (handle_errors): no option
) -> None:
    """Every iteration of a run in order: run id, parent, root hash, what changed, and stale or foreign ones."""
    from gtp_format.check.lineage import read_run

    with ExitStack() as stack:
        bar = lambda n: stack.enter_context(  # noqa: E731 - the bar opens once the folder is listed
            progress(n, "reading iterations", progress_enabled(fmt), unit="iterations"))
        log = read_run(run, total=bar, session=session)  # type: ignore[arg-type]
    doc = log.to_json()
    if fmt == OutputFormat.json:
        print_json(doc)
    else:
        print_blocks(*log_tables(doc))
    if log.failed:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command(name="log", epilog=EPILOG)(log_command)
