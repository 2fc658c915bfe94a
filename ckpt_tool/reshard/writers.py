"""Data files of the two layouts, written one chunk at a time with their CRC-32C on the way.

* ``torch_dist``: ``__{i}_0.distcp`` is a run of complete ``torch.save`` blobs, one per chunk,
  exactly as DCP's ``FileSystemWriter`` lays them out; ``.metadata`` is a pickled DCP
  ``Metadata`` built from PyTorch's own classes (what ``FileSystemWriter.finish`` writes), so
  ``dcp.load`` and the runtime's allow-listing reader take it as their own.
* ``safetensors``: ``__{i}_0.safetensors`` holds chunks named ``{key}@{offsets}`` plus
  ``index.json`` (:mod:`gtp_runtime.checkpoint.safetensors_storage`'s layout). The header is known
  from the plan before any element is read, so the file is streamed without torch.

Each file is written by one thread; the checksum is computed from the bytes as they are written,
so no file is read back. Every file is fsynced before the folder is committed.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ckpt_tool.reshard.plan import OutChunk
from gtp_format.hashing import BLOCK, HASHERS
from gtp_format.manifest import HASH_ALGORITHM, FileEntry
from gtp_format.names import GTP_INDEX_VERSION, chunk_tensor_name

DataFn = Callable[[OutChunk], np.ndarray]


class _Out:
    """A write-only stream that counts bytes and hashes them (``torch.save`` writes into it)."""

    def __init__(self, f: Any) -> None:
        self.f, self.pos, self.hasher = f, 0, HASHERS[HASH_ALGORITHM]()

    def write(self, b: Any) -> int:
        mv = memoryview(b).cast("B")
        self.f.write(mv)
        self.hasher.update(mv)
        self.pos += mv.nbytes
        return mv.nbytes

    def flush(self) -> None:
        self.f.flush()

    def entry(self) -> FileEntry:
        self.f.flush()
        os.fsync(self.f.fileno())
        return FileEntry(size=self.pos, checksums={HASH_ALGORITHM: self.hasher.hexdigest()})


def write_distcp(path: Path, chunks: list[OutChunk], data: DataFn, advance: Callable[[int], None]
                 ) -> tuple[FileEntry, list[tuple[OutChunk, int, int]]]:
    """One ``.distcp`` file; returns its entry and ``(chunk, offset, length)`` per blob.

    ``torch.save`` writes straight into the file; the checksum is taken from the blob just written
    (still in the page cache) in 8 MiB reads: measured on 2 cores, passing ``torch.save`` a hashing
    stream instead halved its rate, because every write then crosses into Python.
    """
    import torch

    placed = []
    hasher = HASHERS[HASH_ALGORITHM]()
    with open(path, "x+b") as f:  # read too: the checksum re-reads each blob from the page cache
        fd = f.fileno()
        for c in chunks:
            arr = np.ascontiguousarray(data(c))
            t = torch.from_numpy(arr).view(c.dtype.torch) if arr.dtype.itemsize == c.dtype.itemsize else None
            assert t is not None and tuple(t.shape) == c.sizes, (c.key, arr.dtype, c.dtype)
            start = f.tell()
            torch.save(t, f)
            f.flush()
            end = f.tell()
            for pos in range(start, end, BLOCK):
                hasher.update(os.pread(fd, min(BLOCK, end - pos), pos))
            placed.append((c, start, end - start))
            advance(c.nbytes)
        os.fsync(fd)
        return FileEntry(size=f.tell(), checksums={HASH_ALGORITHM: hasher.hexdigest()}), placed


def write_distcp_metadata(path: Path, shapes: dict[str, Any], placed: list[tuple[str, OutChunk, int, int]]) -> None:
    """``.metadata``: DCP's own classes, pickled as ``FileSystemWriter.finish`` does."""
    import pickle

    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    by_key: dict[str, list[ChunkStorageMetadata]] = {k: [] for k in shapes}
    storage = {}
    for file, c, off, length in placed:
        by_key[c.key].append(ChunkStorageMetadata(offsets=torch.Size(c.offsets), sizes=torch.Size(c.sizes)))
        storage[MetadataIndex(c.key, torch.Size(c.offsets))] = _StorageInfo(file, off, length)
    sdm = {k: TensorStorageMetadata(properties=TensorProperties(dtype=dt.torch), size=torch.Size(shape),
                                    chunks=by_key[k]) for k, (shape, dt) in shapes.items()}
    md = Metadata(state_dict_metadata=sdm, planner_data={k: (k,) for k in shapes}, storage_data=storage)
    with open(path, "xb") as f:
        pickle.dump(md, f)
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


def write_safetensors(path: Path, chunks: list[OutChunk], data: DataFn, advance: Callable[[int], None]
                      ) -> FileEntry:
    """One safetensors data file, header first (known from the plan), then each chunk's bytes."""
    with open(path, "xb") as f:
        out = _Out(f)
        out.write(_st_header(chunks))
        for c in chunks:
            arr = np.ascontiguousarray(data(c))
            if arr.nbytes != c.nbytes:
                raise AssertionError(f"{c.key}: produced {arr.nbytes} bytes for {c.nbytes}")
            out.write(arr.data)
            advance(c.nbytes)
        return out.entry()


def safetensors_index(shapes: dict[str, Any], files: dict[str, list[OutChunk]]) -> bytes:
    keys: dict[str, Any] = {k: {"dtype": f"torch.{dt.name}", "shape": list(shape), "chunks": []}
                            for k, (shape, dt) in shapes.items()}
    for file, chunks in files.items():
        for c in chunks:
            keys[c.key]["chunks"].append({"offsets": list(c.offsets), "sizes": list(c.sizes), "file": file,
                                          "name": chunk_tensor_name(c.key, c.offsets)})
    return json.dumps({"version": GTP_INDEX_VERSION, "keys": keys}).encode()
