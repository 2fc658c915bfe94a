"""``ckpt diff``: compare two checkpoints key by key, streaming.

Options, one call into :mod:`gtp_format.compare` (the engine ``verify-roundtrip`` uses too), and
printing. Where both sides cut a tensor into the same chunks, chunk pairs are compared one at a
time; where the layouts differ (a resharded checkpoint), the key is assembled whole on both
sides, bounded by ``--max-bytes``. Chunk layout itself is not a difference here: a torch_dist
checkpoint and its safetensors copy are equal when their keys, shapes, dtypes and values are.

Hashes first: where both checkpoints carry chunk records (``gtp_chunks.json``) that a manifest
checksums, a chunk pair with equal hashes is not read, so comparing two copies reads almost
nothing. Such a verdict rests on records, not bytes, and says so: the summary line and the JSON's
``basis`` name what was read and what was taken on records (:mod:`gtp_format.compare.trust`, which
also reads the pairs whose records the manifests' file checksums contradict). ``--read-all``
(alias ``--read-data``) reads every chunk; ``verify --data`` checks records against the bytes.
Records with problems (ill-formed, statistics that cannot be true) are not trusted at all.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

import typer

from ckpt_tool.locations import checkpoint_arg
from ckpt_tool.output import (
    DEFAULT_MAX_BYTES,
    FormatOption,
    IgnoreOption,
    KeysOption,
    MaxBytesOption,
    OutputFormat,
    fail,
    fmt_shape,
    handle_errors,
    print_blocks,
    print_json,
    progress,
    progress_enabled,
    table,
)
from gtp_format.errors import EXIT_CHECK_FAILED

if TYPE_CHECKING:
    from gtp_format.compare import Difference

EPILOG = """Examples:

  ckpt diff runs/a/checkpoints runs/b/checkpoints

  ckpt diff A/iter_0000100 B/iter_0000100 --atol 1e-6 --format json

  ckpt diff A B --keys 'decoder.*'   (model weights only)

  ckpt diff A B --keys 'optimizer.*' --ignore '*exp_avg_sq*' --ignore '*per_bucket_numel*'

  ckpt diff A B --bitwise   (stored bits: -0.0 differs from 0.0, NaNs only match the same NaN)

  ckpt diff A B --first   (stop at the first differing key, chunk and element; print both values)

Values match when |a - b| <= atol + rtol * |b| (NaN equals NaN); the default is exact. --keys and
--ignore are fnmatch globs on whole key names, each repeatable; a key is compared when it matches
some --keys (or none is given) and no --ignore. A selection that matches no key is an error.

Where both checkpoints carry chunk records, chunk pairs with equal recorded hashes are not read: the
verdict then says "identical by recorded hashes (not re-read)" and exit 0 means the records agree.
--read-all reads and compares every byte.

Exit codes: 0 identical (by the basis printed), 1 different, 2 unreadable input or a selection that
matches nothing."""


def _usable(records: Any) -> Any:
    """Records to trust for skipping: none when reading them found problems (read everything then)."""
    return records if records is not None and not records.problems else None


def _contradicted(basis: Any) -> str:
    if not basis.contradicted:
        return ""
    return (f"; {basis.contradicted} pairs read because the manifests' file checksums contradict their "
            f"records, e.g. {basis.files and sorted(basis.files)[0][1]}")


def _legacy(d: Difference) -> dict[str, Any]:
    """One difference as ``diff --format json`` has always printed it (``--first``: with both values)."""
    if d.code == "values":
        out = {"key": d.key, "what": "values", "mismatches": d.differing, "max_abs_diff": d.max_abs_diff,
               "first_mismatch": list(d.first_index) if d.first_index is not None else None}
        return out | ({"a": d.a, "b": d.b} if d.a is not None else {})
    a, b = (fmt_shape(d.a), fmt_shape(d.b)) if d.code == "shape" else (d.a, d.b)
    return {"key": d.key, "what": d.code, "a": a, "b": b}


@handle_errors
def diff_command(
    a: Annotated[object, typer.Argument(  # a Location: Typer refuses Union annotations
        parser=checkpoint_arg("A"), help="First checkpoint (folder or its parent).", show_default=False)],
    b: Annotated[object, typer.Argument(  # a Location: Typer refuses Union annotations
        parser=checkpoint_arg("B"), help="Second checkpoint (folder or its parent).", show_default=False)],
    rtol: Annotated[float, typer.Option("--rtol", min=0.0, help="Relative tolerance for values.")] = 0.0,
    atol: Annotated[float, typer.Option("--atol", min=0.0, help="Absolute tolerance for values.")] = 0.0,
    bitwise: Annotated[bool, typer.Option(
        "--bitwise", help="Compare stored bits instead of values (byte objects by their stored bytes).")] = False,
    keys: KeysOption = None,
    ignore: IgnoreOption = None,
    max_bytes: MaxBytesOption = DEFAULT_MAX_BYTES,
    first: Annotated[bool, typer.Option(
        "--first", help="Stop at the first differing (key, chunk, element) and print both values.")] = False,
    read_all: Annotated[bool, typer.Option(
        "--read-all", "--read-data",
        help="Read every chunk even where both chunk records give equal hashes.")] = False,
    fmt: FormatOption = OutputFormat.table,
    session: Any = None,  # the command's (handle_errors): no option
) -> None:
    """Compare key sets, shapes, dtypes and values of two checkpoints; exit 1 when they differ."""
    from gtp_format.compare import CheckpointSource, KeyFilter, Rule, compare, selected_keys, work
    from gtp_format.compare.trust import Basis
    from gtp_format.integrity.records import read_records
    from gtp_format.reader.checkpoint import open_checkpoint

    if bitwise and (rtol or atol):
        fail("--bitwise compares bits and takes no tolerance; drop --rtol/--atol or --bitwise")
    rule = Rule.bits() if bitwise else Rule.tolerance(rtol, atol)
    select = KeyFilter.of(keys, ignore)
    ca, cb = open_checkpoint(a, session=session), open_checkpoint(b, session=session)
    sa, sb = (CheckpointSource(c, records=None if read_all else _usable(read_records(c))) for c in (ca, cb))
    select.require_match(ca.entries, cb.entries, where=f"{ca.root} or {cb.root}")
    names = selected_keys(sa, sb, select)
    padding = _padding(ca, cb)
    with progress(work(sa, sb, names), "comparing", progress_enabled(fmt), "chunks") as advance:
        report = compare(sa, sb, rule, keys=names, max_bytes=max_bytes, advance=advance, first=first,
                         padding=padding)
    pads = [{"key": r.key, "differing": r.padding.differing, "detail": r.padding.detail}
            for r in report.results if r.padding is not None]
    only_a, only_b, common = report.only_in_a, report.only_in_b, report.common
    diffs = [_legacy(d) for r in common for d in r.differences]
    equal = report.ok
    basis = report.basis or Basis()
    if fmt == OutputFormat.json:
        print_json({"a": str(ca.root), "b": str(cb.root), "equal": equal, "rtol": rtol, "atol": atol,
                    "rule": report.rule, "selection": select.to_dict(), "compared": len(common),
                    "only_in_a": only_a, "only_in_b": only_b, "differences": diffs, "first": first,
                    "padding": pads,
                    "data_bytes_read": sa.bytes_read + sb.bytes_read,
                    "data_bytes": sum(e.stored_bytes for c in (ca, cb) for e in c.entries.values()),
                    "chunk_hashes": sa.records is not None and sb.records is not None} | basis.to_dict())
    else:
        rows = [(k, "only in A", "") for k in only_a] + [(k, "only in B", "") for k in only_b]
        for d in diffs:
            if d["what"] == "values" and "a" in d:
                detail = f"first difference at {d['first_mismatch']}: A {d['a']!r}  B {d['b']!r}"
            elif d["what"] == "values":
                detail = (f"{d['mismatches']} elements differ, max |a-b| {d['max_abs_diff']}, "
                          f"first at {d['first_mismatch']}")
            else:
                detail = f"A: {d['a']}  B: {d['b']}"
            rows.append((d["key"], d["what"], detail))
        rows += [(p["key"], "padding (not data)", p["detail"]) for p in pads]
        verdict = "identical" if equal else "DIFFERENT"
        if equal and basis.by_records:
            verdict = (f"identical by recorded hashes (not re-read) for {basis.by_records} of "
                       f"{basis.by_records + basis.read} chunk pairs; --read-all reads them")
        selection = f", {select.describe()}" if not select.everything else ""
        print_blocks(table(rows, ("key", "difference", "detail"), "Differences"),
                     f"{verdict}: {len(common)} common keys compared, {len(only_a)} only in A, {len(only_b)} only "
                     f"in B, {len(diffs)} differ ({report.rule}{selection}; basis: {basis.describe()}"
                     f"{_contradicted(basis)})")
    if not equal:
        first = (diffs[0]["key"] if diffs else (only_a or only_b)[0])
        fail(f"checkpoints differ: {len(diffs)} keys differ, {len(only_a)} only in {ca.root}, {len(only_b)} only in "
             f"{cb.root}; first: {first}", EXIT_CHECK_FAILED)


def _padding(ca: Any, cb: Any) -> tuple[frozenset[tuple[str, int]], frozenset[tuple[str, int]]] | None:
    """Each side's alignment-padding chunks where both are megatron-core checkpoints with a known layout."""
    from gtp_format.check.padding import find_megatron_padding

    for c in (ca, cb):
        find_megatron_padding(c)
    if not ca.padding_chunks or not cb.padding_chunks:
        return None
    return ca.padding_chunks, cb.padding_chunks


def register(app: typer.Typer) -> None:
    app.command(name="diff", epilog=EPILOG)(diff_command)
