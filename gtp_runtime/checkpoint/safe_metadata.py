"""Read DCP ``.metadata`` for ``--load`` without trusting the file.

PyTorch's ``FileSystemReader.read_metadata`` is a plain ``pickle.load``: a checkpoint someone else
wrote can run code on the training cluster at load time. :class:`SafeFileSystemReader` reads the
same file through an unpickler that resolves only the globals a DCP metadata pickle needs (the
list was established on torch 2.13 files and Megatron's) to the real classes, and refuses
anything else before it is called. It runs the C unpickler only after
:func:`~gtp_format.reader.pickle_scan.check_pickle` has walked the stream (the C unpickler
sizes its memo from an index in the file), and refuses a metadata file larger than the data it
describes could justify. What it cannot bound, because ``dcp.load`` needs the real classes: a
crafted file that passes one large state dict to many ``BUILD`` opcodes gets it copied each time,
as under PyTorch's own reader; ``ckpt inspect`` reads such files with inert, sharing records.

The ``ckpt`` CLI goes further (inert stand-ins, never the real classes) because it only reads;
the runtime needs real ``Metadata`` objects to hand to ``dcp.load``.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from gtp_format.dtypes import DTYPES, LAYOUTS, MEMORY_FORMATS
from gtp_format.reader.pickle_scan import PickleScanError, ScannedUnpickler

_DCP = "torch.distributed.checkpoint"
ALLOWED: dict[str, frozenset[str]] = {
    f"{_DCP}.metadata": frozenset({
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING",
    }),
    f"{_DCP}.filesystem": frozenset({"_StorageInfo", "_StoragePrefix"}),
    f"{_DCP}.planner": frozenset({"SavePlan", "WriteItem", "TensorWriteData", "WriteItemType"}),
    "torch.serialization": frozenset({"_get_layout"}),
    "torch": frozenset({"Size", *DTYPES, *LAYOUTS, *MEMORY_FORMATS}),  # dtypes etc.: inert values
    "pathlib": frozenset({"PosixPath", "PurePosixPath"}),
    "collections": frozenset({"OrderedDict"}),
}
MIN_LIMIT = 64 << 20


class UnsafeMetadataError(ValueError):
    """A ``.metadata`` that references something outside the allow-list; nothing in it ran."""


class _Restricted(ScannedUnpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in ALLOWED.get(module, frozenset()):
            return getattr(importlib.import_module(module), name)
        raise UnsafeMetadataError(f"{self.source}: refuses to load global {module}.{name} (not DCP metadata); "
                                  "the file is corrupt or was crafted; do not load this checkpoint")


def safe_load_metadata(path: Path) -> Metadata:
    size = path.stat().st_size
    data_bytes = sum(p.stat().st_size for p in path.parent.iterdir() if p.is_file() and p != path)
    if size > max(MIN_LIMIT, data_bytes):
        raise UnsafeMetadataError(f"{path}: {size} bytes of metadata for {data_bytes} bytes of data; refusing")
    try:
        md = _Restricted(path.read_bytes(), str(path)).load()
    except PickleScanError as e:
        raise UnsafeMetadataError(f"{path}: {e}; the file is corrupt or was crafted; do not load this checkpoint") \
            from None
    if not isinstance(md, Metadata):
        raise UnsafeMetadataError(f"{path}: holds a {type(md).__name__}, not DCP Metadata")
    return md


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose ``.metadata`` goes through :func:`safe_load_metadata`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        md = safe_load_metadata(Path(self._get_metadata_path(kwargs.get("rank"))))
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md
