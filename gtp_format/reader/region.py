"""Assemble rows of one tensor from its stored chunks, reading only the chunks that meet them.

``show`` prints a region, ``diff`` and ``verify-roundtrip`` compare whole tensors whose two sides
are cut into different chunks (a resharded or re-laid-out copy), so they share this one assembler.
Memory is bounded up front: the region's size is computed from metadata and refused over
``max_bytes``, and over the bytes its chunks really store in real files (a declared 2 GB bool
tensor backed by a 1 KB chunk stayed under the default ``--max-bytes`` and was allocated whole),
before anything is allocated; a chunk that leaves the global shape is refused before it is read.

Torch is imported inside :func:`assemble` only: :mod:`gtp_format` must import without it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from gtp_format.errors import EXIT_BAD_INPUT, FormatError
from gtp_format.layout.boxes import check_coverage, intersection
from gtp_format.model import Checkpoint, Chunk, Entry
from gtp_format.reader.chunks import checked_ref, load_chunk
from gtp_format.reader.storage import file_size, readable_size
from gtp_format.torch_adapter import load_torch


@dataclass
class Assembled:
    tensor: Any  # torch.Tensor
    start: int
    stop: int
    chunks_read: int
    missing: int  # elements of the region no chunk covers (left as zero)


def region_bytes(entry: Entry, start: int, stop: int) -> int:
    """Bytes of rows ``[start, stop)`` of ``entry`` (the whole tensor when 0-D)."""
    assert entry.shape is not None
    shape = (stop - start, *entry.shape[1:]) if entry.shape else ()
    return math.prod(shape) * entry.itemsize


def assemble(ckpt: Checkpoint, entry: Entry, start: int, stop: int, max_bytes: int) -> Assembled:
    """Rows ``[start, stop)`` of dim 0 (the whole tensor when 0-D), reading only chunks that meet them."""
    torch = load_torch()

    assert entry.shape is not None and entry.dtype is not None
    shape = (stop - start, *entry.shape[1:]) if entry.shape else ()
    nbytes = region_bytes(entry, start, stop)
    if nbytes > max_bytes:
        raise FormatError(f"{entry.key}: the requested region is {math.prod(shape)} elements ({nbytes} bytes), over "
                          f"the {max_bytes}-byte limit; pass --slice a:b for fewer rows or raise --max-bytes",
                          EXIT_BAD_INPUT)
    _check_stored(ckpt, entry, start, stop, nbytes)
    out = torch.zeros(shape, dtype=entry.dtype.torch)
    boxes = []
    read = 0
    for c in entry.chunks:
        if len(c.offsets) != len(entry.shape) or any(
                o + s > n for o, s, n in zip(c.offsets, c.sizes, entry.shape, strict=True)):
            raise FormatError(f"{entry.key} chunk {c.index} (offsets {list(c.offsets)}, sizes {list(c.sizes)}) leaves "
                              f"the global shape {list(entry.shape)}; run 'ckpt verify' on the checkpoint")
        region = _intersection(c, start, stop) if entry.shape else (0, 0)
        if region is None:
            continue
        t = load_chunk(ckpt, entry, c)
        read += 1
        if not entry.shape:
            out.copy_(t)
            boxes.append(((), ()))
            continue
        lo, hi = region
        src = t[lo - c.offsets[0]: hi - c.offsets[0]]
        dst_index = (slice(lo - start, hi - start),) + tuple(
            slice(o, o + s) for o, s in zip(c.offsets[1:], c.sizes[1:], strict=True))
        out[dst_index].copy_(src)
        boxes.append(((lo - start, *c.offsets[1:]), (hi - lo, *c.sizes[1:])))
    return Assembled(out, start, stop, read, check_coverage(shape, boxes).missing or 0)


def _check_stored(ckpt: Checkpoint, entry: Entry, start: int, stop: int, nbytes: int) -> None:
    """Refuse a region the chunks that hold it cannot back with bytes that exist in real files.

    Each such chunk first passes :func:`checked_ref` (no storage, transforms, a declared size its
    blob cannot hold: errors that name the chunk), and its file's size comes from the listing or
    a confined stat (a path outside the folder or a missing file fails here, by name). The bytes
    that back the region are counted per file and capped by what the file really stores
    (:func:`gtp_format.reader.storage.readable_bytes`: its size, at most a bounded multiple of its
    blocks): a 2 GB region over a sparse 2 GB file passed a check taken from ``st_size``.
    """
    assert entry.shape is not None
    held = [c for c in entry.chunks if len(c.offsets) == len(entry.shape)
            and (not entry.shape or _intersection(c, start, stop) is not None)]
    refs = [checked_ref(ckpt, entry, c) for c in held]
    per_file: dict[str, int] = {}
    for r in refs:
        per_file[r.file] = per_file.get(r.file, 0) + r.length
    for f in per_file:
        file_size(ckpt.store, f)  # a path outside the folder or a missing file fails here, by name
    # Per file, capped by what the file may be read for (a bounded multiple of its blocks, not its
    # size): chunks that all name one range, or ranges in the holes of a sparse file, cannot back more.
    stored = sum(min(n, readable_size(ckpt.store, f)) for f, n in per_file.items())
    if nbytes > stored:  # the allocation is sized by metadata: back it by bytes that really exist
        raise FormatError(f"{entry.key}: the requested region is {nbytes} bytes but the chunks that hold it store only "
                          f"{stored} bytes in real files; the metadata declares more than was written: run "
                          "'ckpt verify' on the checkpoint", EXIT_BAD_INPUT)


def _intersection(c: Chunk, start: int, stop: int) -> tuple[int, int] | None:
    """Rows of ``[start, stop)`` this chunk holds, or ``None`` (empty chunks hold none)."""
    cut = intersection(((start,), (stop - start,)), (c.offsets[:1], c.sizes[:1]))
    return (cut[0][0], cut[1][0]) if cut is not None and c.numel else None
