"""The writers' one hook: hash a data file they just wrote, once, for its checksum and its chunk records.

Every writer already reads back each file it wrote for the manifest's CRC-32C; the chunk hashes
ride on that same read, so a save pays the xxh3-128 of its bytes (faster than reading them,
``benchmarks/bench_chunk_hash.py``) and no second read. Statistics come from the writer, which
has the elements in hand (on the GPU, before the copy, for the runtime): decoding what was just
written would cost a second pass over every element.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from gtp_format.dtypes import DType
from gtp_format.hashing import BLOCK, CRCS
from gtp_format.integrity.hash import chunk_hasher
from gtp_format.integrity.records import ChunkRecord
from gtp_format.integrity.stats import ChunkStats, element_stats
from gtp_format.manifest import HASH_ALGORITHM, FileEntry
from gtp_format.scan import carrier


class Span(NamedTuple):
    """One chunk the writer put into the file: its key, global offsets, byte range and statistics."""

    key: str
    offsets: tuple[int, ...]
    offset: int
    length: int
    stats: ChunkStats | None


def record_file(path: Path, rel: str, spans: list[Span]) -> tuple[FileEntry, list[ChunkRecord]]:
    """The file's manifest entry (size, CRC-32C) and one record per span, from one front-to-back read.

    Spans may overlap or leave gaps (a torch.save blob's header, safetensors' JSON header): each
    span's hash is over exactly its bytes. ``ValueError`` when a span lies past the end of the file
    (a writer bug, not bad input).
    """
    crc = CRCS[HASH_ALGORITHM]
    order = sorted(range(len(spans)), key=lambda i: (spans[i].offset, spans[i].length))
    hashers = [chunk_hasher() for _ in spans]
    value, pos, first = 0, 0, 0  # ``first``: the earliest span (in ``order``) not yet wholly hashed
    with open(path, "rb") as f:
        while block := f.read(BLOCK):
            value = crc.update(block, value)
            view = memoryview(block)
            end = pos + len(block)
            k = first
            while k < len(order) and spans[order[k]].offset < end:
                s = spans[order[k]]
                lo, hi = max(s.offset, pos), min(s.offset + s.length, end)
                if lo < hi:
                    hashers[order[k]].update(view[lo - pos:hi - pos])
                if k == first and s.offset + s.length <= end:
                    first += 1
                k += 1
            pos = end
    late = [s for s in spans if s.offset + s.length > pos]
    if late:
        raise ValueError(f"{rel}: chunk {late[0].key} at {list(late[0].offsets)} ends past the file's {pos} bytes")
    entry = FileEntry(size=pos, checksums={HASH_ALGORITHM: f"{value:08x}"})
    return entry, [ChunkRecord(s.key, tuple(s.offsets), rel, s.offset, s.length, h.hexdigest(), s.stats)
                   for s, h in zip(spans, hashers)]


def record_parts(key: str, offsets: tuple[int, ...], rel: str, offset: int, parts: list[Any],
                 elements: np.ndarray, dtype: DType) -> ChunkRecord:
    """The record of one chunk a streaming writer (reshard, export) is handing to its file as ``parts``:
    hashed from those bytes and its statistics from ``elements`` (the chunk's stored elements, any
    numpy view of their bits), so nothing is read back."""
    h = chunk_hasher()
    length = 0
    for part in parts:
        view = memoryview(part).cast("B")
        h.update(view)
        length += view.nbytes
    flat = elements.reshape(-1)
    stats = element_stats(flat.view(carrier(dtype)), dtype) if flat.dtype.itemsize == dtype.itemsize else None
    return ChunkRecord(key, tuple(offsets), rel, offset, length, h.hexdigest(), stats)
