"""``ckpt inspect``'s report: what a checkpoint holds, from its metadata alone, as one JSON-able dict.

Inspecting is what people do first with a checkpoint they do not trust, so it must be cheap and
safe: it parses ``.metadata`` through the allow-list and reads no tensor data (only ``stat``), which
keeps it fast on multi-TB checkpoints too. The one exception is a genuine megatron-core checkpoint's
``common_state`` byte object (about 2 KiB, at most 1 MiB read), decoded as inert records for the
parallel sizes and optimizer format megatron recorded there (:mod:`gtp_format.megatron.topology`).

Why here and not in the command: the report is a library result (``--format json`` prints it as
is, the table view is drawn from it by :mod:`ckpt_tool.report_tables`), so the command module holds
only its options, this call and the printing, like every other command.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gtp_format.compare import KeyFilter
from gtp_format.model import Checkpoint

if TYPE_CHECKING:
    from gtp_format.check.analysis import AliasReport, KeyClass


def inspect_report(path: Path, select: KeyFilter, *, chunks: bool = False, cp_size: int | None = None,
                   folded: bool = False, params: bool = False, stats: bool = False,
                   session: Any = None) -> dict[str, Any]:
    """The report of the checkpoint at ``path`` (metadata only): the document ``--format json`` prints.

    ``select``: the keys listed (the counts cover them all); ``chunks``, ``params``, ``stats``: the
    optional sections of ``--chunks``, ``--params`` and ``--stats``; ``cp_size`` and ``folded``
    declare a CP size (and folding) that no manifest states. ``session``: the command's
    (:func:`gtp_format.reader.checkpoint.open_checkpoint`).
    """
    from gtp_format.check.analysis import aliasing, classify_all, topology_view
    from gtp_format.names import DATA_POSITION_KEY, SCHEDULER_KEY
    from gtp_format.reader.checkpoint import open_checkpoint
    from gtp_format.storage.base import storage_for

    ckpt = open_checkpoint(path, session=session)
    classes = classify_all(ckpt)
    topo = topology_view(ckpt.manifest, cp_size, ckpt=ckpt, folded=folded)
    run_extra = ckpt.manifest.extra if ckpt.manifest is not None else {}  # run state: extra manifest fields
    alias = aliasing(ckpt, classes, topo)
    selected = [k for k in ckpt.entries if select(k)]
    rows = _key_rows(ckpt, classes, alias, selected)
    counts = _counts(ckpt, classes)
    if not select.everything:
        counts["matching_keys"] = len(selected)
    doc = {
        "path": str(ckpt.root), "layout": ckpt.layout, "backend": ckpt.backend, "dcp_version": ckpt.dcp_version,
        "iteration": ckpt.iteration, "topology": topo.describe(),
        "parallel_config": topo.par.to_dict() if topo.par else None,
        "manifest": ckpt.manifest is not None, "megatron_metadata": ckpt.megatron_metadata,
        "optimizer_format": _optimizer_format(ckpt, topo),
        "megatron_topology": topo.megatron.to_dict() if topo.megatron is not None else None,
        "megatron_model": megatron_model(ckpt) if topo.megatron is not None else None,
        "counts": counts,
        # Run state (gtp manifests only): the lr schedule under Megatron's name and the data position.
        "opt_param_scheduler": run_extra.get(SCHEDULER_KEY),
        "data_position": run_extra.get(DATA_POSITION_KEY),
        "aliasing": {"status": alias.status, "message": alias.message,
                     "keys": [{"key": a.key, "severity": a.severity, "reason": a.reason, "kept": a.kept_summary(),
                               "survivors": [asdict(s) for s in a.survivors]} for a in alias.aliased]},
        "optimizer_info": _optimizer_info(ckpt.manifest),
        **rows,
        "notes": [p.to_dict() for p in ckpt.notes + topo.notes],
    }
    # a bucket has no work folders: its writer's commit is the object written last (docs/object-stores.md)
    doc["leftovers"] = _leftovers(Path(path), ckpt.root) if storage_for(ckpt.store).in_place else []
    _integrity(doc, ckpt, set(selected), stats)
    _identity(doc, ckpt)
    if chunks:
        doc["chunks"] = _chunk_rows(ckpt, selected)
    if params:
        doc["params"] = _param_rows(ckpt)
    return doc


def megatron_model(ckpt: Checkpoint) -> dict[str, Any]:
    """The model a megatron-core checkpoint holds (:func:`gtp_format.megatron.args.describe_model`):
    its fields and its one-line ``text``, as ``inspect`` and ``show`` print it. Its args are checked
    against its shapes; a disagreement is raised (``FormatError``, one line)."""
    from gtp_format.megatron.args import describe_model

    model = describe_model(ckpt)
    return {**model.to_dict(), "text": model.describe()}


def _key_rows(ckpt: Checkpoint, classes: dict[str, KeyClass], alias: AliasReport,
              selected: list[str]) -> dict[str, list[dict[str, Any]]]:
    """The selected keys by kind: model weights, dp_reshardable optimizer keys (in bucket order),
    per-parameter optimizer state (fully_reshardable) and every other object."""
    from gtp_format.check.analysis import FULL_STATE_PREFIX, MODEL, OPTIMIZER
    from gtp_format.names import STATES

    alias_state = {a.key: ("ALIASED" if a.severity == "error" else "aliased?") for a in alias.aliased}
    weights, optimizer, opt_state, objects = [], [], [], []
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
    state_order = {s: i for i, s in enumerate(STATES)}
    optimizer.sort(key=lambda r: (r["dp_group_idx"], r["gbuf_idx"], r["dtype"], r["bucket_idx"],
                                  state_order.get(r["state"], len(STATES)), r["state"], r["cp_rank"] or -1))
    return {"weights": weights, "optimizer": optimizer, "optimizer_state": opt_state, "objects": objects}


def _counts(ckpt: Checkpoint, classes: dict[str, KeyClass]) -> dict[str, int]:
    from gtp_format.check.analysis import BUCKET_NUMEL
    from gtp_format.model import BYTES, TENSOR

    return {
        "keys": len(ckpt.entries),
        "tensors": sum(e.kind == TENSOR for e in ckpt.entries.values()),
        "byte_objects": sum(e.kind == BYTES for e in ckpt.entries.values()),
        "chunks": ckpt.chunk_count(),
        "stored_bytes": sum(e.stored_bytes for e in ckpt.entries.values()),
        "data_files": len(ckpt.data_files),
        "data_file_bytes": sum(ckpt.data_files.values()),
        "per_bucket_numel_objects": sum(c.category == BUCKET_NUMEL for c in classes.values()),
    }


def _chunk_rows(ckpt: Checkpoint, selected: list[str]) -> list[dict[str, Any]]:
    """``--chunks``: every chunk of the selected keys, where its bytes are."""
    rows = []
    for key in selected:
        for c in ckpt.entries[key].chunks:
            ref = c.storage
            rows.append({"key": key, "chunk": c.index, "offsets": c.offsets, "sizes": c.sizes,
                         "file": ref.file if ref else None, "byte_offset": ref.offset if ref else None,
                         "length": ref.length if ref else None})
    return rows


def _param_rows(ckpt: Checkpoint) -> list[dict[str, object]]:
    """``--params``: each parameter's place (:func:`gtp_format.views.records.describe`) and its optimizer."""
    from gtp_format.views.checkpoint import param_views_of
    from gtp_format.views.records import describe

    rows = describe(param_views_of(ckpt))
    opt = ckpt.manifest.optimizer if ckpt.manifest is not None else None
    for r in rows:
        r["optimizer"] = opt.owner(str(r["name"])) if opt is not None else None
    return rows


def _identity(doc: dict[str, Any], ckpt: Any) -> None:
    """Lineage (run id, iteration, root hash, parent) from the manifest and a conversion's attestation."""
    from gtp_format.lineage import identity_report
    from gtp_format.model import Problem

    doc["lineage"], doc["attestation"], notes = identity_report(ckpt)
    doc["notes"] += [Problem("error", "lineage", n).to_dict() for n in notes]


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
    save or command leaves them; the next writer there removes those whose owner is dead and whose
    ownership token matches their name (``proven``; the others are only listed)."""
    from gtp_format.work import leftovers, proven

    spots = sorted({given, root.parent} if given.is_dir() else {root.parent})
    return [{"path": str(w.path), "target": w.target, "pid": w.pid, "owner": w.state, "proven": proven(w)}
            for spot in spots for w in leftovers(spot) if w.path != root]


def _optimizer_format(ckpt: Any, topo: Any) -> str | None:
    """The optimizer format's name: as megatron-core recorded it, else as the keys show it."""
    if topo.megatron is not None:
        return topo.megatron.format
    from gtp_format.megatron.topology import key_format

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
