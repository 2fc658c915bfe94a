"""The checks behind ``ckpt verify``: pure functions from a checkpoint model to problem records.

Structural checks read metadata and ``stat`` results only, so they are cheap enough for every
run; ``--data`` adds decoding every chunk and hashing every file the manifest lists. Each check
returns :class:`gtp_format.model.Problem` records instead of raising, so one damaged chunk does
not hide the next one: a verify run reports everything it can see.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from itertools import chain
from operator import add, attrgetter, eq, le
from typing import Any

import numpy as np

from gtp_format.check.analysis import (
    BUCKET_NUMEL,
    KeyClass,
    TopologyView,
    aliasing,
    classify_all,
    topology_view,
)
from gtp_format.check.canonical import check_canonical_layout, check_key_dtypes
from gtp_format.check.hashes import covered_files, match_records
from gtp_format.check.keys import check_manifest_keys
from gtp_format.check.megatron_integrity import check_integrity, read_integrity
from gtp_format.check.owners import check_param_optimizers
from gtp_format.check.values import stats_nonfinite
from gtp_format.check.verify_data import data_steps
from gtp_format.dtypes import DType
from gtp_format.errors import ChunkError, FormatError
from gtp_format.hashing import HASHERS, file_digests
from gtp_format.integrity.records import ChunkRecord, read_records
from gtp_format.layout.boxes import check_coverage
from gtp_format.model import BYTES, ENC_RAW, ENC_TORCH_SAVE, TENSOR, Checkpoint, ChunkColumns, Entry, Problem
from gtp_format.names import OPT_PREFIX, OptimizerKey, dtype_tag, per_bucket_numel_key
from gtp_format.progress import Progress
from gtp_format.reader.chunks import declared_size_problem, load_elements, load_plain
from gtp_format.reader.storage import file_size, open_regular, unsafe_reason

CHEAP_OBJECT_BYTES = 1 << 20  # per_bucket_numel objects below this are decoded even without --data
BUCKET_TABLE_READS = 8  # per_bucket_numel tables read at once (each at most CHEAP_OBJECT_BYTES without --data)



@dataclass
class VerifyResult:
    problems: list[Problem] = field(default_factory=list)
    checks: list[str] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not any(p.severity == "error" for p in self.problems)

    def failure_line(self, root: object) -> str | None:
        """The one line a failed verify gives (``ckpt verify`` and ``--load`` both print it), or None."""
        errors = [p for p in self.problems if p.severity == "error"]
        if not errors:
            return None
        first = errors[0]
        where = first.key or first.file or str(root)
        return f"verify failed: {len(errors)} errors in {root}; first: {where}: {first.message}"


def _fmt_box(offsets: tuple[int, ...], sizes: tuple[int, ...]) -> str:
    return f"offsets {list(offsets)} sizes {list(sizes)}"


def check_geometry(ckpt: Checkpoint) -> list[Problem]:
    """Every tensor's chunks lie in its global shape and tile it with no overlap and no hole."""
    out: list[Problem] = []
    for e in ckpt.entries.values():
        if e.kind != TENSOR or e.shape is None:
            continue
        boxes = e.chunks.boxes() if isinstance(e.chunks, ChunkColumns) else [(c.offsets, c.sizes) for c in e.chunks]
        cov = check_coverage(e.shape, boxes)
        for i in cov.bad_rank:
            c = e.chunks[i]
            out.append(Problem("error", "chunk_rank", f"chunk has {len(c.offsets)}-D offsets / {len(c.sizes)}-D "
                               f"sizes for a {len(e.shape)}-D tensor", key=e.key, chunk=i))
        for i in cov.out_of_bounds:
            c = e.chunks[i]
            out.append(Problem("error", "chunk_bounds", f"chunk {_fmt_box(c.offsets, c.sizes)} leaves the "
                               f"global shape {list(e.shape)}", key=e.key, chunk=i))
        for a, b in cov.overlaps:
            ca, cb = e.chunks[a], e.chunks[b]
            out.append(Problem("error", "overlap", f"chunks {a} ({_fmt_box(ca.offsets, ca.sizes)}) and {b} "
                               f"({_fmt_box(cb.offsets, cb.sizes)}) overlap", key=e.key, chunk=b))
        if cov.overlap_count > len(cov.overlaps):
            more = cov.overlap_count - len(cov.overlaps)
            out.append(Problem("error", "overlap", f"{'' if cov.count_exact else 'at least '}{more} more overlapping "
                               "chunk pairs", key=e.key))
        if cov.missing:
            where = (": uncovered " + ", ".join(f"[{a}, {b})" for a, b in cov.holes)) if cov.holes else ""
            out.append(Problem("error", "hole", f"{cov.missing} of {e.numel} elements are in no chunk{where}",
                               key=e.key))
        elif cov.missing is None:
            out.append(Problem("warning", "hole", "coverage not computed: too many overlapping chunks", key=e.key))
    return out


def check_storage(ckpt: Checkpoint) -> list[Problem]:
    """Every chunk has storage, inside the folder, in an existing file, within its size."""
    fast = _storage_in_order(ckpt)
    if fast is not None:
        return fast
    out: list[Problem] = []
    sizes: dict[str, int | ChunkError] = {}
    ranges: dict[str, list[tuple[int, int, str, int]]] = defaultdict(list)
    lost: dict[str, set[str]] = defaultdict(set)  # unusable file -> keys with chunks in it
    reasons: dict[str, str | None] = {}  # a few files hold a million chunks: each name is checked once
    for e in ckpt.entries.values():
        for c in e.chunks:
            ref = c.storage
            if ref is None:
                out.append(Problem("error", "no_storage", "chunk has no storage entry: its data was never written "
                                   "or cannot be located",
                                   key=e.key, chunk=c.index))
                continue
            if type(ref.file) is str:
                reason = reasons[ref.file] if ref.file in reasons else reasons.setdefault(ref.file,
                                                                                          unsafe_reason(ref.file))
            else:
                reason = unsafe_reason(ref.file)
            if reason is not None:
                out.append(Problem("error", "unsafe_path", f"{reason}; it will not be read", key=e.key,
                                   chunk=c.index, file=str(ref.file)))
                continue
            if ref.file not in sizes:
                try:
                    sizes[ref.file] = file_size(ckpt.store, ref.file)
                except ChunkError as err:
                    sizes[ref.file] = err
            size = sizes[ref.file]
            if isinstance(size, ChunkError):
                lost[ref.file].add(e.key)
                continue
            if ref.offset + ref.length > size:
                out.append(Problem("error", "out_of_file", f"byte range [{ref.offset}, {ref.offset + ref.length}) "
                                   f"runs past the end of {ref.file} ({size} bytes): truncated file or wrong "
                                   "metadata", key=e.key, chunk=c.index, file=ref.file))
            problem = declared_size_problem(ckpt, e, c)
            if problem is not None:
                out.append(Problem("error", "declared_size", problem, key=e.key, chunk=c.index, file=ref.file))
            if ref.transforms:
                out.append(Problem("warning", "transform", f"stored with transforms {list(ref.transforms)}, "
                                   "which ckpt cannot decode", key=e.key, chunk=c.index, file=ref.file))
            ranges[ref.file].append((ref.offset, ref.offset + ref.length, e.key, c.index))
    for file, keys in sorted(lost.items()):
        err = sizes[file]
        assert isinstance(err, ChunkError)
        out.append(Problem("error", "data_file", f"{err.message}; it stores chunks of {len(keys)} keys, e.g. "
                           f"{min(keys)}", key=min(keys), file=file))
    out += _byte_range_problems(ckpt, ranges, sizes)
    for name in sorted(ckpt.data_files.keys() - ranges.keys() - sizes.keys()):
        out.append(Problem("warning", "orphan_file", "data file is referenced by no chunk", file=name))
    return out


def _storage_in_order(ckpt: Checkpoint) -> list[Problem] | None:
    """:func:`check_storage`'s verdict over columns when no chunk has a problem of its own, else ``None``.

    Why: the chunk-by-chunk walk below costs a Python step (and a sort of a million tuples) per chunk,
    which made ``verify`` of a 1M-chunk ``.metadata`` 2 s slower than ``inspect`` on the 16-core machine.
    Here every rule is one C-level pass over a column (storage present, safe and existing files, no
    transforms, ranges inside their file, declared sizes that fit) and the byte ranges are sorted per
    file in numpy. Any chunk that breaks a rule, or two ranges that overlap, sends the caller to the
    walk, which names each problem as before; in order, the only findings are the per-file warnings,
    in the walk's order (unreferenced bytes by file in first use, then orphan files).
    """
    entries = [e for e in ckpt.entries.values() if e.chunks]
    got = _storage_columns(ckpt, entries)
    if got is None:
        return None
    files, starts, ends, needs, lengths = got
    sizes: dict[str, int] = {}
    for name in dict.fromkeys(files):  # first use order, as the walk's ranges
        if type(name) is not str or unsafe_reason(name) is not None:
            return None
        try:
            sizes[name] = file_size(ckpt.store, name)
        except ChunkError:
            return None
    if not all(map(le, ends, map(sizes.__getitem__, files))):
        return None
    if not all(map(eq if ckpt.encoding == ENC_RAW else le, needs, lengths)):
        return None
    codes = dict(zip(sizes, range(len(sizes))))
    code = np.fromiter(map(codes.__getitem__, files), np.int64, len(files))
    lo, hi = np.fromiter(starts, np.int64, len(starts)), np.fromiter(ends, np.int64, len(ends))
    order = np.lexsort((hi, lo, code))
    code, lo, hi = code[order], lo[order], hi[order]
    bounds = np.searchsorted(code, np.arange(len(sizes) + 1))
    out = []
    for i, name in enumerate(sizes):
        a, b = lo[bounds[i]:bounds[i + 1]], hi[bounds[i]:bounds[i + 1]]
        reach = np.maximum.accumulate(b)  # the furthest byte any earlier range reached
        if a.size > 1 and bool((a[1:] < reach[:-1]).any()):
            return None  # shared bytes: the walk names each pair
        before = np.concatenate(([0], reach[:-1]))
        unclaimed = int(np.maximum(a - before, 0).sum()) + max(0, sizes[name] - int(reach[-1]))
        if ckpt.encoding == ENC_TORCH_SAVE and unclaimed:
            out.append(Problem("warning", "unreferenced_bytes", f"{unclaimed} bytes of the file belong to no chunk "
                               "(a duplicate write by an aliased rank, or leftovers)", file=name))
    for name in sorted(ckpt.data_files.keys() - sizes.keys()):
        out.append(Problem("warning", "orphan_file", "data file is referenced by no chunk", file=name))
    return out


def _storage_columns(ckpt: Checkpoint, entries: list[Any]) -> tuple[list[Any], ...] | None:
    """Per chunk, in the walk's order: file, start, end, the bytes its elements need and its length; ``None``
    where a chunk breaks a rule of its own (no storage, transforms, not ints, a raw byte object).

    A large ``.metadata``'s chunks are columns already (:class:`ChunkColumns`): their rows are taken whole,
    with no :class:`Chunk` made (a Python step per chunk, 6 of verify's 13 CPU seconds at 1M chunks here).
    """
    if any(e.kind == BYTES for e in entries) and ckpt.encoding == ENC_RAW:
        return None  # a raw byte object must be exactly as long as its elements: the walk decides
    parts: list[tuple[list[Any], list[Any], list[Any], list[Any]]] = []
    for e in entries:
        itemsize = 0 if e.kind == BYTES else e.itemsize
        if isinstance(e.chunks, ChunkColumns):
            t, a, b = e.chunks.table, e.chunks.first, e.chunks.first + e.chunks.count
            f = t.file[a:b]
            if int(f.min()) < 0:
                return None
            numel = t.numel[a:b].tolist()
            parts.append((list(map(t.files.__getitem__, f.tolist())), t.start[a:b].tolist(),
                          t.length[a:b].tolist(), [n * itemsize for n in numel]))
            continue
        refs = list(map(attrgetter("storage"), e.chunks))
        if refs.count(None):
            return None
        files, starts, lengths, transforms = (list(map(attrgetter(name), refs))  # not zip(*refs): 30x slower
                                              for name in ("file", "offset", "length", "transforms"))
        if any(transforms) or not set(map(type, starts)) | set(map(type, lengths)) <= {int}:
            return None
        parts.append((files, starts, lengths,
                      [math.prod(c.sizes) * itemsize for c in e.chunks]))
    if not parts:
        return None
    files = list(chain.from_iterable(p[0] for p in parts))
    starts = list(chain.from_iterable(p[1] for p in parts))
    lengths = list(chain.from_iterable(p[2] for p in parts))
    needs = list(chain.from_iterable(p[3] for p in parts))
    return files, starts, list(map(add, starts, lengths)), needs, lengths


def _byte_range_problems(ckpt: Checkpoint, ranges: dict[str, list[tuple[int, int, str, int]]],
                         sizes: dict[str, int | ChunkError]) -> list[Problem]:
    """Chunks sharing bytes, and (torch_dist files) bytes that no chunk claims."""
    out = []
    for file, spans in ranges.items():
        spans.sort()
        end = 0
        unclaimed = 0
        prev: tuple[int, int, str, int] | None = None
        for span in spans:
            start, stop, key, index = span
            if prev is not None and start < prev[1]:
                out.append(Problem("error", "byte_overlap", f"bytes [{start}, {min(stop, prev[1])}) are shared with "
                                   f"{prev[2]} chunk {prev[3]}", key=key, chunk=index, file=file))
            unclaimed += max(0, start - end)
            end = max(end, stop)
            prev = span if prev is None or stop >= prev[1] else prev
        size = sizes.get(file)
        if isinstance(size, int):
            unclaimed += max(0, size - end)
        if ckpt.encoding == ENC_TORCH_SAVE and unclaimed:
            out.append(Problem("warning", "unreferenced_bytes", f"{unclaimed} bytes of the file belong to no chunk "
                               "(a duplicate write by an aliased rank, or leftovers)", file=file))
    return out


def check_optimizer(ckpt: Checkpoint, classes: dict[str, KeyClass], topo: TopologyView) -> list[Problem]:
    """Aliasing, cp_rank completeness of folded buffers and shape agreement inside a bucket."""
    out = list(topo.notes)
    report = aliasing(ckpt, classes, topo)
    for a in report.aliased:
        fix = "; aliased (saved before the .cp_rank fix): `ckpt migrate-aliased` rebuilds it" \
            if a.severity == "error" else ""
        out.append(Problem(a.severity, "aliasing", f"{a.reason}; {a.kept_summary()}{fix}", key=a.key))
    if report.status == "inconsistent":
        out.append(Problem("warning", "aliasing", report.message))
    buckets: dict[tuple[Any, ...], dict[tuple[str, int | None], str]] = defaultdict(dict)
    examples: dict[tuple[Any, ...], OptimizerKey] = {}
    for key, cls in classes.items():
        if cls.opt is None:
            continue
        slot = (cls.opt.state, cls.opt.cp_rank)
        other = buckets[cls.opt.bucket_id].get(slot)
        if other is not None:
            out.append(Problem("error", "duplicate_key", f"same bucket state and cp_rank as {other}", key=key))
        buckets[cls.opt.bucket_id][slot] = key
        examples.setdefault(cls.opt.bucket_id, cls.opt)
    for bucket_id, slots in buckets.items():
        out += _bucket_problems(ckpt, examples[bucket_id], slots, topo)
    return out


def _bucket_problems(ckpt: Checkpoint, example: OptimizerKey, slots: dict[tuple[str, int | None], str],
                     topo: TopologyView) -> list[Problem]:
    """One bucket: all its state keys share a shape; a folded one has every cp_rank of every state."""
    out = []
    shapes = {ckpt.entries[k].shape for k in slots.values()}
    if len(shapes) > 1:
        out.append(Problem("error", "bucket_shape", "states of one bucket disagree on the global shape: "
                           f"{sorted(map(list, shapes))}", key=slots[min(slots, key=str)]))
    ranks = {cp for _, cp in slots if cp is not None}
    if not ranks:
        return out
    cp = topo.cp if topo.cp is not None else max(ranks) + 1
    src = topo.source if topo.cp is not None else "the highest cp_rank present"
    for state in sorted({s for s, _ in slots}):
        for r in range(cp):
            if (state, r) not in slots:
                out.append(Problem("error", "folded_cp_rank", f"folded buffer state is missing for cp_rank {r} "
                                   f"(CP={cp} from {src})", key=replace(example, state=state).with_cp_rank(r)))
    for (_state, r), key in slots.items():
        if r is not None and r >= cp:
            out.append(Problem("error", "folded_cp_rank", f"cp_rank {r} is outside CP={cp} ({src})", key=key))
    return out


def _bucket_numel_table(obj: Any) -> dict[tuple[int, str, int], int] | None:
    """``(gbuf_idx, dtype tag, bucket_idx) -> numel`` from Megatron's per_bucket_numel object.

    Megatron stores a ShardedObject as ``torch.save([data])`` where ``data`` is a list over
    gbuf_idx of ``{(param_dtype, grad_dtype): [numel per bucket]}``.
    """
    if isinstance(obj, list) and len(obj) == 1 and isinstance(obj[0], list):
        obj = obj[0]
    if not isinstance(obj, list):
        return None
    table = {}
    for g, per_dtype in enumerate(obj):
        if not isinstance(per_dtype, dict):
            return None
        for dtypes, numels in per_dtype.items():
            if not (isinstance(dtypes, tuple) and len(dtypes) == 2 and all(type(d) is DType for d in dtypes)):
                return None
            if not isinstance(numels, list) or not all(type(n) is int for n in numels):
                return None
            for b, n in enumerate(numels):
                table[(g, dtype_tag(*dtypes), b)] = n
    return table


def _bucket_order(classes: dict[str, KeyClass], prefix: str, n: int) -> list[tuple[int, str, int]]:
    """Buckets of one dp_group_idx in (gbuf_idx, bucket_idx) order, as the optimizer keys name them."""
    return sorted({(c.opt.gbuf_idx, c.opt.dtype, c.opt.bucket_idx) for c in classes.values()
                   if c.opt is not None and c.opt.prefix == prefix and c.opt.dp_group_idx == n},
                  key=lambda s: (s[0], s[2]))


def _bucket_numel_from_tensor(ckpt: Checkpoint, entry: Entry, classes: dict[str, KeyClass],
                              pbn: tuple[str, int, bool]) -> dict[tuple[int, str, int], int] | str:
    """gtp_runtime's form: an int64 tensor of numels over (gbuf_idx, bucket_idx) in order."""
    if entry.dtype is None or entry.dtype.is_floating_point or entry.dtype.is_complex or len(entry.shape or ()) != 1:
        return f"is a {entry.dtype} tensor of shape {list(entry.shape or ())}, not a 1-D integer tensor"
    values = _int_vector(ckpt, entry)
    if isinstance(values, str):
        return values
    order = _bucket_order(classes, pbn[0], pbn[1])
    if len(values) != len(order):
        return f"holds {len(values)} values but the keys name {len(order)} buckets for dp_group_idx_{pbn[1]}"
    return dict(zip(order, values))


def _int_vector(ckpt: Checkpoint, entry: Entry) -> list[int] | str:
    """A small 1-D integer tensor's values assembled from its chunks (numpy, no torch), or why not."""
    assert entry.shape is not None and entry.dtype is not None
    n = entry.shape[0]
    if n * entry.itemsize > CHEAP_OBJECT_BYTES:
        return f"holds {n} values, more than a bucket table could ({CHEAP_OBJECT_BYTES} bytes)"
    values = np.zeros(n, dtype=np.int64)
    covered = np.zeros(n, dtype=bool)
    for c in entry.chunks:
        if len(c.offsets) != 1 or len(c.sizes) != 1 or c.offsets[0] + c.sizes[0] > n:
            return f"chunk {c.index} (offsets {list(c.offsets)}, sizes {list(c.sizes)}) leaves the shape [{n}]"
        lo, hi = c.offsets[0], c.offsets[0] + c.sizes[0]
        values[lo:hi] = load_elements(ckpt, entry, c)
        covered[lo:hi] = True
    missing = n - int(np.count_nonzero(covered))
    return f"{missing} of its values are in no chunk" if missing else values.tolist()


def check_bucket_numel(ckpt: Checkpoint, classes: dict[str, KeyClass], data: bool) -> list[Problem]:
    """Global numel of every bucket key equals ``per_bucket_numel_unpadded`` (and <= the padded).

    Two encodings exist: Megatron's byte object (``torch.save([data])``, see
    :func:`_bucket_numel_table`) and gtp_runtime's int64 tensor over (gbuf_idx, bucket_idx).
    """
    out: list[Problem] = []
    tables: dict[tuple[str, int, bool], dict[tuple[int, str, int], int]] = {}
    jobs: list[tuple[str, KeyClass]] = []
    for key, cls in classes.items():
        if cls.category != BUCKET_NUMEL or cls.pbn is None:
            continue
        entry = ckpt.entries[key]
        if any(c.storage is None for c in entry.chunks):
            continue  # check_storage reports it
        if not data and entry.stored_bytes > CHEAP_OBJECT_BYTES:
            out.append(Problem("info", "bucket_numel", "not decoded (large object); run with --data", key=key))
            continue
        jobs.append((key, cls))

    def decode(job: tuple[str, KeyClass]) -> dict[tuple[int, str, int], int] | str | FormatError:
        key, cls = job
        entry = ckpt.entries[key]
        assert cls.pbn is not None
        try:
            if entry.kind == TENSOR:
                return _bucket_numel_from_tensor(ckpt, entry, classes, cls.pbn)
            return _bucket_numel_table(load_plain(ckpt, entry)) or (
                "object is not a list of {(param_dtype, grad_dtype): [numel, ...]} per gbuf")
        except FormatError as err:
            return err

    # one small read per model-parallel rank's table: on a bucket each was a round trip after the other
    # (two of a 26.5 MB checkpoint's 37 ms before its data requests; hundreds at tp x gtp_remat of 128)
    with ThreadPoolExecutor(max(1, min(BUCKET_TABLE_READS, len(jobs))), thread_name_prefix="bucket-numel") as pool:
        decoded = list(pool.map(decode, jobs))
    for (key, cls), table in zip(jobs, decoded):
        assert cls.pbn is not None
        if isinstance(table, FormatError):
            out.append(Problem("error", "bucket_numel", table.message, key=key,
                               file=table.file if isinstance(table, ChunkError) else None))
            continue
        if isinstance(table, str):
            out.append(Problem("error", "bucket_numel", table, key=key))
            continue
        tables[cls.pbn] = table
    for (prefix, n, unpadded), table in tables.items():
        if unpadded:
            out += _compare_buckets(ckpt, classes, prefix, n, table, tables.get((prefix, n, False)))
    return out


def _compare_buckets(ckpt: Checkpoint, classes: dict[str, KeyClass], prefix: str, n: int,
                     unpadded: dict[tuple[int, str, int], int],
                     padded: dict[tuple[int, str, int], int] | None) -> list[Problem]:
    out = []
    name = per_bucket_numel_key(n, unpadded=True).replace(OPT_PREFIX, prefix, 1)
    seen = set()
    for key, cls in classes.items():
        opt = cls.opt
        if opt is None or opt.prefix != prefix or opt.dp_group_idx != n:
            continue
        slot = (opt.gbuf_idx, opt.dtype, opt.bucket_idx)
        seen.add(slot)
        want = unpadded.get(slot)
        shape = ckpt.entries[key].shape
        if want is None:
            out.append(Problem("error", "bucket_numel", f"bucket is not listed in {name}", key=key))
        elif shape != (want,):
            out.append(Problem("error", "bucket_numel", f"global shape {list(shape or ())} but {name} says "
                               f"[{want}]", key=key))
    for slot in sorted(unpadded.keys() - seen):
        out.append(Problem("warning", "bucket_numel", f"{name} lists gbuf {slot[0]} {slot[1]} bucket {slot[2]} "
                           "but no key stores it"))
    if padded is not None:
        for slot, want in unpadded.items():
            have = padded.get(slot)
            if have is None or have < want:
                out.append(Problem("error", "bucket_numel", f"per_bucket_numel {have} < unpadded {want} for gbuf "
                                   f"{slot[0]} {slot[1]} bucket {slot[2]}"))
    return out


def check_manifest_files(ckpt: Checkpoint, data: bool, digests: dict[str, dict[str, str]] | None = None,
                         covered: set[str] | frozenset[str] = frozenset()) -> list[Problem]:
    """Sizes (always) and checksums (with --data) of the files the manifest lists.

    ``digests`` holds what the data pass already computed while reading the data files; the
    other listed files (``.metadata``, side files) are hashed here. ``covered``: data files whose
    every byte the chunk hashes checked (:func:`gtp_format.check.hashes.covered_files`); their file
    checksum is not computed again.
    """
    files = ckpt.manifest.files if ckpt.manifest is not None else None
    if files is None:
        return []  # no manifest, or its files section was refused (already a problem of the read)
    out: list[Problem] = []
    for rel, spec in files.items():
        reason = unsafe_reason(rel)
        if reason is not None:
            out.append(Problem("error", "manifest", reason, file=str(rel)))
            continue
        try:
            size = file_size(ckpt.store, rel)
        except ChunkError as err:
            out.append(Problem("error", "manifest", err.message, file=rel))
            continue
        if spec.size != size:
            out.append(Problem("error", "size", f"file is {size} bytes but the manifest says {spec.size}",
                               file=rel))
        if not data or rel in covered:
            continue
        algos = list(spec.checksums)
        for a in algos:
            if a not in HASHERS:
                # an error, not a note: a writer (or an attacker) naming an algorithm we cannot compute must
                # not turn the one integrity check the manifest offers into a silent skip
                out.append(Problem("error", "checksum", f"checksum algorithm {a!r} is not one this ckpt can check "
                                   f"({', '.join(sorted(HASHERS))}); the file's integrity is unverified: rewrite the "
                                   "manifest with a supported algorithm or upgrade ckpt", file=rel))
        known = [a for a in algos if a in HASHERS]
        if not known:
            continue
        have = (digests or {}).get(rel, {})
        if not all(a in have for a in known):
            try:
                with open_regular(ckpt.store, rel) as f:
                    sparse = f.sparse_message(rel)  # type: ignore[attr-defined]  # an object has no holes
                    if sparse is not None:  # hashing holes is time spent on bytes nobody wrote
                        raise ChunkError(sparse, file=rel)
                    have = file_digests(f, known)
            except ChunkError as err:
                out.append(Problem("error", "checksum", err.message, file=rel))
                continue
        for a in known:
            want = spec.checksums[a].lower()
            if have[a] != want:
                out.append(Problem("error", "checksum", f"{a} is {have[a]} but the manifest says {want}", file=rel))
    for name in sorted(ckpt.data_files.keys() - files.keys()):
        out.append(Problem("warning", "manifest", "data file is not listed in the manifest", file=name))
    return out


def verify(ckpt: Checkpoint, *, data: bool = False, cp_size: int | None = None,
           progress: Progress | None = None, workers: int | None = None, folded: bool = False) -> VerifyResult:
    """Run every check that applies; with ``data`` also decode all chunks and hash files (on ``workers`` threads)."""
    result = VerifyResult()
    classes = classify_all(ckpt)
    topo = topology_view(ckpt.manifest, cp_size, ckpt=ckpt, folded=folded)
    steps: list[tuple[str, Callable[[], list[Problem]]]] = [
        ("metadata", lambda: list(ckpt.notes)),
        ("geometry", lambda: check_geometry(ckpt)),
        ("storage", lambda: check_storage(ckpt)),
        ("optimizer", lambda: check_optimizer(ckpt, classes, topo)),
        ("bucket_numel", lambda: check_bucket_numel(ckpt, classes, data)),
    ]
    m = ckpt.manifest
    if m is not None:  # the manifest's checks run only where there is one: the list names what ran
        steps.append(("manifest_keys", lambda: check_manifest_keys(ckpt)))
        if m.optimizer is not None and m.buffers is not None:
            steps.append(("param_optimizers", lambda: check_param_optimizers(ckpt)))
        if m.buffers is not None:
            steps.append(("bucket_layout", lambda: check_canonical_layout(ckpt)))
            steps.append(("key_dtype", lambda: check_key_dtypes(ckpt)))
    for name, step in steps:
        result.checks.append(name)
        result.problems += step()
    result.stats = {
        "keys": len(ckpt.entries),
        "chunks": ckpt.chunk_count(),
        "data_files": len(ckpt.data_files),
        "topology": topo.describe(),
    }
    digests = None
    records = read_records(ckpt)
    matched: dict[tuple[str, int], ChunkRecord] = {}
    if records is not None:
        result.checks.append("chunk_records")
        matched, found = match_records(ckpt, records)
        result.problems += found
        if not data:  # --data counts every element instead
            result.problems += stats_nonfinite(records, classes)
    listing, found = read_integrity(ckpt)  # megatron-core's integrity.json, when the save wrote one
    result.problems += found
    covered = covered_files(ckpt, matched) if data else set()  # every byte under a chunk hash
    if data:
        digests = data_steps(ckpt, result, classes, matched, covered, listing, progress, workers)
    if m is not None and m.files is not None:
        result.checks.append("manifest_files")
        result.problems += check_manifest_files(ckpt, data, digests, covered)
    if listing is not None:
        result.checks.append("megatron_integrity")
        result.problems += check_integrity(ckpt, listing, data, digests)
    if data:
        result.checks.append("data")
    order = {s: i for i, s in enumerate(("error", "warning", "info"))}
    result.problems.sort(key=lambda p: order.get(p.severity, 3))
    return result

