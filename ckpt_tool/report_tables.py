"""``ckpt inspect``'s report (:func:`gtp_format.report.inspect_report`) drawn as tables."""

from __future__ import annotations

from typing import Any

from ckpt_tool.output import fmt_bytes, fmt_shape, table


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


def lineage_rows(lin: dict[str, Any] | None, att: dict[str, Any] | None) -> list[tuple[str, Any]]:
    """Lineage and attestation lines of ``inspect``'s summary (none for a checkpoint without them)."""
    rows: list[tuple[str, Any]] = []
    if lin is not None:
        p = lin["parent"]
        rows += [("run id", lin["run_id"]), ("root hash", lin["root_hash"] or "- (no chunk records)"),
                 ("parent", "none (a fresh run)" if p is None else
                  f"{p['via']} from run {p['run_id'] or '?'} iteration {p['iteration']} root {p['root_hash'] or '?'}"),
                 ("topology digest", lin["topology"] or "-"), ("written by", lin["writer"] or "-")]
    if att is not None:
        s, t = att["source"], att["target"]
        rows.append(("attestation", f"{att['command']} ({att['tool']}): source {s['path']} root {s['root_hash'] or '?'}"
                     f" -> root {t['root_hash'] or '?'}, {att['tensors']} tensors mapped"))
    return rows


def model_rows(model: dict[str, Any] | None) -> list[tuple[str, Any]]:
    """The ``model`` line of a megatron-core checkpoint (:func:`gtp_format.report.megatron_model`), as
    ``inspect`` and ``show`` print it; none for another checkpoint."""
    return [("model", model["text"])] if model else []


def inspect_tables(doc: dict[str, Any]) -> list[str]:
    c = doc["counts"]
    summary = [
        ("path", doc["path"]), ("layout", f"{doc['layout']} ({doc['backend']})"),
        ("iteration", doc["iteration"] if doc["iteration"] is not None else "-"),
        ("topology", doc["topology"]), ("manifest", "yes" if doc["manifest"] else "no"),
        ("optimizer format", doc["optimizer_format"] or "-"),
        *model_rows(doc.get("megatron_model")),
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
    summary += lineage_rows(doc.get("lineage"), doc.get("attestation"))
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
                              _owner(w))
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


def _owner(w: dict) -> str:
    """A leftover's owner column: a dead owner's folder is removed by the next writer only when its
    ownership token proves this tool made it (``proven``); otherwise it is only ever listed."""
    if w["owner"] == "dead":
        return ("dead (stale: the next writer here removes it)" if w.get("proven")
                else "dead, unproven (no ownership token matching its name: never removed; delete it yourself "
                     "if it is yours)")
    return {"live": "live (being written)", "unknown": "unknown (another host, or not recorded)"}[w["owner"]]
