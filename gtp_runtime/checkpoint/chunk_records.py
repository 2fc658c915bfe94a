"""Chunk records at save: statistics and hashes of the bytes as they are written, or on the device first.

Statistics are taken where the elements already are: on CPU through the format package's compiled
loop (:class:`gtp_format.integrity.stats.StatsStream`), fed by the ``torch_dist`` sink with each piece
it hashes and copies (:class:`SinkStats`), or from a zero-copy view of the tensor
(:func:`tensor_stats`); on CUDA with torch on the device *before* DCP copies the chunk to the host, so
the GPU reduces and one small tensor of results crosses PCIe per chunk. The hashes
of ``torch_dist`` files are computed by the ``O_DIRECT`` sink from the bytes it writes
(:mod:`gtp_runtime.checkpoint.direct_fs`, :func:`records_from_segments`): nothing is read back.
The safetensors layout (written by the ``safetensors`` library, not the sink) still reads each file
back once (:func:`record_own_files`, :func:`gtp_format.integrity.record_file.record_file`), as
both did before; that read is the reference the sink's records are tested against.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch

from gtp_format.dtypes import from_torch
from gtp_format.integrity.record_file import Span, record_file
from gtp_format.integrity.records import ChunkRecord
from gtp_format.integrity.stats import ChunkStats, StatsStream, element_stats, has_stats, warm_up
from gtp_format.manifest import FileEntry
from gtp_format.names import chunk_tensor_name
from gtp_format.reader.safetensors_reader import read_header
from gtp_format.scan import carrier
from gtp_runtime.checkpoint.dcp_chunks import Chunks

ChunkId = tuple[str, tuple[int, ...]]
T = TypeVar("T")


def _exact_device_stats(t: torch.Tensor) -> ChunkStats | None:
    """The statistics of a chunk that holds NaN or Inf, with torch where ``t`` lives: every value masked
    (finite-only min, max and sum of squares), block by block in fp64 so the working memory is bounded."""
    dtype = from_torch(t.dtype)
    if not has_stats(dtype):
        return None
    x = t.detach().reshape(-1)
    acc = torch.zeros(5, dtype=torch.float64, device=x.device)  # nan, +inf, -inf, zeros, sumsq
    lo = torch.full((), float("inf"), dtype=torch.float64, device=x.device)
    hi = torch.full((), float("-inf"), dtype=torch.float64, device=x.device)
    for i in range(0, x.numel(), _STEP):
        b = x[i:i + _STEP].to(torch.float64)
        finite = torch.isfinite(b)
        fin = torch.where(finite, b, 0.0)
        acc += torch.stack([torch.isnan(b).sum(), (b == float("inf")).sum(), (b == float("-inf")).sum(),
                            (finite & (b == 0)).sum(), (fin * fin).sum()]).to(torch.float64)
        lo = torch.minimum(lo, torch.where(finite, b, float("inf")).min())
        hi = torch.maximum(hi, torch.where(finite, b, float("-inf")).max())
    nan, posinf, neginf, zeros, sumsq = acc.tolist()
    return _stats(x.numel(), [nan, posinf, neginf, zeros, sumsq, float(lo), float(hi)])


_STEP = 1 << 24  # elements per fp64 block on the device: 128 MiB of fp64 working memory


def _stats(numel: int, v: list[float]) -> ChunkStats:
    nan, posinf, neginf, zeros, sumsq, lo, hi = v
    some = lo <= hi
    return ChunkStats(numel, int(nan), int(posinf), int(neginf), int(zeros), lo if some else None,
                      hi if some else None, sumsq)


def _launch(t: torch.Tensor) -> torch.Tensor:
    """Seven fp64 figures of ``t``, left on its device (nothing waits for them): counts of NaN, +Inf,
    -Inf and zeros, the sum of squares, min, max. Min, max and the sum are over every value, so they
    are the finite-only figures exactly when the three counts are zero; a chunk where one is not is
    taken again by :func:`_exact_device_stats` (the rare case: a checkpoint that ``verify`` flags).

    Why this shape (the fast path): the counts and ``aminmax`` read the chunk in its own dtype, one
    pass each; only the sum of squares needs fp64 (one cast and one dot per block), where the masked
    path made about a dozen fp64 passes per block and a host round trip per chunk."""
    x = t.detach().reshape(-1)
    f64 = torch.float64
    if x.numel() == 0:
        return torch.tensor([0, 0, 0, 0, 0, float("inf"), float("-inf")], dtype=f64, device=x.device)
    if x.dtype == torch.bool:
        x = x.view(torch.uint8)
    zero = torch.zeros((), dtype=f64, device=x.device)
    if x.is_floating_point():
        nan, pos, neg = torch.isnan(x).sum(), (x == float("inf")).sum(), (x == float("-inf")).sum()
    else:
        nan = pos = neg = zero
    zeros = (x == 0).sum()
    lo, hi = torch.aminmax(x)
    sq = zero.clone()
    for i in range(0, x.numel(), _STEP):
        b = x[i:i + _STEP].to(f64)
        sq += torch.dot(b, b)
    return torch.stack([nan.to(f64), pos.to(f64), neg.to(f64), zeros.to(f64), sq, lo.to(f64), hi.to(f64)])


def device_stats(t: torch.Tensor) -> ChunkStats | None:
    """:class:`ChunkStats` computed with torch where ``t`` lives (the CUDA path; also runs on CPU)."""
    if not has_stats(from_torch(t.dtype)):
        return None
    with torch.no_grad():
        v = _launch(t).tolist()
    if v[0] or v[1] or v[2]:
        return _exact_device_stats(t)
    return _stats(t.numel(), v)


def tensor_stats(t: torch.Tensor) -> ChunkStats | None:
    if t.is_cuda:
        return device_stats(t)
    dtype = from_torch(t.dtype)
    if not has_stats(dtype):
        return None
    c = t.detach().contiguous()
    raw = c.view(torch.uint8).numpy() if c.numel() else torch.empty(0, dtype=torch.uint8).numpy()
    return element_stats(raw.view(carrier(dtype)), dtype)


def _state_chunks(sd: dict[str, Any]) -> list[tuple[ChunkId, torch.Tensor]]:
    out: list[tuple[ChunkId, torch.Tensor]] = []
    for key, value in sd.items():
        if isinstance(value, Chunks):
            out += [((key, tuple(offsets)), t) for offsets, t in value.chunks.items()]
        elif isinstance(value, torch.Tensor):
            out.append(((key, (0,) * value.dim()), value))
    return out


def state_stats(sd: dict[str, Any]) -> dict[ChunkId, ChunkStats | None]:
    """Statistics of every tensor chunk this rank is about to save (byte objects have none)."""
    with torch.no_grad():
        return {cid: tensor_stats(t) for cid, t in _state_chunks(sd)}


Stats = Callable[[], dict[ChunkId, ChunkStats | None]]


def _start_device_stats(sd: dict[str, Any], device: torch.device, sink: SinkStats | None = None) -> Stats:
    """Every CUDA chunk's figures queued on a stream of their own (after the training stream's work,
    so they see the finished step), without waiting: the save goes on (an async save's staging copy,
    a sync save's writer threads) while the GPU reduces, and one small pinned tensor comes back for
    all chunks. Calling the result waits for it (it must be called before the chunks may change).

    The kernels are queued from a thread of their own: queueing them (a few thousand launches at the
    main shape) took 0.23 s of the training thread before the write could start, measured on the H200
    (``bench_ckpt_async.py --only-records --stages``), about 1.6% of a 14 s save; on a thread they are
    queued while DCP plans and writes, which waits on the disk."""
    stream = torch.cuda.Stream(device=device)
    stream.wait_stream(torch.cuda.current_stream(device))  # here: the step that is finished now
    chunks = _state_chunks(sd)
    gpu = [(cid, t) for cid, t in chunks if t.is_cuda and has_stats(from_torch(t.dtype))]

    def queue() -> tuple[torch.cuda.Event, torch.Tensor | None]:
        torch.cuda.set_device(device)
        host = None
        with torch.no_grad(), torch.cuda.stream(stream):
            parts = torch.stack([_launch(t) for _, t in gpu]) if gpu else None
            if parts is not None:
                host = torch.empty(parts.shape, dtype=torch.float64, pin_memory=True)
                host.copy_(parts, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        return done, host

    queued = _on_thread(queue)

    def finish() -> dict[ChunkId, ChunkStats | None]:
        if sink is not None:
            sink.join()
        done, host = queued()
        done.synchronize()
        figures = dict(zip((cid for cid, _ in gpu), host.tolist() if host is not None else []))
        out: dict[ChunkId, ChunkStats | None] = {}
        with torch.no_grad():
            for cid, t in chunks:
                v = figures.get(cid)
                if v is None:  # a host tensor (the sink's, if it took them), or a dtype without statistics
                    out[cid] = sink.of(cid, t) if sink is not None else tensor_stats(t)
                elif v[0] or v[1] or v[2]:
                    out[cid] = _exact_device_stats(t)
                else:
                    out[cid] = _stats(t.numel(), v)
        return out

    return finish


@dataclass
class _Watched:
    """One write the sink recognised: the stream its pieces go through (``update``) and the chunks it is."""

    stream: StatsStream
    cids: list[ChunkId]

    def __post_init__(self) -> None:
        self.update = self.stream.update


class SinkStats:
    """The host chunks of a ``torch_dist`` save whose statistics the sink takes as it writes them.

    ``torch.save`` hands the stream a chunk's elements as one write over the tensor's own memory (the
    planner gives DCP each CPU chunk over its own bytes: :func:`pinned.exact_storage`), so a write whose
    address and length are a chunk's is that chunk, and each piece the sink hashes and copies also goes
    through :class:`StatsStream` while it is in the cache. Why: on a thread of their own the statistics
    read every chunk from memory a second time, beside the writer threads that read it for
    ``torch.save`` and the sink (``benchmarks/bench_save_integrity.py``). A chunk no write matched (a
    ``torch`` that cut the write, a view DCP cloned) is taken from its tensor after the write.
    """

    def __init__(self, sd: dict[str, Any]) -> None:
        self._chunks = _state_chunks(sd)
        self._want: dict[tuple[int, int], tuple[Any, list[ChunkId]]] = {}
        mixed: set[tuple[int, int]] = set()  # one memory under two dtypes: which one a write is, is unknown
        for cid, t in self._chunks:
            dtype = from_torch(t.dtype)
            if t.device.type == "cpu" and t.numel() and t.is_contiguous() and has_stats(dtype):
                key = (t.data_ptr(), t.numel() * t.element_size())
                held = self._want.setdefault(key, (dtype, []))
                held[1].append(cid)
                if held[0] is not dtype:
                    mixed.add(key)
        for key in mixed:  # taken from their tensors after the write
            del self._want[key]
        self.found: dict[ChunkId, ChunkStats] = {}
        self._lock = threading.Lock()
        # the loops loaded while DCP plans, not in the first piece a writer thread hands the sink
        self._warm = _on_thread(lambda: warm_up([dtype for dtype, _ in self._want.values()]))

    def start(self, data: memoryview) -> _Watched | None:
        """The statistics stream of the chunk(s) whose elements ``data`` is, or None."""
        if not self._want:
            return None
        hit = self._want.get((np.frombuffer(data, np.uint8).ctypes.data, data.nbytes))
        return None if hit is None else _Watched(StatsStream(hit[0]), hit[1])

    def finish(self, watched: _Watched) -> None:
        stats = watched.stream.result()
        with self._lock:
            for cid in watched.cids:
                self.found[cid] = stats

    def of(self, cid: ChunkId, t: torch.Tensor) -> ChunkStats | None:
        """``cid``'s statistics: the sink's, else from its tensor ``t`` now."""
        return self.found[cid] if cid in self.found else tensor_stats(t)

    def join(self) -> None:
        """Wait for the warm-up thread (no thread outlives the save)."""
        self._warm()

    def collect(self) -> dict[ChunkId, ChunkStats | None]:
        """Every chunk's statistics after the write: the sink's, else from the tensor now."""
        self.join()
        with torch.no_grad():
            return {cid: self.of(cid, t) for cid, t in self._chunks}


def start_state_stats(sd: dict[str, Any], sink: SinkStats | None = None) -> Stats:
    """Start :func:`state_stats`; call the result (after the write) to get them.

    On CUDA they are queued on the device now, on a stream of their own, before anything is copied
    to the host, and run beside the copies (:func:`_start_device_stats`). Host chunks that ``sink``
    watches get theirs from the sink as it writes them (:class:`SinkStats`). Otherwise (safetensors)
    they run on a thread while the library writes: numba's loop releases the GIL, and the write waits on
    the disk, so the statistics mostly fill idle time. The tensors are only read by all three.
    """
    cuda = next((t.device for _, t in _state_chunks(sd) if t.is_cuda), None)
    if cuda is not None:
        return _start_device_stats(sd, cuda, sink)
    if sink is not None:
        return sink.collect
    return _on_thread(lambda: state_stats(sd))


def _on_thread(fn: Callable[[], T]) -> Callable[[], T]:
    """Run ``fn`` on a thread of its own now; calling the result joins it and returns what it returned,
    or raises what it raised, in the caller's thread (so no thread outlives the save that started it)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # re-raised in the caller's thread
            box["error"] = e

    thread = threading.Thread(target=run, name="gtp-chunk-stats", daemon=True)
    thread.start()

    def join() -> T:
        thread.join()
        if "error" in box:
            raise box["error"]
        return box["value"]

    return join


def _spans(folder: Path, layout: str, storage: Any, files: list[str],
           stats: dict[ChunkId, ChunkStats | None]) -> dict[str, list[Span]]:
    """Each of ``files``' chunks with its byte range: the storage records of this rank's DCP write
    (``{MetadataIndex: _StorageInfo}``), or our safetensors headers."""
    out: dict[str, list[Span]] = {f: [] for f in files}
    if layout == "torch_dist":
        for index, info in storage.items():
            key, offsets = index.fqn, tuple(index.offset or ())
            if info.relative_path in out:
                out[info.relative_path].append(Span(key, offsets, info.offset, info.length, stats.get((key, offsets))))
        return out
    # safetensors (one file per rank): each chunk is the tensor ``{key}@{offsets}`` of this rank's file
    by_name = {chunk_tensor_name(key, offsets): (key, offsets) for key, offsets in stats}
    for rel in files:
        header, data_start = read_header(folder, rel, (folder / rel).stat().st_size)
        for name, spec in header.items():
            if name in by_name:
                lo, hi = spec["data_offsets"]
                key, offsets = by_name[name]
                out[rel].append(Span(key, offsets, data_start + lo, hi - lo, stats[(key, offsets)]))
    return out


def record_own_files(folder: Path, layout: str, storage: Any, files: list[Path],
                     stats: dict[ChunkId, ChunkStats | None]) -> tuple[dict[str, FileEntry], list[ChunkRecord]]:
    """The manifest entries and chunk records of the data files this rank wrote (one read of each)."""
    spans = _spans(folder, layout, storage, [p.name for p in files], stats)
    entries: dict[str, FileEntry] = {}
    records: list[ChunkRecord] = []
    for p in files:
        entries[p.name], recs = record_file(p, p.name, spans[p.name])
        records += recs
    return entries, records


def records_from_segments(folder: Path, storage: Any, files: list[str],
                          segments: dict[str, dict[tuple[int, int], str]],
                          stats: dict[ChunkId, ChunkStats | None]) -> list[ChunkRecord]:
    """The chunk records of ``torch_dist`` files the sink hashed as it wrote them (``segments``: per file,
    ``(start, stop) -> xxh3-128``). A chunk whose byte range is not one segment (DCP asked for its
    offset inside an item, which torch 2.13 does not do) is hashed from the file, so a record is
    always the hash of exactly its bytes."""
    records: list[ChunkRecord] = []
    for rel, spans in _spans(folder, "torch_dist", storage, files, stats).items():
        cut = segments.get(rel, {})
        late = []
        for s in spans:
            digest = cut.get((s.offset, s.offset + s.length))
            if digest is None:
                late.append(s)
            else:
                records.append(ChunkRecord(s.key, s.offsets, rel, s.offset, s.length, digest, s.stats))
        if late:
            records += record_file(folder / rel, rel, late)[1]
    return records
