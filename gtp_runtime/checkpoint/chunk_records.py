"""Chunk records at save: statistics from the tensors before the write, hashes as the bytes are written.

Statistics are taken from the state the save is about to write, where the elements already are:
on CPU through the format package's numpy code (:func:`gtp_format.integrity.stats.element_stats`,
a zero-copy view of the tensor), on CUDA with torch on the device *before* DCP copies the chunk to
the host, so the GPU reduces and one small tensor of results crosses PCIe per chunk. The hashes
of ``torch_dist`` files are computed by the ``O_DIRECT`` sink from the bytes it writes
(:mod:`gtp_runtime.checkpoint.direct_fs`, :func:`records_from_segments`): nothing is read back.
The safetensors layout (written by the ``safetensors`` library, not the sink) still reads each file
back once (:func:`record_own_files`, :func:`gtp_format.integrity.record_file.record_file`), as
both did before; that read is the reference the sink's records are tested against.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from gtp_format.dtypes import from_torch
from gtp_format.integrity.record_file import Span, record_file
from gtp_format.integrity.records import ChunkRecord
from gtp_format.integrity.stats import BLOCK, ChunkStats, element_stats, has_stats
from gtp_format.manifest import FileEntry
from gtp_format.names import chunk_tensor_name
from gtp_format.reader.safetensors_reader import read_header
from gtp_format.scan import carrier
from gtp_runtime.checkpoint.dcp_chunks import Chunks

ChunkId = tuple[str, tuple[int, ...]]


def device_stats(t: torch.Tensor) -> ChunkStats | None:
    """:class:`ChunkStats` computed with torch where ``t`` lives (the CUDA path; also runs on CPU).

    Block by block in fp64 so the working memory is bounded; the counts and sums stay on the
    device and are copied back once, as one small tensor.
    """
    dtype = from_torch(t.dtype)
    if not has_stats(dtype):
        return None
    x = t.detach().reshape(-1)
    acc = torch.zeros(5, dtype=torch.float64, device=x.device)  # nan, +inf, -inf, zeros, sumsq
    lo = torch.full((), float("inf"), dtype=torch.float64, device=x.device)
    hi = torch.full((), float("-inf"), dtype=torch.float64, device=x.device)
    step = BLOCK * 64
    for i in range(0, x.numel(), step):
        b = x[i:i + step].to(torch.float64)
        finite = torch.isfinite(b)
        fin = torch.where(finite, b, 0.0)
        acc += torch.stack([torch.isnan(b).sum(), (b == float("inf")).sum(), (b == float("-inf")).sum(),
                            (finite & (b == 0)).sum(), (fin * fin).sum()]).to(torch.float64)
        lo = torch.minimum(lo, torch.where(finite, b, float("inf")).min())
        hi = torch.maximum(hi, torch.where(finite, b, float("-inf")).max())
    nan, posinf, neginf, zeros, sumsq = acc.tolist()
    lo_v, hi_v = float(lo), float(hi)
    some = lo_v <= hi_v
    return ChunkStats(x.numel(), int(nan), int(posinf), int(neginf), int(zeros), lo_v if some else None,
                      hi_v if some else None, sumsq)


def tensor_stats(t: torch.Tensor) -> ChunkStats | None:
    if t.is_cuda:
        return device_stats(t)
    dtype = from_torch(t.dtype)
    if not has_stats(dtype):
        return None
    c = t.detach().contiguous()
    raw = c.view(torch.uint8).numpy() if c.numel() else torch.empty(0, dtype=torch.uint8).numpy()
    return element_stats(raw.view(carrier(dtype)), dtype)


def state_stats(sd: dict[str, Any]) -> dict[ChunkId, ChunkStats | None]:
    """Statistics of every tensor chunk this rank is about to save (byte objects have none)."""
    out: dict[ChunkId, ChunkStats | None] = {}
    with torch.no_grad():
        for key, value in sd.items():
            if isinstance(value, Chunks):
                for offsets, t in value.chunks.items():
                    out[(key, tuple(offsets))] = tensor_stats(t)
            elif isinstance(value, torch.Tensor):
                out[(key, (0,) * value.dim())] = tensor_stats(value)
    return out


def start_state_stats(sd: dict[str, Any]) -> Callable[[], dict[ChunkId, ChunkStats | None]]:
    """Start :func:`state_stats`; call the result (after the write) to get them.

    On CUDA they are computed now, on the device, before DCP copies anything to the host. On CPU
    they run on a thread while DCP writes: numpy releases the GIL, and the write spends most of its
    time in ``torch.save``'s copy and the fsyncs, so the statistics mostly fill idle time instead of
    adding to the save (``benchmarks/bench_save_integrity.py``). The tensors are only read by both.
    """
    if any(t.is_cuda for v in sd.values() if isinstance(v, Chunks) for t in v.chunks.values()):
        done = state_stats(sd)
        return lambda: done
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["stats"] = state_stats(sd)
        except BaseException as e:  # re-raised in the caller's thread
            box["error"] = e

    thread = threading.Thread(target=run, name="gtp-chunk-stats", daemon=True)
    thread.start()

    def join() -> dict[ChunkId, ChunkStats | None]:
        thread.join()
        if "error" in box:
            raise box["error"]
        return box["stats"]

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
