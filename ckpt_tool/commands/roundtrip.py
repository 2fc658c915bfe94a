"""``ckpt verify-roundtrip``: save, load in fresh processes, and prove nothing changed, bit for bit.

Options, one call into :mod:`ckpt_tool.roundtrip` (which starts the ranks and compares through
:mod:`gtp_format.compare`), and printing. With PATH the checkpoint passes ``ckpt verify``'s reader
and checks before any rank starts (see :mod:`ckpt_tool.roundtrip.resaved`).

Test-only: ``GTP_ROUNDTRIP_CORRUPT=<rank>`` (see :mod:`ckpt_tool.roundtrip.jobs`);
``GTP_ROUNDTRIP_TIMEOUT`` (seconds, default 300) is the gloo timeout of the spawned ranks.
"""

from __future__ import annotations

from enum import Enum
from typing import TYPE_CHECKING, Annotated, Any

import typer

from ckpt_tool.locations import checkpoint_arg
from ckpt_tool.output import (
    FormatOption,
    IgnoreOption,
    KeysOption,
    OutputFormat,
    fail,
    handle_errors,
    print_blocks,
    print_json,
    progress,
    progress_enabled,
    table,
)
from gtp_format.errors import EXIT_CHECK_FAILED

if TYPE_CHECKING:
    from ckpt_tool.roundtrip.rows import Outcome

EPILOG = (
    "Examples:\n\n"
    "  ckpt verify-roundtrip   (8 CPU ranks, tp1 cp2 gtp_remat2 dp2 folded: 3 steps, save, load, 2 more)\n\n"
    "  ckpt verify-roundtrip --cp 2 --gtp-remat 1 --dp 1 --layout safetensors --format json\n\n"
    "  ckpt verify-roundtrip --optimizer muon   (Muon momentum + AdamW state of the rest)\n\n"
    "  ckpt verify-roundtrip runs/gpt/checkpoints   (load with the manifest's topology, save, compare)\n\n"
    "  ckpt verify-roundtrip runs/gpt/checkpoints/iter_0000100 --dp 1   (reshard to DP=1 on the way)\n\n"
    "  ckpt verify-roundtrip s3://bucket/runs/gpt   (the ranks load from the bucket; the re-save stays local)\n\n"
    "  ckpt verify-roundtrip runs/gpt/checkpoints --keys 'decoder.*' --ignore '*.bias'   (compare part)\n\n"
    "Without PATH: trains --steps on local gloo ranks, saves into a temporary folder, loads it in fresh "
    "processes and compares every rank's optimizer slices (param, exp_avg, exp_avg_sq of every bucket) and "
    "model shards bit for bit with what that rank held at save time; then resumes --resume-steps and compares "
    "losses, grad norms and final state with an uninterrupted run.\n\n"
    "With PATH (a gtp_runtime checkpoint with gtp_manifest.json): first checks it as 'ckpt verify' does and "
    "refuses it, with verify's message, before any rank starts; then loads it on local ranks with the "
    "manifest's topology, model and bucket layout, saves it again into a temporary folder and compares every "
    "key's global shape, dtype, chunks and values bit for bit (--keys/--ignore: only the keys selected). "
    "PATH may be in a bucket (s3://): the ranks read it there through the same verified reader; the re-save "
    "goes to a local temporary folder. "
    "Chunks may differ only for optimizer keys when --dp changes (the DP slices move). Nothing is written "
    "next to PATH.\n\n"
    "Exit codes: 0 every check passed, 1 a difference was found, a rank failed or verify refused PATH, "
    "2 usage error or unreadable input."
)


class Optimizer(str, Enum):
    adam = "adam"
    muon = "muon"


class Layout(str, Enum):
    torch_dist = "torch_dist"
    safetensors = "safetensors"


def _compared(row: dict[str, Any]) -> str:
    if row["unit"] == "steps":
        return f"{row['elements']} steps"
    if row["unit"] in ("fields", "keys"):
        return f"{row['keys']} {row['unit']}"
    if row["unit"] == "chunks":
        return f"{row['keys']} keys, {row['elements']} chunks"
    return f"{row['keys']} {row['unit']}, {row['elements']} elements"


def _skipped(row: dict[str, Any]) -> bool:
    """A check that compared nothing (the selection has none of its keys) did not pass: it was skipped."""
    return row["unit"] != "steps" and row["ok"] and not row.get("keys") and not row.get("elements")


def _report(outcome: Outcome, fmt: OutputFormat) -> None:
    doc, rows, failed = outcome.doc, outcome.doc["checks"], outcome.failed
    for r in rows:
        r["skipped"] = _skipped(r)
    skipped = sum(r["skipped"] for r in rows)
    doc["skipped"] = skipped
    if fmt == OutputFormat.json:
        print_json(doc)
    else:
        body = [(r["check"], r["rank"], "skipped" if r["skipped"] else "ok" if r["ok"] else "DIFFERS",
                 "nothing selected" if r["skipped"] else _compared(r),
                 r["differing"] if r["unit"] not in ("fields", "keys", "chunks") else r["differing_keys"],
                 "-" if r["max_abs_diff"] is None else f"{r['max_abs_diff']:.6g}",
                 r["first_difference"] or r["expected"] or "-") for r in rows]
        secs = doc["seconds"]
        status = "OK" if not failed else "FAILED"
        print_blocks(outcome.title, table(body, ("check", "rank", "result", "compared", "differing", "max |diff|",
                                                 "first difference / note")),
                     f"{status}: {len(rows) - len(failed) - skipped} of {len(rows)} checks passed, bit-exact"
                     + (f", {skipped} skipped (--keys/--ignore selected none of their keys)" if skipped else "")
                     + " "
                     f"({secs['total']:.1f} s: " + ", ".join(f"{k} {v:.1f} s" for k, v in secs.items() if k != "total")
                     + ")")
    if failed:
        f = failed[0]
        where = f"{f['check']}" + (f" rank {f['rank']}" if f["rank"] != "all" else "")
        fail(f"round trip differs: {len(failed)} of {len(rows)} checks failed; first: {where}: "
             f"{f['first_difference']}", EXIT_CHECK_FAILED)


@handle_errors
def verify_roundtrip_command(
    path: Annotated[object, typer.Argument(  # a Location or None: Typer refuses Union annotations
        parser=checkpoint_arg("PATH"),
        help="A gtp_runtime checkpoint (iter_XXXXXXX or its parent; or s3://BUCKET/PREFIX) to load and save "
             "again. Without it, train on local ranks and round-trip that.", show_default=False)] = None,
    tp: Annotated[int | None, typer.Option("--tp", help="Tensor parallel size (default: 1).",
                                           show_default=False)] = None,
    cp: Annotated[int | None, typer.Option("--cp", help="Context parallel size (default: 2).",
                                           show_default=False)] = None,
    gtp_remat: Annotated[int | None, typer.Option("--gtp-remat", help="GTP_remat size (default: 2).",
                                                  show_default=False)] = None,
    dp: Annotated[int | None, typer.Option(
        "--dp", help="Replicate degree (default: 2, or --nproc/(tp*cp*gtp_remat)). With PATH: load at this DP "
                     "instead of the saved one (dp_reshardable reshards over DP).", show_default=False)] = None,
    fold_cp: Annotated[bool | None, typer.Option(
        "--fold-cp/--no-fold-cp", help="Shard dense weights over cp x gtp_remat (default: fold).",
        show_default=False)] = None,
    nproc: Annotated[int | None, typer.Option(
        "--nproc", min=1, help="Ranks to spawn (default: tp*cp*gtp_remat*dp).", show_default=False)] = None,
    layout: Annotated[Layout | None, typer.Option(
        "--layout", help="Checkpoint layout to save (default: torch_dist; with PATH: the source's).",
        show_default=False)] = None,
    steps: Annotated[int | None, typer.Option(
        "--steps", min=1, help="Steps before the save (default: 3).", show_default=False)] = None,
    resume_steps: Annotated[int | None, typer.Option(
        "--resume-steps", min=1, help="Steps after the load, compared with an uninterrupted run (default: 2).",
        show_default=False)] = None,
    bucket_size: Annotated[int | None, typer.Option(
        "--bucket-size", min=1, help="Elements per gradient bucket; small, so buffers have several buckets "
                                     "(default: 10000).", show_default=False)] = None,
    optimizer: Annotated[Optimizer | None, typer.Option(
        "--optimizer", help="adam (AdamW everywhere) or muon (Muon for the linears, AdamW for the rest) "
                            "(default: adam; with PATH: the checkpoint's).", show_default=False)] = None,
    keys: KeysOption = None,
    ignore: IgnoreOption = None,
    fmt: FormatOption = OutputFormat.table,
    session: Any = None,  # the command's (handle_errors): no option
) -> None:
    """Save, load in fresh processes and compare bit for bit; exit 1 on any difference."""
    from ckpt_tool.roundtrip import resaved, training
    from gtp_format.compare import KeyFilter
    from gtp_format.layout.config import ConfigError

    def bar(total: int, description: str, unit: str = "steps") -> Any:
        return progress(total, description, progress_enabled(fmt), unit)

    lay = layout.value if layout is not None else None
    if path is not None:
        given = [flag for flag, v in (("--tp", tp), ("--cp", cp), ("--gtp-remat", gtp_remat), ("--nproc", nproc),
                                      ("--fold-cp/--no-fold-cp", fold_cp), ("--steps", steps),
                                      ("--resume-steps", resume_steps), ("--bucket-size", bucket_size),
                                      ("--optimizer", optimizer))
                 if v is not None]
        if given:
            fail(f"{', '.join(given)} cannot be used with PATH: the topology, model and buckets come from the "
                 "checkpoint's manifest (only --dp, --layout, --keys, --ignore and --format apply); drop them")
        _report(resaved.run(path, dp, lay, KeyFilter.of(keys, ignore), bar, session), fmt)  # type: ignore[arg-type]
        return
    if keys or ignore:
        fail("--keys and --ignore select checkpoint keys and need PATH; without PATH every rank's whole state is "
             "compared; drop them")
    try:
        cfg, world = training.train_config(tp, cp, gtp_remat, dp, fold_cp, nproc,
                                           bucket_size or training.SELF_TEST_BUCKET_SIZE,
                                           optimizer.value if optimizer is not None else "adam")
    except ConfigError as e:
        hint = " (verify-roundtrip folds by default: pass --no-fold-cp)" if fold_cp is None and "fold" in str(e) else ""
        fail(f"{e}{hint}")
    _report(training.run(cfg, world, lay or Layout.torch_dist.value, steps or training.DEFAULT_STEPS,
                         resume_steps or training.DEFAULT_RESUME_STEPS, bar), fmt)


def register(app: typer.Typer) -> None:
    app.command(name="verify-roundtrip", epilog=EPILOG)(verify_roundtrip_command)
