"""``ckpt inspect``: what a checkpoint holds, from its metadata alone.

Inspecting is what people do first with a checkpoint they do not trust, so it must be cheap and
safe: it parses ``.metadata`` through the allow-list and reads no tensor data (only ``stat``), which
keeps it fast on multi-TB checkpoints too. The one exception is a genuine megatron-core checkpoint's
``common_state`` byte object (about 2 KiB, at most 1 MiB read), decoded as inert records for the
parallel sizes and optimizer format megatron recorded there (:mod:`gtp_format.megatron_topology`).
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Any

import typer

from ckpt_tool.locations import checkpoint_arg
from ckpt_tool.output import (
    FormatOption,
    IgnoreOption,
    KeysOption,
    OutputFormat,
    fmt_bytes,
    fmt_shape,
    handle_errors,
    print_blocks,
    print_json,
    table,
)
from gtp_format.storage.location import ObjectURL

EPILOG = """Examples:

  ckpt inspect runs/gpt/checkpoints   (follows latest_checkpointed_iteration.txt)

  ckpt inspect runs/gpt/checkpoints/iter_0000100 --keys 'optimizer.*exp_avg*'

  ckpt inspect CKPT --chunks --format json

  ckpt inspect CKPT --params   (each parameter's bucket, offset, ranks and CP ranks)

  ckpt inspect CKPT --stats   (NaN/Inf/zeros, min, max, RMS per key, recorded at save; --format json: per chunk)

Exit codes: 0 ok, 2 unreadable input."""


def _words(value: Any) -> str:
    """Any JSON value as words: ``k v, k v`` for an object, ``a, b`` for a list (no Python reprs)."""
    if isinstance(value, dict):
        return ", ".join(f"{str(k).replace('_', ' ')} {_words(v)}" for k, v in value.items())
    if isinstance(value, list):
        return ", ".join(_words(v) for v in value)
    return "-" if value is None else str(value)


def data_position_words(position: Any) -> str:
    """The manifest's data position as a sentence: samples consumed, of which data, where it was."""
    if not isinstance(position, dict):
        return _words(position)
    rest = dict(position)
    consumed = rest.pop("consumed_train_samples", None)
    path = rest.pop("path", None)
    data = rest.pop("dataset", None)
    parts = [f"{consumed} samples consumed" if consumed is not None else "samples consumed not recorded"]
    if isinstance(data, dict):
        d = dict(data)
        name = d.pop("name", "?")
        sizes = ", ".join(f"{d.pop(k)} {k}" for k in ("documents", "tokens", "sequences") if k in d)
        parts.append(f"of {name}" + (f" ({sizes})" if sizes else "") + (f", {_words(d)}" if d else ""))
    elif data is not None:
        parts.append(f"of {_words(data)}")
    parts.append(f"read from {path}" if path else "read from the default corpus (no --data-path)")
    if rest:
        parts.append(_words(rest))
    return "; ".join(parts)


def _dtype(d: Any) -> str:
    return str(d).removeprefix("torch.") if d is not None else "-"


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
) -> None:
    """Show format, topology, keys and aliasing status of a checkpoint (metadata only)."""
    from gtp_format.check.analysis import (
        BUCKET_NUMEL,
        FULL_STATE_PREFIX,
        MODEL,
        OPTIMIZER,
        aliasing,
        classify_all,
        topology_view,
    )
    from gtp_format.compare import KeyFilter
    from gtp_format.model import BYTES, TENSOR
    from gtp_format.names import DATA_POSITION_KEY, SCHEDULER_KEY, STATES
    from gtp_format.reader.checkpoint import open_checkpoint

    ckpt = open_checkpoint(path)
    classes = classify_all(ckpt)
    topo = topology_view(ckpt.manifest, cp_size, ckpt=ckpt, folded=folded)
    run_extra = ckpt.manifest.extra if ckpt.manifest is not None else {}  # run state: extra manifest fields
    alias = aliasing(ckpt, classes, topo)
    alias_state = {a.key: ("ALIASED" if a.severity == "error" else "aliased?") for a in alias.aliased}
    select = KeyFilter.of(keys, ignore)
    selected = [k for k in ckpt.entries if select(k)]

    weights, optimizer, opt_state, objects, chunk_rows = [], [], [], [], []
    for key in selected:
        e, cls = ckpt.entries[key], classes[key]
        if cls.category == MODEL and key.startswith(FULL_STATE_PREFIX):  # fully_reshardable: not a model weight
            opt_state.append({"key": key, "shape": e.shape, "dtype": str(e.dtype), "chunks": len(e.chunks)})
        elif cls.category == MODEL:
            weights.append({"key": key, "shape": e.shape, "dtype": str(e.dtype), "chunks": len(e.chunks)})
        elif cls.category == OPTIMIZER and cls.opt is not None:
            o = cls.opt
            optimizer.append({
                "key": key, "dp_group_idx": o.dp_group_idx, "gbuf_idx": o.gbuf_idx, "dtype": o.dtype,
                "bucket_idx": o.bucket_idx, "state": o.state, "cp_rank": o.cp_rank, "cp_form": o.cp_form,
                "folded": o.cp_rank is not None,
                "aliasing": alias_state.get(key, "ok" if o.cp_rank is not None else "-"),
                "shape": e.shape, "tensor_dtype": str(e.dtype), "chunks": len(e.chunks),
            })
        else:
            objects.append({"key": key, "kind": e.kind, "category": cls.category,
                            "shape": e.shape, "dtype": str(e.dtype) if e.dtype else None, "bytes": e.stored_bytes})
        if chunks:
            for c in e.chunks:
                ref = c.storage
                chunk_rows.append({"key": key, "chunk": c.index, "offsets": c.offsets, "sizes": c.sizes,
                                   "file": ref.file if ref else None, "byte_offset": ref.offset if ref else None,
                                   "length": ref.length if ref else None})
    state_order = {s: i for i, s in enumerate(STATES)}
    optimizer.sort(key=lambda r: (r["dp_group_idx"], r["gbuf_idx"], r["dtype"], r["bucket_idx"],
                                  state_order.get(r["state"], len(STATES)), r["state"], r["cp_rank"] or -1))
    counts = {
        "keys": len(ckpt.entries),
        "tensors": sum(e.kind == TENSOR for e in ckpt.entries.values()),
        "byte_objects": sum(e.kind == BYTES for e in ckpt.entries.values()),
        "chunks": ckpt.chunk_count(),
        "stored_bytes": sum(e.stored_bytes for e in ckpt.entries.values()),
        "data_files": len(ckpt.data_files),
        "data_file_bytes": sum(ckpt.data_files.values()),
        "per_bucket_numel_objects": sum(c.category == BUCKET_NUMEL for c in classes.values()),
    }
    if not select.everything:
        counts["matching_keys"] = len(selected)
    doc = {
        "path": str(ckpt.root), "layout": ckpt.layout, "backend": ckpt.backend, "dcp_version": ckpt.dcp_version,
        "iteration": ckpt.iteration, "topology": topo.describe(),
        "parallel_config": topo.par.to_dict() if topo.par else None,
        "manifest": ckpt.manifest is not None, "megatron_metadata": ckpt.megatron_metadata,
        "optimizer_format": _optimizer_format(ckpt, topo),
        "megatron_topology": topo.megatron.to_dict() if topo.megatron is not None else None,
        "counts": counts,
        # Run state (gtp manifests only): the lr schedule under Megatron's name and the data position.
        "opt_param_scheduler": run_extra.get(SCHEDULER_KEY),
        "data_position": run_extra.get(DATA_POSITION_KEY),
        "aliasing": {"status": alias.status, "message": alias.message,
                     "keys": [{"key": a.key, "severity": a.severity, "reason": a.reason, "kept": a.kept_summary(),
                               "survivors": [asdict(s) for s in a.survivors]} for a in alias.aliased]},
        "optimizer_info": _optimizer_info(ckpt.manifest),
        "weights": weights, "optimizer": optimizer, "optimizer_state": opt_state, "objects": objects,
        "notes": [p.to_dict() for p in ckpt.notes + topo.notes],
    }
    # a bucket has no work folders: its writer's commit is the object written last (docs/object-stores.md)
    doc["leftovers"] = [] if isinstance(ckpt.root, ObjectURL) else _leftovers(Path(path), ckpt.root)
    _integrity(doc, ckpt, set(selected), stats)
    if chunks:
        doc["chunks"] = chunk_rows
    if params:
        from gtp_format.params import describe, param_views_of

        doc["params"] = describe(param_views_of(ckpt))
        opt = ckpt.manifest.optimizer if ckpt.manifest is not None else None
        for r in doc["params"]:
            r["optimizer"] = opt.owner(str(r["name"])) if opt is not None else None
    if fmt == OutputFormat.json:
        print_json(doc)
        return
    print_blocks(*_tables(doc))


def _integrity(doc: dict[str, Any], ckpt: Any, selected: set[str], stats: bool) -> None:
    """The integrity line (from the manifest), and with ``stats`` the recorded statistics per key and per chunk
    (from ``gtp_chunks.json``: read only then, it is one record per chunk)."""
    from gtp_format.integrity.records import read_records
    from gtp_format.integrity.summary import chunk_stats_rows, integrity_line, key_stats

    records = read_records(ckpt) if stats else None
    doc["integrity"] = integrity_line(ckpt, records)
    if stats:
        per_key = key_stats(records, selected) if records is not None else {}
        doc["stats"] = {k: v.to_json() for k, v in per_key.items()}
        doc["chunk_stats"] = chunk_stats_rows(ckpt, records, selected) if records is not None else []
        doc["notes"] += [p.to_dict() for p in records.problems] if records is not None else []


def _leftovers(given: Path, root: Path) -> list[dict[str, Any]]:
    """Hidden work folders of writers beside the checkpoint (in the run directory and PATH): a killed
    save or command leaves them; the next writer there removes those whose owner is dead."""
    from gtp_format.writer.work import leftovers

    spots = sorted({given, root.parent} if given.is_dir() else {root.parent})
    return [{"path": str(w.path), "target": w.target, "pid": w.pid, "owner": w.state}
            for spot in spots for w in leftovers(spot) if w.path != root]


def _optimizer_format(ckpt: Any, topo: Any) -> str | None:
    """The optimizer format's name: as megatron-core recorded it, else as the keys show it."""
    if topo.megatron is not None:
        return topo.megatron.format
    from gtp_format.megatron_topology import key_format

    return key_format(ckpt)


def _optimizer_info(manifest: Any) -> dict[str, Any] | None:
    """The manifest's optimizer: type, step, and how many params each optimizer owns (Muon's
    ``exp_avg`` is its momentum; its ``exp_avg_sq`` is unused)."""
    opt = manifest.optimizer if manifest is not None else None
    if opt is None:
        return None
    names = {p.name for b in manifest.buffers or () for k in b.buckets for p in k.params}
    owners = [opt.owner(n) for n in sorted(names)]
    return {"type": opt.type, "step": opt.step, "params": {o: owners.count(o) for o in sorted(set(owners))},
            "param_optimizers": {n: opt.owner(n) for n in sorted(names)}}


def _tables(doc: dict[str, Any]) -> list[str]:
    c = doc["counts"]
    summary = [
        ("path", doc["path"]), ("layout", f"{doc['layout']} ({doc['backend']})"),
        ("iteration", doc["iteration"] if doc["iteration"] is not None else "-"),
        ("topology", doc["topology"]), ("manifest", "yes" if doc["manifest"] else "no"),
        ("optimizer format", doc["optimizer_format"] or "-"),
        ("keys", f"{c['keys']} ({c['tensors']} tensors, {c['byte_objects']} byte objects)"
                 + (f", {c['matching_keys']} matching" if "matching_keys" in c else "")),
        ("chunks", c["chunks"]), ("stored", fmt_bytes(c["stored_bytes"])),
        ("data files", f"{c['data_files']} ({fmt_bytes(c['data_file_bytes'])})"),
        ("aliasing", f"{doc['aliasing']['status']}: {doc['aliasing']['message']}"),
        ("integrity", doc["integrity"]),
    ]
    oi = doc["optimizer_info"]
    if oi is not None:
        owned = ", ".join(f"{o} {n} params" for o, n in oi["params"].items())
        summary.append(("optimizer", f"{oi['type']} at step {oi['step']} ({owned})"))
    if doc.get("data_position") is not None:
        summary.append(("data position", data_position_words(doc["data_position"])))
    blocks = [table(summary, ("checkpoint", ""))]
    for title in ("opt_param_scheduler",):
        if isinstance(doc.get(title), dict):
            blocks.append(table([(k, v) for k, v in doc[title].items()], ("field", "value"), title))
    blocks.append(table([(w["key"], fmt_shape(w["shape"]), _dtype(w["dtype"]), w["chunks"]) for w in doc["weights"]],
                        ("key", "global shape", "dtype", "chunks"), "Model weights"))
    if doc["optimizer"] or not doc["optimizer_state"]:
        blocks.append(table(
            [(o["dp_group_idx"], o["gbuf_idx"], o["dtype"], o["bucket_idx"], o["state"],
              "-" if o["cp_rank"] is None else o["cp_rank"], "yes" if o["folded"] else "no", o["aliasing"],
              fmt_shape(o["shape"]), _dtype(o["tensor_dtype"]), o["chunks"]) for o in doc["optimizer"]],
            ("dp_group", "gbuf", "dtype", "bucket", "state", "cp_rank", "folded", "aliasing", "shape", "stored as",
             "chunks"),
            "Optimizer (dp_reshardable)"))
    if doc["optimizer_state"]:
        blocks.append(table([(w["key"], fmt_shape(w["shape"]), _dtype(w["dtype"]), w["chunks"])
                             for w in doc["optimizer_state"]], ("key", "global shape", "dtype", "chunks"),
                            f"Optimizer state per parameter ({doc['optimizer_format'] or 'fully_reshardable'})"))
    blocks.append(table([(o["key"], o["category"], fmt_shape(o["shape"]), fmt_bytes(o["bytes"]))
                         for o in doc["objects"]], ("key", "category", "shape", "stored"), "Other objects"))
    for a in doc["aliasing"]["keys"]:
        blocks.append(f"{a['severity']}: {a['key']}: {a['reason']}; {a['kept']}")
    if "chunks" in doc:
        blocks.append(table(
            [(r["key"], r["chunk"], list(r["offsets"]), list(r["sizes"]), r["file"] or "-",
              "-" if r["byte_offset"] is None else f"[{r['byte_offset']}, {r['byte_offset'] + r['length']})")
             for r in doc["chunks"]],
            ("key", "chunk", "offsets", "sizes", "file", "bytes"), "Chunks"))
    if "stats" in doc:
        blocks.append(table([(k, s["numel"], s["nan"], s["posinf"], s["neginf"], s["zeros"], _num(s["min"]),
                              _num(s["max"]), _rms(s)) for k, s in doc["stats"].items()],
                            ("key", "elements", "NaN", "+Inf", "-Inf", "zeros", "min", "max", "RMS"),
                            f"Statistics recorded at save ({doc['integrity']})"))
    if "params" in doc:
        blocks.append(table(
            [(r["name"], fmt_shape(r["full_shape"]), r["gbuf_idx"], r["bucket_idx"], r["offset"], len(r["holders"]),
              _ranks(r["ranks"]), _ranks(r["cp_ranks"]), r["optimizer"] or "-") for r in doc["params"]],
            ("param", "full shape", "gbuf", "bucket", "offset", "copies", "ranks", "cp_rank", "optimizer"),
            "Parameters"))
    if doc["leftovers"]:
        blocks.append(table([(w["path"], w["target"], "-" if w["pid"] is None else w["pid"],
                              {"dead": "dead (stale: the next writer here removes it)", "live": "live (being written)",
                               "unknown": "unknown (another host, or not recorded)"}[w["owner"]])
                             for w in doc["leftovers"]], ("hidden work folder", "for", "pid", "owner"),
                            "Leftovers of unfinished writes"))
    for n in doc["notes"]:
        blocks.append(f"{n['severity']}: {n['message']}")
    return blocks


def _num(v: float | None) -> str:
    return "-" if v is None else f"{v:.6g}"


def _rms(s: dict[str, Any]) -> str:
    """Root mean square of the finite values, from the fp64 sum of squares."""
    finite = s["numel"] - s["nan"] - s["posinf"] - s["neginf"]
    if s["sumsq"] is None:
        return "overflow"
    return "-" if finite <= 0 else f"{(s['sumsq'] / finite) ** 0.5:.6g}"


def _ranks(values: list[int]) -> str:
    text = ",".join(map(str, values[:16]))
    return (text + f",... ({len(values)})" if len(values) > 16 else text) or "-"


def register(app: typer.Typer) -> None:
    app.command(name="inspect", epilog=EPILOG)(inspect_command)
