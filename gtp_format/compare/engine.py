"""The one comparison engine: key sets, kinds, shapes, dtypes, chunk layout, then values.

``ckpt diff``, ``ckpt verify-roundtrip`` (both modes) and the runtime's per-rank snapshot checks
call :func:`compare`; what differs is only the :class:`~gtp_format.compare.values.Rule` (bitwise
or a tolerance), the key selection, and whether a different chunk layout counts as a difference
(it does not for ``diff``, which compares a torch_dist checkpoint with its safetensors copy; it
does for a round trip at the same topology).

Per key, in key order, the engine stops at the first metadata difference (values of a different
shape or dtype are not comparable) and otherwise compares values:

* where both sides cut the tensor into the same boxes (the usual case: same topology), chunk
  pairs are compared one at a time, so only one pair is in memory;
* where the boxes differ (a resharded copy), the tensor is assembled whole on both sides, refused
  over ``max_bytes`` before anything is allocated.

The first differing element is the first in row-major order of the global tensor either way.
Everything up to the values is metadata and torch-free (``values=False`` compares only that);
values are read through the sources and compared by :mod:`gtp_format.compare.values`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from gtp_format.compare.records import (
    CHUNKS,
    DTYPE,
    KIND,
    OBJECT,
    ONLY_IN_A,
    ONLY_IN_B,
    SHAPE,
    VALUES,
    Difference,
    KeyResult,
    Report,
    fmt_index,
)
from gtp_format.compare.select import EVERYTHING
from gtp_format.compare.sources import Source
from gtp_format.compare.trust import Basis, contradicted
from gtp_format.compare.values import EXACT, Rule, compare_values, unravel
from gtp_format.errors import ChunkError
from gtp_format.model import BYTES, Entry

DEFAULT_MAX_BYTES = 2 << 30
Advance = Callable[[int], None]


def _boxes(e: Entry) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    return sorted((c.offsets, c.sizes) for c in e.chunks)


def selected_keys(a: Source, b: Source, select: Callable[[str], bool] = EVERYTHING) -> list[str]:
    """The keys a comparison visits: the union of both sides, selected, sorted."""
    return sorted(k for k in a.entries.keys() | b.entries.keys() if select(k))


def work(a: Source, b: Source, keys: Iterable[str]) -> int:
    """Progress units :func:`compare` reports for ``keys``: every chunk of keys present on both sides."""
    return sum(len(a.entries[k].chunks) + len(b.entries[k].chunks) for k in keys
               if k in a.entries and k in b.entries)


def compare(a: Source, b: Source, rule: Rule = EXACT, *, select: Callable[[str], bool] = EVERYTHING,
            chunks: bool = False, values: bool = True, max_bytes: int = DEFAULT_MAX_BYTES,
            advance: Advance | None = None, keys: Iterable[str] | None = None, first: bool = False,
            padding: tuple[frozenset[tuple[str, int]], frozenset[tuple[str, int]]] | None = None) -> Report:
    """Compare side ``a`` with side ``b``, key by key; see the module docstring.

    ``chunks``: report a different chunk layout (code ``chunks``); values are compared anyway.
    ``values``: read and compare data (``False``: metadata only, torch-free). ``keys``: the keys to
    visit when the caller already computed :func:`selected_keys`. ``first``: stop at the first key that
    differs, and within it at the first differing chunk (in offset order); its ``values`` difference
    carries both sides' values at the first differing element in ``a`` and ``b``.

    Chunk pairs whose sources both give a recorded hash (:meth:`Source.digest`), and equal ones,
    are not read (equal hashes of the stored bytes mean equal bytes, so equal values), unless the
    manifests' file checksums contradict the records (:mod:`gtp_format.compare.trust`);
    ``report.basis`` counts what was read and what was taken on records.

    ``padding``: (key, chunk index) of the chunks that are alignment padding on side ``a`` and on side
    ``b`` (:func:`gtp_format.megatron.padding.padding_chunks`). A chunk pair that is padding on both
    sides is compared apart: what differs there is :attr:`KeyResult.padding`, not a difference
    (megatron-core leaves that memory uninitialised, so two saves of one state differ in it).
    """
    step = advance or (lambda n: None)
    report = Report(rule=rule.describe())
    report.basis = Basis(contradicted(a, b) if values else frozenset())
    for key in (selected_keys(a, b, select) if keys is None else keys):
        result = compare_key(a, b, key, rule, chunks=chunks, values=values, max_bytes=max_bytes, advance=step,
                             first=first, padding=padding, basis=report.basis)
        report.results.append(result)
        if first and result.differences:
            break
    return report


def compare_key(a: Source, b: Source, key: str, rule: Rule, *, chunks: bool = False, values: bool = True,
                max_bytes: int = DEFAULT_MAX_BYTES, advance: Advance = lambda n: None,
                first: bool = False,
                padding: tuple[frozenset[tuple[str, int]], frozenset[tuple[str, int]]] | None = None,
                basis: Basis | None = None) -> KeyResult:
    """Compare one key (present on at least one side); ``basis`` counts what the verdict rests on."""
    basis = basis if basis is not None else Basis()
    ea, eb = a.entries.get(key), b.entries.get(key)
    if ea is None or eb is None:
        e, code, side = (ea, ONLY_IN_A, a) if eb is None else (eb, ONLY_IN_B, b)
        assert e is not None, key
        d = Difference(code, key, f"only in {side.name}", numel=e.numel, differing=e.numel)
        return KeyResult(key, ea.numel if ea is not None else 0, len(ea.chunks) if ea is not None else 0, (d,))
    numel = 1 if ea.kind == BYTES else ea.numel  # a byte object counts as one element
    meta = _metadata(ea, eb)
    if meta is not None or not values:
        advance(len(ea.chunks) + len(eb.chunks))
    found = [] if meta is None else [meta]
    pad: list[Difference] = []
    if meta is None and chunks and ea.kind != BYTES and _boxes(ea) != _boxes(eb):
        found.append(Difference(CHUNKS, key, f"{len(ea.chunks)} vs {len(eb.chunks)} chunks, boxes differ",
                                a=len(ea.chunks), b=len(eb.chunks), numel=len(ea.chunks), differing=len(ea.chunks)))
    if meta is None and values:
        if ea.kind == BYTES:
            content = _objects(a, ea, b, eb, rule, basis)
            advance(len(ea.chunks) + len(eb.chunks))
        else:
            content = _tensors(a, ea, b, eb, rule, max_bytes, advance, first, padding, pad, basis)
        found += [content] if content is not None else []
    return KeyResult(key, numel, len(ea.chunks), tuple(found), pad[0] if pad else None)


def _metadata(ea: Entry, eb: Entry) -> Difference | None:
    key = ea.key
    if ea.kind != eb.kind:
        return Difference(KIND, key, f"kind {ea.kind} vs {eb.kind}", a=ea.kind, b=eb.kind)
    if ea.kind == BYTES:
        return None
    if ea.shape != eb.shape:
        sa, sb = list(ea.shape or ()), list(eb.shape or ())
        return Difference(SHAPE, key, f"global shape {sa} vs {sb}", a=sa, b=sb, numel=ea.numel, differing=ea.numel)
    if ea.dtype != eb.dtype:
        return Difference(DTYPE, key, f"dtype {ea.dtype} vs {eb.dtype}", a=str(ea.dtype), b=str(eb.dtype),
                          numel=ea.numel, differing=ea.numel)
    return None


def _objects(a: Source, ea: Entry, b: Source, eb: Entry, rule: Rule, basis: Basis) -> Difference | None:
    """Byte objects: equal stored bytes; with a tolerance rule, equal decoded objects will do
    (``torch.save`` blobs of equal objects can differ byte-wise, e.g. in their archive name)."""
    if _same_digests(a, ea, b, eb, basis):
        return None
    basis.read += 1
    if a.object_bytes(ea) == b.object_bytes(eb):
        return None
    detail = "stored bytes differ"
    if not rule.bitwise:
        try:
            if bool(a.load_object(ea) == b.load_object(eb)):
                return None
        except (ChunkError, RuntimeError, ValueError, TypeError):
            pass
        detail = "objects differ"
    return Difference(OBJECT, ea.key, detail, a=ea.stored_bytes, b=eb.stored_bytes, numel=1, differing=1)


def _same_digests(a: Source, ea: Entry, b: Source, eb: Entry, basis: Basis) -> bool:
    if len(ea.chunks) != len(eb.chunks) or len(ea.chunks) != 1:
        return False  # a byte object is one blob
    return basis.equal_by_records(a, ea, ea.chunks[0], b, eb, eb.chunks[0])


def _tensors(a: Source, ea: Entry, b: Source, eb: Entry, rule: Rule, max_bytes: int,
             advance: Advance, stop_first: bool = False,
             padding: tuple[frozenset[tuple[str, int]], frozenset[tuple[str, int]]] | None = None,
             pad_out: list[Difference] | None = None, basis: Basis | None = None) -> Difference | None:
    basis = basis if basis is not None else Basis()
    assert ea.shape is not None
    count, max_abs, first = 0, None, None
    pad_count, pad_chunks = 0, 0
    values: tuple[object, object] = (None, None)
    boxes_b = {(c.offsets, c.sizes): c for c in eb.chunks}
    if _boxes(ea) == _boxes(eb):
        for c in sorted(ea.chunks, key=lambda c: c.offsets) if stop_first else ea.chunks:
            cb = boxes_b[(c.offsets, c.sizes)]
            if basis.equal_by_records(a, ea, c, b, eb, cb):  # equal recorded hashes: not read
                advance(2)
                continue
            basis.read += 1
            ta, tb = a.chunk(ea, c), b.chunk(eb, cb)
            vd = compare_values(ta, tb, rule)
            advance(2)
            if not vd.differing:
                continue
            if padding is not None and (ea.key, c.index) in padding[0] and (eb.key, cb.index) in padding[1]:
                pad_count, pad_chunks = pad_count + vd.differing, pad_chunks + 1
                continue
            count += vd.differing
            if vd.max_abs_diff is not None:
                max_abs = max(max_abs or 0.0, vd.max_abs_diff)
            assert vd.first is not None
            where = tuple(o + i for o, i in zip(c.offsets, unravel(vd.first, c.sizes)))
            first = where if first is None else min(first, where)
            if stop_first:
                values = (ta.reshape(-1)[vd.first].item(), tb.reshape(-1)[vd.first].item())
                break
    else:
        basis.read += max(len(ea.chunks), len(eb.chunks))
        vd = compare_values(a.whole(ea, max_bytes), b.whole(eb, max_bytes), rule)
        advance(len(ea.chunks) + len(eb.chunks))
        count, max_abs = vd.differing, vd.max_abs_diff
        first = unravel(vd.first, ea.shape) if vd.first is not None else None
    if pad_count and pad_out is not None:
        pad_out.append(Difference(VALUES, ea.key, f"{pad_count} elements of alignment padding differ (in {pad_chunks} "
                                  "padding chunks: no parameter's elements, megatron-core leaves them uninitialised)",
                                  numel=ea.numel, differing=pad_count))
    if not count:
        return None
    assert first is not None
    detail = f"{count} of {ea.numel} elements differ, first at index {fmt_index(first)}"
    if stop_first and values[0] is not None:
        detail = f"first difference at index {fmt_index(first)}: {values[0]!r} vs {values[1]!r}"
    return Difference(VALUES, ea.key, detail, a=values[0], b=values[1], numel=ea.numel, differing=count,
                      max_abs_diff=max_abs, first_index=first)
