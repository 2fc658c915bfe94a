"""Data files of the two layouts, written one chunk at a time with their CRC-32C on the way.

* ``torch_dist``: ``__{i}_0.distcp`` is a run of complete ``torch.save`` blobs, one per chunk,
  exactly as DCP's ``FileSystemWriter`` lays them out; ``.metadata`` is the pickled DCP
  ``Metadata`` that ``FileSystemWriter.finish`` writes, so ``dcp.load`` and the runtime's
  allow-listing reader take it as their own. Both are written without torch
  (:mod:`gtp_format.writer`): byte for byte what ``torch.save`` writes, and the same objects
  once unpickled.
* ``safetensors``: ``__{i}_0.safetensors`` holds chunks named ``{key}@{offsets}`` plus
  ``index.json`` (:mod:`gtp_runtime.checkpoint.safetensors_storage`'s layout). The header is known
  from the plan before any element is read, so the file is streamed without torch.

Each file is written by one thread through a :class:`gtp_format.writer.sink.Sink` (``O_DIRECT`` from aligned
staging buffers, a writer thread per file: see there for the measured reason); the checksum is
computed from the bytes as they are handed in, so no file is read back. Every file is fsynced
before the folder is committed.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ckpt_tool.copying.plan import OutChunk
from gtp_format.dtypes import DType
from gtp_format.hashing import CRCS, crc32
from gtp_format.integrity.hash import chunk_digest
from gtp_format.integrity.records import ChunkRecord
from gtp_format.integrity.stats import ChunkStats, StatsStream, has_stats, zero_stats
from gtp_format.manifest import FileEntry
from gtp_format.names import GTP_INDEX_VERSION, chunk_tensor_name
from gtp_format.writer.dcp_metadata import metadata_bytes
from gtp_format.writer.sink import STAGE, SharedFile, Sink
from gtp_format.writer.torch_blob import TensorBlob


class Zeros:
    """What a :data:`ZeroableFn` returns for a chunk it knows to be all zero bits (a fresh optimizer's Adam
    moments): :func:`write_distcp` writes its ``nbytes`` zeros without building or reading them and takes its
    checks' values from constants (the zip CRC-32 from the zero-byte operator,
    :func:`~gtp_format.integrity.stats.zero_stats`, :meth:`~gtp_format.writer.sink.Sink.write_zeros`): the same
    bytes and records as an array of the zeros gives."""

    __slots__ = ("nbytes",)

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes


DataFn = Callable[[OutChunk], np.ndarray]
ZeroableFn = Callable[[OutChunk], "np.ndarray | Zeros"]


def _chunk_stats(arr: np.ndarray, dtype: DType) -> StatsStream | None:
    """The statistics stream of a chunk's elements (``None``: its dtype has none, or ``arr`` is not its
    stored elements, e.g. a byte object's values): what :func:`gtp_format.integrity.record_file.record_parts`
    computes, fed piece by piece."""
    return StatsStream(dtype) if has_stats(dtype) and arr.dtype.itemsize == dtype.itemsize else None


def _segment(out: Sink, start: int, end: int) -> str:
    """The chunk hash of the bytes ``[start, end)`` the sink hashed between two cuts (an empty chunk has none)."""
    return out.segments.pop((start, end)) if end > start else chunk_digest(b"")


class _Body:
    """What a blob's body feeds piece by piece besides the sink's own hashes: the zip record's CRC-32 (unless
    the caller knows it) and the chunk's statistics (``stats``, if any)."""

    def __init__(self, known: int | None, stats: StatsStream | None) -> None:
        self.crc, self.hash, self.stats = (0 if known is None else known), known is None, stats
        self.reads = self.hash or stats is not None

    def __call__(self, piece: memoryview) -> None:
        if self.hash:
            self.crc = crc32(piece, self.crc)
        if self.stats is not None:
            self.stats.update(piece)

    def result(self) -> ChunkStats | None:
        return None if self.stats is None else self.stats.result()


def write_distcp(path: Path, chunks: list[OutChunk], data: ZeroableFn, advance: Callable[[int], None],
                 stage: int = STAGE, records: list[ChunkRecord] | None = None,
                 known_crc: Callable[[OutChunk], int | None] | None = None
                 ) -> tuple[FileEntry, list[tuple[OutChunk, int, int]]]:
    """One ``.distcp`` file; returns its entry and ``(chunk, offset, length)`` per blob.

    Each blob is :class:`gtp_format.writer.torch_blob.TensorBlob`'s head, the chunk's bytes
    straight from the array that holds them, and its tail, handed to a :class:`gtp_format.writer.sink.Sink`
    (``stage`` bytes of staging). Every check that reads the bytes takes them in the sink's pieces
    (:data:`gtp_format.writer.sink.PIECE`, 1 MiB), one piece after another, while the piece is in the CPU
    cache: the file's CRC-32C, the blob's record hash (the sink's segment between two cuts), the zip
    record's CRC-32, the chunk statistics, then the copy into the staging buffer; nothing is read back.
    Each of them was a pass of its own over the whole chunk (up to 64 MiB) before: the fused loop took
    a quarter less CPU (measured in docs/performance.md). The CRC-32 must be in the blob's tail, which
    follows the body, so the body is written before the tail is built.

    ``known_crc(chunk)`` (asked after ``data(chunk)``): the zip CRC-32 of the bytes ``data`` returned, when
    the caller already has it (a reshard copying a source chunk unchanged: ``Source.copied_crc``), else
    ``None``. ``records``: each chunk's record (hash of its blob, statistics of its elements) is appended.
    """
    with Sink(path, stage, segments=records is not None) as out:
        placed = write_blobs(out, chunks, None, data, advance, records, known_crc)
        return out.close(), placed


def write_blobs(out: Sink, chunks: list[OutChunk], blobs: list[TensorBlob] | None, data: ZeroableFn,
                advance: Callable[[int], None], records: list[ChunkRecord] | None = None,
                known_crc: Callable[[OutChunk], int | None] | None = None,
                ahead: Callable[[OutChunk], None] | None = None) -> list[tuple[OutChunk, int, int]]:
    """The blobs of ``chunks`` in order into ``out`` (at its position), as :func:`write_distcp` writes them;
    ``blobs``: each chunk's :class:`~gtp_format.writer.torch_blob.TensorBlob` made beforehand (a file written as
    runs places them by their sizes first), else made here; ``ahead(chunk)``: told of the first chunk, then of
    each next one before ``data`` is asked for the current (a read-ahead). ``(chunk, offset, length)`` per blob."""
    placed = []
    name = out.path.name
    if ahead is not None and chunks:
        ahead(chunks[0])
    for k, c in enumerate(chunks):
        if ahead is not None and k + 1 < len(chunks):
            ahead(chunks[k + 1])
        got = data(c)
        blob = TensorBlob(c.dtype, c.sizes) if blobs is None else blobs[k]
        if isinstance(got, Zeros):
            if got.nbytes != c.nbytes:
                raise AssertionError(f"{c.key}: produced {got.nbytes} bytes for {c.nbytes}")
            start = out.cut()
            out.write([blob.head])
            out.write_zeros(c.nbytes)
            out.write([blob.tail(CRCS["crc32"].zeros(0, c.nbytes))])
            end = out.cut()
            if records is not None:
                numel = c.nbytes // c.dtype.itemsize
                records.append(ChunkRecord(c.key, tuple(c.offsets), name, start, end - start,
                                           _segment(out, start, end), zero_stats(c.dtype, numel)))
            placed.append((c, start, end - start))
            advance(c.nbytes)
            continue
        arr = np.ascontiguousarray(got)
        if arr.nbytes != c.nbytes:
            raise AssertionError(f"{c.key}: produced {arr.nbytes} bytes for {c.nbytes}")
        body = memoryview(arr.reshape(-1).view(np.uint8))
        body_checks = _Body(known_crc(c) if known_crc is not None else None,
                            _chunk_stats(arr, c.dtype) if records is not None else None)
        start = out.cut()
        out.write([blob.head])
        out.write([body], body_checks if body_checks.reads else None)
        out.write([blob.tail(body_checks.crc)])
        end = out.cut()
        if records is not None:
            records.append(ChunkRecord(c.key, tuple(c.offsets), name, start, end - start,
                                       _segment(out, start, end), body_checks.result()))
        placed.append((c, start, end - start))
        advance(c.nbytes)
    return placed


@dataclass
class Run:
    """Chunks ``[first, last)`` of one ``.distcp`` file, whose blobs begin at byte ``start`` of it."""

    file: int
    first: int
    last: int
    start: int
    nbytes: int


def plan_runs(files: list[list[OutChunk]], run_bytes: int) -> tuple[list[list[TensorBlob]], list[int], list[Run]]:
    """Each file's blobs (made here: their sizes place every blob before any is written), sizes, and runs of
    about ``run_bytes`` bytes each (at least one chunk, cut at blob boundaries), for :func:`write_distcp_run`."""
    blobs: list[list[TensorBlob]] = []
    sizes: list[int] = []
    runs: list[Run] = []
    for i, chunks in enumerate(files):
        made = [TensorBlob(c.dtype, c.sizes) for c in chunks]
        blobs.append(made)
        lengths = [b.size() for b in made]
        total = sum(lengths)
        sizes.append(total)
        k = max(1, min(len(chunks), round(total / max(1, run_bytes))))
        pos, first, cuts = 0, 0, 0
        for j, n in enumerate(lengths):  # cut after the blob that takes the bytes so far past the next k-th
            pos += n
            if j + 1 < len(chunks) and pos * k >= total * (cuts + 1):
                runs.append(Run(i, first, j + 1, sum(lengths[:first]), sum(lengths[first:j + 1])))
                first, cuts = j + 1, cuts + 1
        runs.append(Run(i, first, len(chunks), sum(lengths[:first]), sum(lengths[first:])))
    return blobs, sizes, runs


def write_distcp_run(shared: SharedFile, run: Run, chunks: list[OutChunk], blobs: list[TensorBlob],
                     data: ZeroableFn, advance: Callable[[int], None], stage: int,
                     records: list[ChunkRecord] | None = None, ahead: Callable[[OutChunk], None] | None = None
                     ) -> tuple[tuple[int, FileEntry, list[tuple[int, bytes]]], list[tuple[OutChunk, int, int]]]:
    """One run of a ``.distcp`` file written as runs (:class:`gtp_format.writer.sink.SharedFile`): its blobs at
    their places; ``((start, run entry, edges), placed)`` for :meth:`SharedFile.finish`."""
    out = shared.run(run.start, stage, segments=records is not None)
    with out:
        placed = write_blobs(out, chunks[run.first:run.last], blobs[run.first:run.last], data, advance, records,
                             ahead=ahead)
        entry = out.close()
    if entry.size != run.nbytes:
        raise AssertionError(f"{shared.path}: a run of {entry.size} bytes where its blobs' sizes say {run.nbytes}")
    return (run.start, entry, out.edges), placed


def write_objects(path: Path, objects: dict[str, bytes], records: list[ChunkRecord] | None = None
                  ) -> list[tuple[str, str, int, int]]:
    """One ``.distcp`` file of byte objects (each a whole ``torch.save`` blob, as DCP stores them);
    returns ``(file, key, offset, length)`` per object (``records``: each object's record is appended:
    the hash of its blob, no statistics)."""
    placed, pos = [], 0
    with Sink(path, STAGE) as out:
        for key, blob in objects.items():
            out.write([blob])
            if records is not None:
                records.append(ChunkRecord(key, (), path.name, pos, len(blob), chunk_digest(blob), None))
            placed.append((path.name, key, pos, len(blob)))
            pos += len(blob)
        out.close()
    return placed


def write_distcp_metadata(path: Path, shapes: dict[str, Any], placed: list[tuple[str, Any, int, int]],
                          objects: list[str] | None = None) -> None:
    """``.metadata``: the pickled DCP ``Metadata`` that ``FileSystemWriter.finish`` writes
    (:mod:`gtp_format.writer.dcp_metadata`), without torch. ``placed`` holds ``(file, chunk, offset,
    length)`` per tensor chunk and ``(file, key, offset, length)`` per byte object in ``objects``."""
    rows = [(file, c, None, None, off, length) if isinstance(c, str) else
            (file, c.key, c.offsets, c.sizes, off, length) for file, c, off, length in placed]
    raw = metadata_bytes(shapes, rows, objects or [])
    with open(path, "xb") as f:
        f.write(raw)
        f.flush()
        os.fsync(f.fileno())


def _st_header(chunks: list[OutChunk]) -> bytes:
    header: dict[str, Any] = {"__metadata__": {"format": "gtp-ckpt-chunks"}}
    pos = 0
    for c in chunks:
        if c.dtype.safetensors is None:
            raise ValueError(f"{c.key}: dtype {c.dtype.name} has no safetensors code")
        header[chunk_tensor_name(c.key, c.offsets)] = {"dtype": c.dtype.safetensors, "shape": list(c.sizes),
                                                       "data_offsets": [pos, pos + c.nbytes]}
        pos += c.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def write_safetensors(path: Path, chunks: list[OutChunk], data: DataFn, advance: Callable[[int], None],
                      stage: int = STAGE, records: list[ChunkRecord] | None = None) -> FileEntry:
    """One safetensors data file, header first (known from the plan), then each chunk's bytes
    (``records``: each chunk's record is appended; hash and statistics piece by piece, as in
    :func:`write_distcp`)."""
    with Sink(path, stage, segments=records is not None) as out:
        out.write([_st_header(chunks)])
        for c in chunks:
            arr = np.ascontiguousarray(data(c))
            if arr.nbytes != c.nbytes:
                raise AssertionError(f"{c.key}: produced {arr.nbytes} bytes for {c.nbytes}")
            stats = _chunk_stats(arr, c.dtype) if records is not None else None
            start = out.cut()
            out.write([arr.reshape(-1).view(np.uint8)], None if stats is None else stats.update)
            end = out.cut()
            if records is not None:
                records.append(ChunkRecord(c.key, tuple(c.offsets), path.name, start, end - start,
                                           _segment(out, start, end), None if stats is None else stats.result()))
            advance(c.nbytes)
        return out.close()


def safetensors_index(shapes: dict[str, Any], files: dict[str, list[OutChunk]]) -> bytes:
    keys: dict[str, Any] = {k: {"dtype": f"torch.{dt.name}", "shape": list(shape), "chunks": []}
                            for k, (shape, dt) in shapes.items()}
    for file, chunks in files.items():
        for c in chunks:
            keys[c.key]["chunks"].append({"offsets": list(c.offsets), "sizes": list(c.sizes), "file": file,
                                          "name": chunk_tensor_name(c.key, c.offsets)})
    return json.dumps({"version": GTP_INDEX_VERSION, "keys": keys}).encode()
