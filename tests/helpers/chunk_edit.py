"""Rewrite chunks of a checkpoint copy through the format's own writers (tests that plant values).

:func:`set_elements` reads a chunk with :class:`gtp_format.reader.boxes.BoxReader`, sets some of its
elements, and writes it back as a new ``torch.save`` blob (:func:`gtp_format.writer.torch_blob.tensor_blob`)
at the end of its data file; ``.metadata`` is rewritten for the new placement
(:func:`gtp_format.writer.dcp_metadata.metadata_bytes`). Every other record keeps its bytes and
offset, so the copy is a well-formed DCP checkpoint whose only change is the planted values.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from gtp_format.model import TENSOR
from gtp_format.reader.boxes import BoxReader
from gtp_format.reader.checkpoint import open_checkpoint
from gtp_format.writer.dcp_metadata import metadata_bytes
from gtp_format.writer.torch_blob import tensor_blob


def set_elements(it: Path, key: str, index: int, lo: int, hi: int, value: float) -> None:
    """Set elements ``[lo, hi)`` (flat, within the chunk) of chunk ``index`` of ``key`` in the folder ``it``."""
    ckpt = open_checkpoint(it)
    entry = ckpt.entries[key]
    chunk = next(c for c in entry.chunks if c.index == index)
    reader = BoxReader(ckpt)
    data = np.array(reader.read_box(key, chunk.offsets, chunk.sizes)).reshape(-1).copy()
    reader.close()
    data[lo:hi] = value
    blob = tensor_blob(entry.dtype, chunk.sizes, data.reshape(chunk.sizes))
    file = chunk.storage.file
    size = (it / file).stat().st_size
    with open(it / file, "ab") as f:
        f.write(blob)
    placed = []
    for e in ckpt.entries.values():
        for c in e.chunks:
            if c.storage is None:
                continue
            at = (size, len(blob)) if (e.key, c.index) == (key, index) else (c.storage.offset, c.storage.length)
            placed.append((c.storage.file, e.key, c.offsets if e.kind == TENSOR else None,
                           c.sizes if e.kind == TENSOR else None, *at))
    placed.sort(key=lambda p: (p[0], p[4]))
    shapes = {k: (e.shape, e.dtype) for k, e in ckpt.entries.items() if e.kind == TENSOR}
    objects = [k for k, e in ckpt.entries.items() if e.kind != TENSOR]
    tmp = it / ".metadata.new"
    tmp.write_bytes(metadata_bytes(shapes, placed, objects))
    os.replace(tmp, it / ".metadata")
