"""Confined, bounded file access for every file a reader opens in a checkpoint folder or bucket.

The rules (recorded paths are plain relative paths, opened relative to the folder one component at a
time without following links out, checked by what was opened, byte ranges checked before a read, and
reads bounded by what a file really stores: the hole rule) are stated and enforced in
:mod:`gtp_format.storage.local` for a folder.

Each public function here hands the root to its storage (:func:`gtp_format.storage.base.storage_for`: a
folder, :mod:`gtp_format.storage.local`; a bucket, :mod:`gtp_format.storage.objects`, under the same rules
in the store's terms: keys confined to the prefix, sizes from the store, bounded requests), so the readers
above are the same code for a folder and a bucket. The hole rule is applied here, to the bytes a file
stores (:meth:`gtp_format.storage.base.Storage.stat`): an object stores every byte it has.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import BinaryIO

from gtp_format.reader.preads import Into
from gtp_format.storage import objects
from gtp_format.storage.base import Storage, storage_for
from gtp_format.storage.limits import (
    HOLE_FACTOR,
    HOLE_FACTOR_ENV,
    METADATA_CEILING,
    METADATA_FLOOR,
    METADATA_LIMIT_ENV,
    metadata_override,
)
from gtp_format.storage.local import (
    MAX_LINKS,
    SPARSE_SLACK,
    LocalFile,
    budget_of,
    hole_factor,
    is_sparse,
    open_path,
    read_budget,
    readable_bytes,
    sparse_file_message,
    sparse_message,
    stored_bytes,
)
from gtp_format.storage.location import ObjectURL
from gtp_format.storage.paths import past_end_message, unsafe_reason

Root = Path | ObjectURL | Storage  # where a checkpoint's files are: a location, or its storage already chosen

__all__ = ["HOLE_FACTOR", "HOLE_FACTOR_ENV", "MAX_LINKS", "METADATA_LIMIT_ENV", "SPARSE_SLACK", "budget_of",
           "hole_factor", "is_sparse", "open_path", "past_end_message", "read_budget", "readable_bytes",
           "sparse_file_message", "sparse_message", "stored_bytes", "unsafe_reason"]


def open_regular(root: Root, rel: str, what: str = "data file") -> BinaryIO:
    """Open a regular file inside ``root`` for reading (see :mod:`gtp_format.storage.local` for a folder's rules;
    a bucket's object for ranged reads, :class:`gtp_format.storage.objects.ObjectFile`)."""
    return storage_for(root).open(rel, what)


def streamed(f: BinaryIO) -> BinaryIO:
    """``f`` (from :func:`open_regular`) marked as read by a streaming pass: a bucket's object then serves its
    small reads from a block cache (:meth:`gtp_format.storage.objects.ObjectFile.stream_small_reads`); a local
    file is left as it is (the page cache does that already)."""
    f.stream_small_reads()  # type: ignore[attr-defined]
    return f


def stored_size(root: Root, rel: str) -> int:
    """:func:`stored_bytes` of a regular file inside ``root`` (0 when it is not one: no error)."""
    st = storage_for(root).stat(rel)
    return 0 if st is None else st.stored


def readable_size(root: Root, rel: str) -> int:
    """:func:`readable_bytes` of a regular file inside ``root`` (0 when it is not one: no error)."""
    store = storage_for(root)
    st = store.stat(rel)
    return 0 if st is None else min(st.size, budget_of(st.stored, store.limits.hole_factor))




def metadata_limit(data_bytes: int, root: Root | None = None) -> int:
    """Largest checkpoint metadata file (DCP ``.metadata``, a safetensors index) we agree to parse.

    A metadata entry is a few hundred bytes per chunk while every chunk's blob is at least about a
    kilobyte, so metadata larger than all the data it describes is not real. ``data_bytes`` is
    what the data files really store (:func:`gtp_format.reader.storage.stored_bytes`), not their
    sizes: one sparse 16 TiB data file made a 400 MB ``.metadata`` look plausible.
    The floor keeps partial copies (data files missing) readable; the environment variable is the
    escape hatch the error message names (read once by the session of ``root``'s storage).
    """
    override = metadata_override() if root is None else storage_for(root).limits.metadata_override
    if override is not None:
        return override
    return min(METADATA_CEILING, max(METADATA_FLOOR, data_bytes))


def file_size(root: Root, rel: str, what: str = "data file") -> int:
    """Size of a regular file inside ``root``, from the descriptor that was opened (an object: ``HEAD``)."""
    return storage_for(root).size(rel, what)


def is_regular_inside(root: Root, rel: str) -> int | None:
    """Size of ``rel`` if it is a regular file reachable inside ``root``, else ``None`` (no error).

    Stats without opening: listing a folder's data files must not open them.
    """
    st = storage_for(root).stat(rel)
    return None if st is None else st.size


def is_folder_inside(root: Root, rel: str) -> bool:
    """Whether ``rel`` is a folder reachable inside ``root`` (symlinks resolved inside only; in a bucket: a
    prefix that holds objects)."""
    return unsafe_reason(rel) is None and storage_for(root).is_folder(rel)


def read_range(root: Root, rel: str, offset: int, length: int,
               into: Into | None = None, cached: bool = False) -> bytearray | memoryview:
    """Exactly ``length`` bytes at ``offset`` of a data file, after checking the range fits.

    A ``bytearray``: writable, so tensors can be viewed over it without a copy. With ``into``, the
    bytes go into the buffer it returns for ``length`` (asked for only after the range passed every
    check, so a size in the metadata never sizes a buffer by itself) and that buffer's first
    ``length`` bytes are returned: the runtime's loads read into pinned buffers they reuse, so that
    nothing is allocated (and page-faulted) per chunk and the copy to the GPU is a DMA
    (:mod:`gtp_runtime.checkpoint.pinned`); a range from 1 MiB is then read with ``O_DIRECT``
    (:func:`gtp_format.reader.preads.read_direct`: why) and the view returned lies inside that buffer, unless
    ``cached`` (a copy's reusable buffer, its source read through the page cache like every other copy's).
    """
    return storage_for(root).read_range(rel, offset, length, into, cached)


# what a reader keeps open: a file :func:`open_regular` opened, or a bare descriptor a reader keeps of its own
Source = int | LocalFile | objects.ObjectFile


def source_of(f: BinaryIO) -> Source:
    """What a reader keeps of a file :func:`open_regular` opened, for :func:`pread` and :func:`pread_into`."""
    return f  # type: ignore[return-value]


def size_of(f: BinaryIO) -> int:
    """Size of a file :func:`open_regular` opened: ``fstat``'s, or the store's for an object."""
    return f.size  # type: ignore[attr-defined]


def pread(src: Source, n: int, offset: int) -> bytes:
    """``os.pread`` of a local file (or a bare descriptor); one bounded ranged read of an object (fewer bytes
    only at its end)."""
    return os.pread(src, n, offset) if type(src) is int else src.pread(n, offset)  # type: ignore[union-attr]


def pread_into(fd: Source, rel: str, size: int, offset: int, out: memoryview) -> None:
    """Fill ``out`` from ``offset`` of an open data file of ``size`` bytes (its size when opened),
    checking the range first; a file that shrank since is a :class:`ChunkError`, never a short read.

    For readers that keep a file open across many reads (:class:`gtp_format.reader.boxes.BoxReader`):
    the bytes land straight in the caller's buffer, with no allocation and no re-open per read.
    """
    fd.read_into(rel, size, offset, out)


def read_small_file(path: Path | ObjectURL, limit: int, what: str, fix: str) -> bytes:
    """A whole metadata-like file ``path`` (confined to its folder), refusing anything over ``limit`` bytes."""
    return storage_for(path).read_small(limit, what, fix)


def list_dir(path: Root) -> list[str]:
    """Sorted entry names of a folder, as a one-line error when it cannot be listed (a bucket's prefix: its
    objects and sub-prefixes, one level)."""
    return storage_for(path).list()
