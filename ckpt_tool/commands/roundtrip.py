"""``ckpt verify-roundtrip``: save, load in fresh processes, and prove nothing changed, bit for bit.

Without PATH it trains a small model on local gloo ranks, saves, loads the checkpoint in a new set
of processes (a new process group) and compares what every rank got back with what it held at
save time, then resumes and compares with an uninterrupted run. With PATH it loads an existing
gtp_runtime checkpoint with the topology of its manifest, saves it again and compares the two
checkpoints key by key through the ``ckpt`` reader.

PATH is opened with the ``ckpt`` reader first (``.metadata`` through the allow-list) and refused
on any error before a rank starts, so the ranks' DCP loader, which unpickles ``.metadata``, only
ever sees one that passed the allow-list.

The distributed work is :mod:`gtp_runtime.roundtrip` (it runs on initialised ranks);
:mod:`gtp_runtime.launch` starts and watches the processes.

Test-only: ``GTP_ROUNDTRIP_CORRUPT=<rank>`` adds 1.0 to one real (non-padding) optimizer element
of that rank right after the load, so that tests can prove a difference is found and named.
``GTP_ROUNDTRIP_TIMEOUT`` (seconds, default 300) is the gloo timeout of the spawned ranks.
"""

from __future__ import annotations

import os
import tempfile
import time
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from ckpt_tool.output import (
    FormatOption,
    OutputFormat,
    fail,
    handle_errors,
    print_blocks,
    print_json,
    progress,
    progress_enabled,
    table,
)
from gtp_format.errors import EXIT_BAD_INPUT, EXIT_CHECK_FAILED

if TYPE_CHECKING:
    from gtp_format.model import Checkpoint, Entry
    from gtp_runtime.training import TrainConfig, Trainer

CORRUPT_ENV = "GTP_ROUNDTRIP_CORRUPT"
DEFAULT_STEPS = 3
DEFAULT_RESUME_STEPS = 2
DEFAULT_BUCKET_SIZE = 10_000
DEFAULT_TOPOLOGY = {"tp": 1, "cp": 2, "gtp_remat": 2, "dp": 2}

EPILOG = (
    "Examples:\n\n"
    "  ckpt verify-roundtrip   (8 CPU ranks, tp1 cp2 gtp_remat2 dp2 folded: 3 steps, save, load, 2 more)\n\n"
    "  ckpt verify-roundtrip --cp 2 --gtp-remat 1 --dp 1 --layout safetensors --format json\n\n"
    "  ckpt verify-roundtrip runs/gpt/checkpoints   (load with the manifest's topology, save, compare)\n\n"
    "  ckpt verify-roundtrip runs/gpt/checkpoints/iter_0000100 --dp 1   (reshard to DP=1 on the way)\n\n"
    "Without PATH: trains --steps on local gloo ranks, saves into a temporary folder, loads it in fresh "
    "processes and compares every rank's optimizer slices (param, exp_avg, exp_avg_sq of every bucket) and "
    "model shards bit for bit with what that rank held at save time; then resumes --resume-steps and compares "
    "losses, grad norms and final state with an uninterrupted run.\n\n"
    "With PATH (a gtp_runtime checkpoint with gtp_manifest.json): loads it on local ranks with the manifest's "
    "topology, model and bucket layout, saves it again into a temporary folder and compares every key's global "
    "shape, dtype, chunks and values bit for bit. Chunks may differ only for optimizer keys when --dp changes "
    "(the DP slices move). Nothing is written next to PATH.\n\n"
    "Exit codes: 0 every check passed, 1 a difference was found (or a rank failed), 2 usage error or "
    "unreadable input."
)


class Layout(str, Enum):
    torch_dist = "torch_dist"
    safetensors = "safetensors"


# -- what the spawned ranks run (module level: spawn pickles them by name) -------------------------


def _corrupt_after_load(trainer: Trainer) -> None:
    """The test-only corruption of ``GTP_ROUNDTRIP_CORRUPT=<rank>`` (see the module docstring)."""
    import torch.distributed as dist

    from gtp_runtime.roundtrip import first_param_element

    spec = os.environ.get(CORRUPT_ENV, "")
    if spec.strip().isdigit() and int(spec) == dist.get_rank():
        _, tensor, index = first_param_element(trainer)
        tensor[index] += 1.0


def _save_job(cfg: TrainConfig, root: str, dump_dir: str, steps: int, more: int, layout: str) -> str:
    from gtp_runtime.roundtrip import save_phase
    from gtp_runtime.training import Trainer

    return str(save_phase(Trainer(cfg), root, steps, more, layout, dump_dir))


def _resume_job(cfg: TrainConfig, root: str, dump_dir: str) -> dict[str, Any]:
    from gtp_runtime.roundtrip import resume_phase
    from gtp_runtime.training import Trainer

    return resume_phase(Trainer(cfg), root, dump_dir, after_load=_corrupt_after_load)


def _resave_job(cfg: TrainConfig, src: str, root: str, layout: str) -> str:
    from gtp_runtime.roundtrip import resave
    from gtp_runtime.training import Trainer

    return str(resave(Trainer(cfg), src, root, layout, after_load=_corrupt_after_load))


# -- rows -------------------------------------------------------------------------------------------


def _row(check: str, rank: int | str, summaries: list[tuple[int | None, dict[str, Any]]], unit: str = "tensors",
         expected: str = "") -> dict[str, Any]:
    """One check from one or more :class:`gtp_runtime.roundtrip.DiffSummary` dicts (rank, summary)."""
    keys = sum(s["keys"] for _, s in summaries)
    elements = sum(s["elements"] for _, s in summaries)
    differing = sum(s["differing"] for _, s in summaries)
    maxes = [s["max_abs_diff"] for _, s in summaries if s["max_abs_diff"] is not None]
    diffs = [(r, d) for r, s in summaries for d in s["diffs"]]
    first = None
    if diffs:
        r, d = diffs[0]
        where = f"rank {r}: " if r is not None and rank == "all" else ""
        what = d["problem"]
        if what == "values":
            what = f"{d['differing']} of {d['numel']} elements differ"
            what += f", first at index {d['first_index']}" if d.get("first_index") is not None else ""
        if what == "manifest":
            first = f"{where}{d['detail']}"
        else:
            first = f"{where}{d['key']}: {what}" + (f" ({d['detail']})" if d["detail"] else "")
    return {"check": check, "rank": rank, "ok": not diffs, "keys": keys, "elements": elements, "unit": unit,
            "differing_keys": len(diffs), "differing": differing, "max_abs_diff": max(maxes) if maxes else None,
            "first_difference": first, "expected": expected,
            "differences": [{"rank": r, **d} for r, d in diffs][:50]}


def _compared(row: dict[str, Any]) -> str:
    if row["unit"] == "steps":
        return f"{row['elements']} steps"
    if row["unit"] in ("fields", "keys"):
        return f"{row['keys']} {row['unit']}"
    if row["unit"] == "chunks":
        return f"{row['keys']} keys, {row['elements']} chunks"
    return f"{row['keys']} {row['unit']}, {row['elements']} elements"


def _report(doc: dict[str, Any], fmt: OutputFormat, title: str) -> None:
    rows = doc["checks"]
    failed = [r for r in rows if not r["ok"]]
    if fmt == OutputFormat.json:
        print_json(doc)
    else:
        body = [(r["check"], r["rank"], "ok" if r["ok"] else "DIFFERS", _compared(r),
                 r["differing"] if r["unit"] not in ("fields", "keys", "chunks") else r["differing_keys"],
                 "-" if r["max_abs_diff"] is None else f"{r['max_abs_diff']:.6g}",
                 r["first_difference"] or r["expected"] or "-") for r in rows]
        secs = doc["seconds"]
        status = "OK" if not failed else "FAILED"
        print_blocks(title, table(body, ("check", "rank", "result", "compared", "differing", "max |diff|",
                                         "first difference / note")),
                     f"{status}: {len(rows) - len(failed)} of {len(rows)} checks passed, bit-exact "
                     f"({secs['total']:.1f} s: " + ", ".join(f"{k} {v:.1f} s" for k, v in secs.items() if k != "total")
                     + ")")
    if failed:
        f = failed[0]
        where = f"{f['check']}" + (f" rank {f['rank']}" if f["rank"] != "all" else "")
        fail(f"round trip differs: {len(failed)} of {len(rows)} checks failed; first: {where}: "
             f"{f['first_difference']}", EXIT_CHECK_FAILED)


# -- without PATH: train, save, load fresh, resume ---------------------------------------------------


def _train_config(tp: int | None, cp: int | None, gtp_remat: int | None, dp: int | None, fold_cp: bool | None,
                  nproc: int | None, bucket_size: int) -> tuple[TrainConfig, int]:
    """The launcher's config (its model defaults and its checks) for the given sizes."""
    from gtp_runtime.train import build_parser, resolve

    sizes = {"tp": tp, "cp": cp, "gtp_remat": gtp_remat}
    sizes = {k: DEFAULT_TOPOLOGY[k] if v is None else v for k, v in sizes.items()}
    if dp is None and nproc is None:
        dp = DEFAULT_TOPOLOGY["dp"]
    argv = [f"--{k.replace('_', '-')}={v}" for k, v in sizes.items()] + [f"--bucket-size={bucket_size}"]
    argv += [f"--dp={dp}"] if dp is not None else []
    argv += ["--fold-cp"] if fold_cp is None or fold_cp else []
    args = build_parser().parse_args(argv)
    return resolve(args, nproc)


def _train_mode(cfg: TrainConfig, world: int, layout: str, steps: int, more: int, fmt: OutputFormat) -> None:
    from gtp_runtime.launch import RankFailure, run_local_ranks

    seconds: dict[str, float] = {}
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ckpt-roundtrip-") as tmp, \
            progress(2, "round trip", progress_enabled(fmt)) as advance:
        root, dump = os.path.join(tmp, "checkpoints"), os.path.join(tmp, "dump")
        os.makedirs(dump)
        phase = "training and saving"
        try:
            t0 = time.perf_counter()
            run_local_ranks(world, _save_job, (cfg, root, dump, steps, more, layout), tmp, "save")
            seconds["train+save"] = time.perf_counter() - t0
            advance(1)
            phase = "loading in fresh processes and resuming"
            t0 = time.perf_counter()
            reports = run_local_ranks(world, _resume_job, (cfg, root, dump), tmp, "resume")
            seconds["load+resume"] = time.perf_counter() - t0
            advance(1)
        except RankFailure as e:
            fail(f"round trip failed while {phase} ({cfg.par.describe()}, {world} ranks): {e}", EXIT_CHECK_FAILED)
    seconds["total"] = time.perf_counter() - t_start
    reports.sort(key=lambda r: r["rank"])
    checks = [_row("optimizer state after load", r["rank"], [(r["rank"], r["loaded"]["optimizer"])])
              for r in reports]
    checks += [_row("model params after load", r["rank"], [(r["rank"], r["loaded"]["model"])]) for r in reports]
    checks.append(_row("resume losses", 0, [(0, reports[0]["resume"]["losses"])], "steps"))
    checks.append(_row("resume grad norms", 0, [(0, reports[0]["resume"]["grad_norms"])], "steps"))
    checks.append(_row("resume params", "all", [(r["rank"], r["resume"]["model"]) for r in reports]))
    checks.append(_row("resume optimizer state", "all", [(r["rank"], r["resume"]["optimizer"]) for r in reports]))
    doc = {
        "mode": "train", "ok": all(c["ok"] for c in checks),
        "config": {"parallel": cfg.par.to_dict(), "world_size": world, "layout": layout, "steps": steps,
                   "resume_steps": more, "bucket_size": cfg.bucket_size, "micro_batch": cfg.micro_batch,
                   "param_dtype": str(cfg.param_dtype), "model": cfg.model.to_dict()},
        "passed": sum(c["ok"] for c in checks), "failed": sum(not c["ok"] for c in checks),
        "resume_losses": reports[0]["losses"], "checks": checks,
        "seconds": {k: round(v, 3) for k, v in seconds.items()},
    }
    _report(doc, fmt, f"verify-roundtrip: {cfg.par.describe()} on {world} ranks, {layout}, {steps} steps, save, "
                      f"load in fresh processes, {more} more steps")


# -- with PATH: load with the manifest's topology, save again, compare key by key -------------------

_DP_DEPENDENT_TOPOLOGY = ("dp", "world_size", "expert_dp")
_DP_DEPENDENT_BUFFER = ("dp_size", "grad_divisor")


def _manifest_view(m: dict[str, Any], dp_changed: bool, bucket_size: bool) -> dict[str, Any]:
    """The manifest fields a round trip must preserve (DP-dependent ones dropped when DP changes;
    ``bucket_size`` only when the source recorded it: older writers did not)."""
    view = {k: m.get(k) for k in ("format", "optimizer_sharding", "iteration", "topology", "model", "param_dtype",
                                  "optimizer", "buffers")}
    if dp_changed:
        view["topology"] = {k: v for k, v in (view["topology"] or {}).items() if k not in _DP_DEPENDENT_TOPOLOGY}
        bufs = []
        for b in view["buffers"] or []:
            b = {k: v for k, v in b.items() if k not in _DP_DEPENDENT_BUFFER}
            b["buckets"] = [{k: v for k, v in x.items() if k != "numel"} for x in b.get("buckets", [])]
            bufs.append(b)
        view["buffers"] = bufs
    if bucket_size:
        view["bucket_size"] = m.get("bucket_size")
    return view


def _dict_diffs(a: Any, b: Any, path: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in list(a) + [k for k in b if k not in a]:
            if k not in b or k not in a:
                out.append(f"{path}{k}: only in {'source' if k in a else 're-saved'}")
            else:
                out.extend(_dict_diffs(a[k], b[k], f"{path}{k}."))
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _dict_diffs(x, y, f"{path}{i}.")]
    return [] if a == b else [f"{path.rstrip('.')}: {a!r} vs {b!r}"]


def _value_diff(ca: Checkpoint, ea: Entry, cb: Checkpoint, eb: Entry) -> tuple[int, float | None, int | None]:
    """Bitwise difference of one key's whole global tensor (chunk by chunk where the boxes agree)."""
    from ckpt_tool.output import DEFAULT_MAX_BYTES
    from ckpt_tool.tensors import assemble
    from gtp_format.reader.chunks import load_chunk
    from gtp_runtime.roundtrip import bitwise_diff

    boxes_b = {(c.offsets, c.sizes): c for c in eb.chunks}
    if sorted(boxes_b) == sorted((c.offsets, c.sizes) for c in ea.chunks):
        count, max_abs, first = 0, None, None
        for c in ea.chunks:
            n, m, f = bitwise_diff(load_chunk(ca, ea, c), load_chunk(cb, eb, boxes_b[(c.offsets, c.sizes)]))
            count += n
            if m is not None:
                max_abs = max(max_abs or 0.0, m)
            if first is None and f is not None and len(c.offsets) == 1:
                first = c.offsets[0] + f
        return count, max_abs, first
    rows = ea.shape[0] if ea.shape else 0
    return bitwise_diff(assemble(ca, ea, 0, rows, DEFAULT_MAX_BYTES).tensor,
                        assemble(cb, eb, 0, rows, DEFAULT_MAX_BYTES).tensor)


def _summary() -> dict[str, Any]:
    return {"keys": 0, "elements": 0, "differing": 0, "max_abs_diff": None, "diffs": []}


def _note(s: dict[str, Any], numel: int, diff: dict[str, Any] | None) -> None:
    s["keys"] += 1
    s["elements"] += numel
    if diff is not None:
        s["diffs"].append(diff)
        s["differing"] += diff["differing"]
        if diff.get("max_abs_diff") is not None:
            s["max_abs_diff"] = max(s["max_abs_diff"] or 0.0, diff["max_abs_diff"])


def _diff(key: str, problem: str, numel: int = 0, differing: int = 0, max_abs: float | None = None,
          detail: str = "") -> dict[str, Any]:
    return {"key": key, "problem": problem, "numel": numel, "differing": differing, "max_abs_diff": max_abs,
            "first_index": None, "detail": detail}


def _compare_checkpoints(ca: Checkpoint, cb: Checkpoint, dp_changed: bool, advance: Any) -> list[dict[str, Any]]:
    from gtp_format.check.analysis import BUCKET_NUMEL, MODEL, OPTIMIZER, classify_all
    from gtp_format.model import BYTES
    from gtp_format.reader.chunks import chunk_bytes

    classes = classify_all(ca)
    manifest = _summary()
    recorded = ca.manifest is not None and ca.manifest.bucket_size is not None
    view_a = _manifest_view(ca.manifest.to_json() if ca.manifest else {}, dp_changed, recorded)
    view_b = _manifest_view(cb.manifest.to_json() if cb.manifest else {}, dp_changed, recorded)
    for d in _dict_diffs(view_a, view_b):
        _note(manifest, 0, _diff(d.split(":")[0], "manifest", detail=d))
    manifest["keys"] = len(view_a)
    keyset, meta, chunks = _summary(), _summary(), _summary()
    values = {MODEL: _summary(), OPTIMIZER: _summary(), BUCKET_NUMEL: _summary(), "other": _summary()}
    expected_chunks = 0
    for key in sorted(ca.entries.keys() | cb.entries.keys()):
        ea, eb = ca.entries.get(key), cb.entries.get(key)
        if ea is None or eb is None:
            _note(keyset, 0, _diff(key, "missing" if eb is None else "unexpected",
                                   detail="only in the source" if eb is None else "only in the re-saved copy"))
            continue
        _note(keyset, 0, None)
        if ea.kind != eb.kind or ea.shape != eb.shape or ea.dtype != eb.dtype:
            _note(meta, ea.numel, _diff(key, "shape/dtype", ea.numel, ea.numel,
                                        detail=f"{ea.kind} {ea.shape} {ea.dtype} vs {eb.kind} {eb.shape} {eb.dtype}"))
            continue
        _note(meta, ea.numel, None)
        category = classes[key].category
        same_boxes = sorted((c.offsets, c.sizes) for c in ea.chunks) == sorted((c.offsets, c.sizes) for c in eb.chunks)
        if same_boxes:
            _note(chunks, len(ea.chunks), None)
        elif dp_changed and category == OPTIMIZER:
            _note(chunks, len(ea.chunks), None)
            expected_chunks += 1
        else:
            _note(chunks, len(ea.chunks), _diff(key, "chunks", len(ea.chunks), len(ea.chunks),
                                                detail=f"{len(ea.chunks)} vs {len(eb.chunks)} chunks, boxes differ"))
        target = values.get(category, values["other"])
        if ea.kind == BYTES:
            same = chunk_bytes(ca, ea, ea.chunks[0]) == chunk_bytes(cb, eb, eb.chunks[0])
            _note(target, 1, None if same else _diff(key, "values", 1, 1, detail="stored bytes differ"))
        else:
            count, max_abs, first = _value_diff(ca, ea, cb, eb)
            padded_numel = category == BUCKET_NUMEL and not key.endswith("_unpadded")
            if count and dp_changed and padded_numel:
                count = 0  # bucket padding follows lcm(DP, 64): padded sizes may change with DP
            d = _diff(key, "values", ea.numel, count, max_abs) if count else None
            if d is not None:
                d["first_index"] = first
            _note(target, ea.numel, d)
        advance(1)
    note = f"{expected_chunks} optimizer keys re-cut for the new DP (expected)" if expected_chunks else ""
    rows = [
        _row("manifest", "all", [(None, manifest)], "fields"),
        _row("key set", "all", [(None, keyset)], "keys"),
        _row("global shape and dtype", "all", [(None, meta)]),
        _row("chunk layout", "all", [(None, chunks)], "chunks", expected=note),
        _row("model weights", "all", [(None, values[MODEL])]),
        _row("optimizer state", "all", [(None, values[OPTIMIZER])]),
        _row("per_bucket_numel", "all", [(None, values[BUCKET_NUMEL])]),
    ]
    if values["other"]["keys"]:
        rows.append(_row("other keys", "all", [(None, values["other"])]))
    return rows


def _path_mode(path: Path, dp: int | None, layout: str | None, fmt: OutputFormat) -> None:
    from gtp_format.errors import FormatError
    from gtp_format.layout.config import ConfigError
    from gtp_format.manifest import read_manifest
    from gtp_format.names import MANIFEST_FILE
    from gtp_format.reader.checkpoint import open_checkpoint
    from gtp_runtime.launch import RankFailure, run_local_ranks
    from gtp_runtime.roundtrip import config_from_manifest

    t_start = time.perf_counter()
    src = open_checkpoint(path)
    if src.manifest is None:
        raise FormatError(f"{src.root} has no {MANIFEST_FILE}: verify-roundtrip needs the manifest's topology, model "
                        "and bucket layout to load a checkpoint; only gtp_runtime checkpoints can be round-tripped "
                        "(run it without PATH to test the runtime itself)")
    try:
        cfg = config_from_manifest(read_manifest(src.root, strict=True), dp)
    except ConfigError as e:
        raise FormatError(f"{src.root / MANIFEST_FILE}: {e}") from None
    world = cfg.par.world_size
    saved_dp = src.manifest.topology.dp if src.manifest.topology else None
    layout = layout or src.layout
    seconds: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="ckpt-roundtrip-") as tmp, \
            progress(1 + len(src.entries), "round trip", progress_enabled(fmt)) as advance:
        out = os.path.join(tmp, "resaved")
        t0 = time.perf_counter()
        try:
            folder = run_local_ranks(world, _resave_job, (cfg, str(src.root), out, layout), tmp, "resave")[0]
        except RankFailure as e:
            code = EXIT_BAD_INPUT if e.clean else EXIT_CHECK_FAILED
            fail(f"loading {src.root} on {world} ranks ({cfg.par.describe()}) and saving it again failed: {e}", code)
        seconds["load+save"] = time.perf_counter() - t0
        advance(1)
        t0 = time.perf_counter()
        new = open_checkpoint(folder)
        checks = _compare_checkpoints(src, new, cfg.par.dp != saved_dp, advance)
        seconds["compare"] = time.perf_counter() - t0
    seconds["total"] = time.perf_counter() - t_start
    doc = {
        "mode": "path", "path": str(src.root), "ok": all(c["ok"] for c in checks),
        "config": {"parallel": cfg.par.to_dict(), "world_size": world, "saved_dp": saved_dp,
                   "layout": {"source": src.layout, "resaved": layout}, "bucket_size": cfg.bucket_size,
                   "bucket_size_recorded": src.manifest.bucket_size is not None,
                   "param_dtype": str(cfg.param_dtype), "iteration": src.iteration},
        "passed": sum(c["ok"] for c in checks), "failed": sum(not c["ok"] for c in checks),
        "checks": checks, "seconds": {k: round(v, 3) for k, v in seconds.items()},
    }
    reshard = f", DP {saved_dp} -> {cfg.par.dp}" if cfg.par.dp != saved_dp else ""
    _report(doc, fmt, f"verify-roundtrip {src.root}: loaded on {world} ranks ({cfg.par.describe()}{reshard}), "
                      f"saved again as {layout}, compared key by key")


# -- the command ------------------------------------------------------------------------------------


@handle_errors
def verify_roundtrip_command(
    path: Annotated[Path | None, typer.Argument(
        help="A gtp_runtime checkpoint (iter_XXXXXXX or its parent) to load and save again. Without it, "
             "train on local ranks and round-trip that.", show_default=False)] = None,
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
        "--steps", min=1, help=f"Steps before the save (default: {DEFAULT_STEPS}).", show_default=False)] = None,
    resume_steps: Annotated[int | None, typer.Option(
        "--resume-steps", min=1, help=f"Steps after the load, compared with an uninterrupted run "
                                      f"(default: {DEFAULT_RESUME_STEPS}).", show_default=False)] = None,
    bucket_size: Annotated[int | None, typer.Option(
        "--bucket-size", min=1, help=f"Elements per gradient bucket; small, so buffers have several buckets "
                                     f"(default: {DEFAULT_BUCKET_SIZE}).", show_default=False)] = None,
    fmt: FormatOption = OutputFormat.table,
) -> None:
    """Save, load in fresh processes and compare bit for bit; exit 1 on any difference."""
    from gtp_format.layout.config import ConfigError

    lay = layout.value if layout is not None else None
    if path is not None:
        given = [flag for flag, v in (("--tp", tp), ("--cp", cp), ("--gtp-remat", gtp_remat), ("--nproc", nproc),
                                      ("--fold-cp/--no-fold-cp", fold_cp), ("--steps", steps),
                                      ("--resume-steps", resume_steps), ("--bucket-size", bucket_size))
                 if v is not None]
        if given:
            fail(f"{', '.join(given)} cannot be used with PATH: the topology, model and buckets come from the "
                 "checkpoint's manifest (only --dp, --layout and --format apply); drop them")
        _path_mode(path, dp, lay, fmt)
        return
    try:
        cfg, world = _train_config(tp, cp, gtp_remat, dp, fold_cp, nproc, bucket_size or DEFAULT_BUCKET_SIZE)
    except ConfigError as e:
        hint = " (verify-roundtrip folds by default: pass --no-fold-cp)" if fold_cp is None and "fold" in str(e) else ""
        fail(f"{e}{hint}")
    _train_mode(cfg, world, lay or Layout.torch_dist.value, steps or DEFAULT_STEPS,
                resume_steps or DEFAULT_RESUME_STEPS, fmt)


def register(app: typer.Typer) -> None:
    app.command(name="verify-roundtrip", epilog=EPILOG)(verify_roundtrip_command)
