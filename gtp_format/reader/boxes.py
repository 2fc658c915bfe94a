"""Read any box of a stored tensor, touching only the bytes it needs: the streaming read of reshard.

A chunk is stored row-major, so rows ``[a, b)`` of a chunk are one contiguous byte range: a box
read intersects the key's chunks and reads, for each, the row range it needs (then slices the
other dimensions in memory). Nothing ever reads a whole chunk it only needs part of, which is
what keeps ``ckpt reshard --max-memory`` true for a parameter larger than the budget.

``torch.save`` blobs (torch_dist) are located by parsing the blob's zip structure and its small
``data.pkl`` through :func:`gtp_format.reader.blob.parse_blob` over a bounded range reader (the
elements are never read for that); the layout is cached per chunk. Raw chunks (safetensors) need
no parse. Every range goes through :func:`gtp_format.reader.storage.read_range` (confined to the
folder, checked against the real file size). Elements come back as numpy arrays of the stored
bits (:func:`gtp_format.scan.carrier`), so copies are bit-exact whatever the dtype. No torch.
"""

from __future__ import annotations

import bisect
import math
import threading

import numpy as np

from gtp_format.errors import ChunkError
from gtp_format.model import ENC_RAW, TENSOR, Checkpoint, Chunk, Entry
from gtp_format.reader.blob import BlobLayout, parse_blob
from gtp_format.reader.chunks import blob_error, check_layout, checked_ref, load_elements
from gtp_format.reader.storage import open_regular, read_range
from gtp_format.reader.zip_blob import BlobError, RangeReader
from gtp_format.scan import carrier


class BoxReader:
    """Box reads on one checkpoint; thread-safe (the layout cache is guarded)."""

    def __init__(self, ckpt: Checkpoint) -> None:
        self.ckpt = ckpt
        self._layouts: dict[tuple[str, int], BlobLayout | None] = {}
        self._lock = threading.Lock()
        self._index: dict[str, tuple[list[Chunk], list[int], list[int]]] = {}
        self.bytes_read = 0

    def _chunks_near(self, entry: Entry, lo: int, hi: int) -> list[Chunk]:
        """Chunks whose dim-0 range may meet ``[lo, hi)``: bisection, not a scan of every chunk."""
        idx = self._index.get(entry.key)
        if idx is None:
            ordered = sorted(entry.chunks, key=lambda c: c.offsets[0] if c.offsets else 0)
            starts = [c.offsets[0] if c.offsets else 0 for c in ordered]
            run, ends = 0, []
            for c in ordered:
                run = max(run, (c.offsets[0] + c.sizes[0]) if c.offsets else 1)
                ends.append(run)
            idx = self._index[entry.key] = (ordered, starts, ends)
        ordered, starts, ends = idx
        return ordered[bisect.bisect_right(ends, lo):bisect.bisect_left(starts, hi)]

    def _payload_start(self, entry: Entry, chunk: Chunk) -> int | None:
        """Absolute file offset of a chunk's first element, or None when it is not row-major whole."""
        ref = checked_ref(self.ckpt, entry, chunk)
        if self.ckpt.encoding == ENC_RAW:
            return ref.offset
        cache_key = (entry.key, chunk.index)
        with self._lock:
            if cache_key in self._layouts:
                layout = self._layouts[cache_key]
                return None if layout is None else ref.offset + layout.payload_offset + \
                    layout.storage_offset * layout.dtype.itemsize
        with open_regular(self.ckpt.root, ref.file) as f:
            try:
                layout = parse_blob(RangeReader(f.fileno(), ref.offset, ref.length))
                check_layout(layout, entry, chunk)
            except BlobError as e:
                raise blob_error(entry, chunk, e) from None
        stride = tuple(math.prod(chunk.sizes[i + 1:]) for i in range(len(chunk.sizes)))
        usable = layout if layout.stride == stride or math.prod(chunk.sizes) <= 1 else None
        with self._lock:
            self._layouts[cache_key] = usable
        return None if usable is None else ref.offset + usable.payload_offset + \
            usable.storage_offset * usable.dtype.itemsize

    def chunk_rows(self, entry: Entry, chunk: Chunk, r0: int, r1: int) -> np.ndarray:
        """Rows ``[r0, r1)`` (dim 0, chunk-relative) of a chunk, as stored bits."""
        assert entry.dtype is not None
        dt = carrier(entry.dtype)
        row = math.prod(chunk.sizes[1:]) if len(chunk.sizes) > 1 else 1
        start = self._payload_start(entry, chunk)
        if start is None:  # an unusual blob (strided view): decode it whole, it is one chunk
            whole = load_elements(self.ckpt, entry, chunk)
            return np.ascontiguousarray(whole[r0:r1])
        n = (r1 - r0) * row
        ref = chunk.storage
        assert ref is not None
        try:
            buf = read_range(self.ckpt.root, ref.file, start + r0 * row * dt.itemsize, n * dt.itemsize)
        except ChunkError as e:
            raise ChunkError(f"{entry.key} chunk {chunk.index}: {e.message}", key=entry.key, chunk=chunk.index,
                             file=ref.file) from None
        self.bytes_read += len(buf)
        return np.frombuffer(buf, dtype=dt).reshape((r1 - r0, *chunk.sizes[1:]))

    def read_box(self, key: str, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> np.ndarray:
        """The box ``offsets``/``sizes`` of tensor ``key``; every element must be in some chunk."""
        entry = self.ckpt.entries.get(key)
        if entry is None or entry.kind != TENSOR or entry.shape is None or entry.dtype is None:
            raise ChunkError(f"{self.ckpt.root}: tensor {key!r} is missing; the checkpoint is incomplete", key=key)
        if len(offsets) != len(entry.shape) or any(o < 0 or o + s > d for o, s, d in zip(offsets, sizes, entry.shape)):
            raise ChunkError(f"{key}: box {list(offsets)}+{list(sizes)} leaves its shape {list(entry.shape)}", key=key)
        near = self._chunks_near(entry, offsets[0], offsets[0] + sizes[0]) if sizes else list(entry.chunks)
        whole = [c for c in near if all(co <= o and o + s <= co + cs and (i == 0 or (co, cs) == (o, s))
                                        for i, (o, s, co, cs) in enumerate(zip(offsets, sizes, c.offsets, c.sizes)))]
        if whole and sizes:  # one chunk holds the box as whole rows: its bytes are the answer, no copy
            c = whole[0]
            return self.chunk_rows(entry, c, offsets[0] - c.offsets[0], offsets[0] + sizes[0] - c.offsets[0])
        out = np.empty(sizes, dtype=carrier(entry.dtype))
        covered = 0
        for c in near:
            lo = [max(o, co) for o, co in zip(offsets, c.offsets)]
            hi = [min(o + s, co + cs) for o, s, co, cs in zip(offsets, sizes, c.offsets, c.sizes)]
            if any(a >= b for a, b in zip(lo, hi)):
                continue
            rows = self.chunk_rows(entry, c, lo[0] - c.offsets[0], hi[0] - c.offsets[0])
            src = rows[(slice(None), *(slice(a - co, b - co) for a, b, co in zip(lo[1:], hi[1:], c.offsets[1:])))]
            out[tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, offsets))] = src
            covered += math.prod(b - a for a, b in zip(lo, hi))
        if covered != math.prod(sizes):
            raise ChunkError(f"{key}: {math.prod(sizes) - covered} elements of box {list(offsets)}+{list(sizes)} are "
                             "in no chunk (or in several); the checkpoint is incomplete", key=key)
        return out
