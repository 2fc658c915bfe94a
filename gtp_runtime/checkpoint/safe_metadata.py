"""Read DCP ``.metadata`` for ``--load`` without trusting the file.

PyTorch's ``FileSystemReader.read_metadata`` is a plain ``pickle.load``: a checkpoint someone else
wrote can run code on the training cluster at load time. :class:`SafeFileSystemReader` reads the
same file through :func:`gtp_format.reader.real_pickle.load_real_metadata`: the one allow-list
that ``ckpt`` also reads through (:mod:`gtp_format.reader.allow_list`), resolved to the real DCP
classes that ``dcp.load`` needs, after the opcode pre-scan, refusing anything else before it is
called. Before that, it refuses a metadata file larger than the data it describes could justify.

Why one table: the runtime used to keep its own, which lacked ``pathlib._local.PosixPath``, the
name Python 3.13 pickles paths under, so ``--load`` refused the runtime's own checkpoints on 3.13
while ``ckpt verify`` accepted them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from gtp_format.errors import FormatError
from gtp_format.reader.real_pickle import load_real_metadata
from gtp_format.reader.storage import stored_bytes

MIN_LIMIT = 64 << 20


class UnsafeMetadataError(ValueError):
    """A ``.metadata`` that references something outside the allow-list, or is damaged; nothing in it ran."""


def safe_load_metadata(path: Path) -> Metadata:
    size = path.stat().st_size
    # What the data files really store, not their sizes: a sparse data file is free (issue 22).
    data_bytes = sum(stored_bytes(p.stat()) for p in path.parent.iterdir() if p.is_file() and p != path)
    if size > max(MIN_LIMIT, data_bytes):
        raise UnsafeMetadataError(f"{path}: {size} bytes of metadata for {data_bytes} bytes of data; refusing")
    try:
        return load_real_metadata(path.read_bytes(), str(path))
    except FormatError as e:
        raise UnsafeMetadataError(e.message) from None


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose ``.metadata`` goes through :func:`safe_load_metadata`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        md = safe_load_metadata(Path(self._get_metadata_path(kwargs.get("rank"))))
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md
