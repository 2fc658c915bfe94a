"""What a reshard writes: every chunk of the target checkpoint, and where its elements come from.

The plan is pure arithmetic over two per-parameter views (:mod:`gtp_format.views`), source and
target, and reads no data. Each :class:`OutChunk` is either a box of one parameter's full tensor
(for one state: fp32 master ``param``, ``exp_avg``, ``exp_avg_sq``, or the model ``weight``),
zeros (GTP tail padding rows, alignment gaps between params in a bucket), or a small vector of
integers (``per_bucket_numel``). Chunks are cut into row blocks of at most ``max_chunk_bytes``, so
the largest array any worker holds is bounded by the memory budget, not by the largest parameter.

Chunk granularity is free: the runtime loads through DCP, which reads the overlap of whatever
chunks are stored with the boxes a rank asks for, so the target need not repeat the per-rank
chunking a training run would have written.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ckpt_tool.copying import WEIGHT_STATE
from gtp_format.dtypes import DType, by_name
from gtp_format.manifest import Manifest
from gtp_format.names import STATES
from gtp_format.views.ours import bucket_numels, bucket_refs, param_views
from gtp_format.views.records import Holder, ParamView, full_box

FP32 = by_name("float32")
INT64 = by_name("int64")


@dataclass(frozen=True)
class OutChunk:
    key: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    dtype: DType
    param: str | None = None  # source parameter; None: zeros, or ``values``
    state: str | None = None
    box: tuple[tuple[int, ...], tuple[int, ...]] | None = None  # in the parameter's full tensor
    values: tuple[int, ...] | None = None
    copy: bool = False  # the same box of the source's key ``key`` as stored (a model buffer: no view, no state)

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass
class Plan:
    chunks: list[OutChunk]
    shapes: dict[str, tuple[tuple[int, ...], DType]]  # key -> (global shape, dtype)

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.chunks)


def dtype_of(text: str) -> DType:
    return by_name(text.removeprefix("torch."))


def row_blocks(rows: int, row_elems: int, itemsize: int, max_bytes: int) -> list[tuple[int, int]]:
    step = max(1, max_bytes // max(1, row_elems * itemsize))
    return [(a, min(rows, a + step)) for a in range(0, rows, step)]


def holder_chunks(view: ParamView, h: Holder, state: str, max_bytes: int, full_row: int) -> list[OutChunk]:
    """Chunks of one holder's slice of one optimizer key (1-D) or, for WEIGHT_STATE, of the model key."""
    tail = h.spec.local_shape[1:]
    row = math.prod(tail)
    fo, fs = full_box(h.spec)
    rows, valid = h.spec.local_shape[0], h.spec.valid_rows
    out = []
    weight = state == WEIGHT_STATE
    dt = dtype_of(view.param_dtype) if weight else FP32
    g = h.spec.global_offset
    for a, b in row_blocks(valid, full_row, dt.itemsize, max_bytes):
        box = ((fo[0] + a, *fo[1:]), (b - a, *fs[1:]))
        if weight:
            out.append(OutChunk(view.name, (g[0] + a, *g[1:]), (b - a, *tail), dt, view.name, WEIGHT_STATE, box))
        else:
            out.append(OutChunk(h.ref.key(state), (h.start + a * row,), ((b - a) * row,), dt, view.name, state, box))
    for a, b in row_blocks(rows - valid, full_row, dt.itemsize, max_bytes):
        a, b = a + valid, b + valid
        if weight:
            out.append(OutChunk(view.name, (g[0] + a, *g[1:]), (b - a, *tail), dt))
        else:
            out.append(OutChunk(h.ref.key(state), (h.start + a * row,), ((b - a) * row,), dt))
    return out


def gaps(numel: int, used: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The ranges ``[a, b)`` of ``[0, numel)`` that no ``used`` range covers (a bucket's alignment gaps)."""
    out, pos = [], 0
    for a, b in sorted(used):
        if a > pos:
            out.append((pos, a))
        pos = max(pos, b)
    if pos < numel:
        out.append((pos, numel))
    return out


def plan_target(target: Manifest, max_chunk_bytes: int, views: dict[str, ParamView] | None = None) -> Plan:
    """Every chunk of a ``dp_reshardable`` checkpoint laid out as ``target`` says.

    ``views``: ``target``'s per-parameter views when the caller built them already (reshard
    compares them with the source's first), so they are built once per run.
    """
    views = param_views(target) if views is None else views
    chunks: list[OutChunk] = []
    shapes: dict[str, tuple[tuple[int, ...], DType]] = {}
    used: dict[str, list[tuple[int, int]]] = {}
    for view in views.values():
        full_row = math.prod(view.full_shape[1:])
        shapes[view.name] = (view.global_shape, dtype_of(view.param_dtype))
        for h in view.primaries:
            chunks.extend(holder_chunks(view, h, WEIGHT_STATE, max_chunk_bytes, full_row))
        for h in view.holders:
            used.setdefault(h.ref.key(STATES[0]), []).append((h.start, h.start + h.numel))
            for state in STATES:
                chunks.extend(holder_chunks(view, h, state, max_chunk_bytes, full_row))
    for ref in bucket_refs(target):
        for a, b in gaps(ref.numel_unpadded, used.get(ref.key(STATES[0]), [])):
            for state in STATES:
                step = max(1, max_chunk_bytes // FP32.itemsize)
                for s in range(a, b, step):
                    chunks.append(OutChunk(ref.key(state), (s,), (min(b, s + step) - s,), FP32))
        for state in STATES:
            shapes[ref.key(state)] = ((ref.numel_unpadded,), FP32)
    for key, values in bucket_numels(target).items():
        shapes[key] = ((len(values),), INT64)
        chunks.append(OutChunk(key, (0,), (len(values),), INT64, values=tuple(values)))
    return Plan(chunks, shapes)


def split_files(chunks: list[OutChunk], files: int) -> list[list[OutChunk]]:
    """Cut the chunk list, in order, into ``files`` runs of about equal bytes (none empty)."""
    total = sum(c.nbytes for c in chunks)
    files = max(1, min(files, len(chunks)))
    out: list[list[OutChunk]] = [[]]
    acc = 0
    for c in chunks:
        if acc >= total * len(out) / files and len(out) < files and out[-1]:
            out.append([])
        out[-1].append(c)
        acc += c.nbytes
    return out


def read_order(parts: list[list[OutChunk]], workers: int) -> list[OutChunk]:
    """The chunks of ``parts`` (one file each) in the order ``workers`` threads reach them, when the files run
    as :func:`ckpt_tool.copying.engine.run_files` runs them (the first ``workers`` at once, the next file on
    the first thread free) and every thread copies at the same byte rate.

    Why: a bucket's prefetch fetches in one order within a budget (:class:`gtp_format.storage.prefetch.
    PlanPrefetch`); the files' chunks one file after another would put a second thread's first chunk behind
    the whole first file, fetched only on demand, past the budget.
    """
    import heapq

    heap: list[tuple[int, int, int]] = []  # (bytes copied by the time the file's thread reaches it, file, chunk)
    started = min(workers, len(parts))
    for f in range(started):
        heapq.heappush(heap, (0, f, 0))
    out: list[OutChunk] = []
    while heap:
        t, f, i = heapq.heappop(heap)
        if i == len(parts[f]):  # this file is done: its thread takes the next one
            if started < len(parts):
                heapq.heappush(heap, (t, started, 0))
                started += 1
            continue
        out.append(parts[f][i])
        heapq.heappush(heap, (t + parts[f][i].nbytes, f, i + 1))
    return out
