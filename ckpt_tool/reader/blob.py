"""Decode a ``torch.save`` blob of one tensor without copying its elements.

DCP stores every chunk as a complete ``torch.save`` zip archive inside a ``.distcp`` file.
``torch.load`` would copy the blob into a buffer, then copy the element record into a new
storage; verifying hundreds of GB that way is bound by memory copies and page faults. Here the
archive's structure is read with :mod:`zipfile` (central directory, local headers, the small
``data.pkl`` record, CRC-checked), ``data.pkl`` goes through an allow-listing unpickler whose only
callables record their arguments, and the tensor is a view made by ``torch.frombuffer`` over the
caller's buffer, so the elements are never copied. Torch itself checks the view's sizes, strides
and offset against the storage (``as_strided``).

What the pickle may reference is what ``torch.save`` writes for a plain tensor:
``torch._utils._rebuild_tensor_v2``, ``collections.OrderedDict`` (empty backward hooks) and one
``torch.<Type>Storage`` class per dtype, with a persistent id naming the storage record.
``tests/cli/test_blob.py`` checks the result against ``torch.load`` on every fixture chunk.
"""

from __future__ import annotations

import io
import math
import os
import struct
import zipfile
from dataclasses import dataclass
from typing import Any

import torch
from torch.storage import _get_dtype_from_pickle_storage_type

from ckpt_tool.reader.safe_pickle import brief
from gtp_runtime.checkpoint.pickle_scan import ScannedUnpickler

MAX_PICKLE = 1 << 20  # data.pkl of one tensor is ~150 bytes
MAX_DIMS = 64
_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")
_LOCAL_SIG = 0x04034B50


class BlobError(ValueError):
    """The bytes are not a ``torch.save`` blob of one tensor; the message says why."""


@dataclass(frozen=True)
class BlobLayout:
    """Where a blob's elements are and how they view as a tensor."""

    dtype: torch.dtype
    payload_offset: int  # of the storage record's bytes, from the blob's start
    storage_numel: int
    storage_offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def payload_bytes(self) -> int:
        return self.storage_numel * self.dtype.itemsize

    @property
    def contiguous_whole(self) -> bool:
        """The view is the whole storage, row-major: it can be checked piece by piece."""
        numel = math.prod(self.size)
        return self.storage_offset == 0 and numel == self.storage_numel and self.stride == _contiguous(self.size)


def _contiguous(size: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for d in reversed(size):
        stride.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(stride))


class BlobReader(io.RawIOBase):
    """A read-only, seekable file over one blob of ``length`` bytes; subclasses say where the bytes are."""

    def __init__(self, length: int) -> None:
        self._len, self._pos = length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._len}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def read(self, n: int = -1) -> bytes:
        end = self._len if n is None or n < 0 else min(self._len, self._pos + n)
        out = self._bytes(self._pos, end) if end > self._pos else b""
        self._pos += len(out)
        return out

    def _bytes(self, start: int, stop: int) -> bytes:
        raise NotImplementedError


class ViewReader(BlobReader):
    """A blob in memory, handing out slices without copying the whole."""

    def __init__(self, view: memoryview) -> None:
        super().__init__(len(view))
        self._view = view

    def _bytes(self, start: int, stop: int) -> bytes:
        return bytes(self._view[start:stop])


class RangeReader(BlobReader):
    """``[start, start + length)`` of an open file, by ``os.pread`` (for blobs too big to hold)."""

    def __init__(self, fd: int, start: int, length: int) -> None:
        super().__init__(length)
        self._fd, self._start = fd, start

    def _bytes(self, start: int, stop: int) -> bytes:
        if stop - start > MAX_PICKLE:
            raise BlobError(f"a {stop - start}-byte structural read; torch.save writes no such record")
        return os.pread(self._fd, stop - start, self._start + start)


@dataclass(frozen=True)
class _StorageId:
    dtype: torch.dtype
    key: str
    numel: int


@dataclass(frozen=True)
class _TensorArgs:
    storage: _StorageId
    storage_offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


class _StorageType:
    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype


def _ints(value: Any, what: str) -> tuple[int, ...]:
    if type(value) is not tuple or len(value) > MAX_DIMS or not all(type(v) is int and v >= 0 for v in value):
        raise BlobError(f"data.pkl gives {what} {brief(value)}, not a short tuple of non-negative ints")
    return value


def _rebuild_tensor_v2(storage: Any, storage_offset: Any, size: Any, stride: Any, requires_grad: Any = False,
                       backward_hooks: Any = None, metadata: Any = None) -> _TensorArgs:
    if type(storage) is not _StorageId or type(storage_offset) is not int or storage_offset < 0:
        raise BlobError("data.pkl rebuilds a tensor from something other than one stored record")
    if backward_hooks:
        raise BlobError("data.pkl attaches backward hooks to the tensor")
    return _TensorArgs(storage, storage_offset, _ints(size, "size"), _ints(stride, "stride"))


class _TensorPickle(ScannedUnpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild_tensor_v2
        if (module, name) == ("collections", "OrderedDict"):
            return dict  # backward hooks: must be empty, checked above
        if module == "torch" and name.endswith("Storage"):
            try:
                return _StorageType(_get_dtype_from_pickle_storage_type(name))
            except (KeyError, AttributeError):
                pass
        raise BlobError(f"data.pkl references {module}.{name}, which a saved tensor never needs; nothing was run")

    def persistent_load(self, pid: Any) -> _StorageId:
        if (type(pid) is not tuple or len(pid) != 5 or pid[0] != "storage" or type(pid[1]) is not _StorageType
                or type(pid[2]) is not str or type(pid[4]) is not int or pid[4] < 0):
            raise BlobError(f"data.pkl names storage {brief(pid)}, not ('storage', type, key, location, numel)")
        return _StorageId(pid[1].dtype, pid[2], pid[4])


def parse_blob(reader: BlobReader, length: int) -> BlobLayout:
    """Read a blob's structure (a few hundred bytes at its start and end) into a :class:`BlobLayout`."""
    try:
        archive = zipfile.ZipFile(reader)
        infos = {i.filename: i for i in archive.infolist()}
    except (zipfile.BadZipFile, zipfile.LargeZipFile, ValueError, OSError, EOFError, struct.error) as e:
        raise BlobError(f"not a zip archive ({e})") from None
    for info in infos.values():
        if info.compress_type != zipfile.ZIP_STORED or info.file_size > length:
            raise BlobError(f"record {info.filename} is compressed or larger than the blob ({info.file_size} "
                            "bytes); torch.save never writes that, refusing to inflate it")
    pkl = [n for n in infos if n.endswith("/data.pkl") and n.count("/") == 1]
    if len(pkl) != 1 or infos[pkl[0]].file_size > MAX_PICKLE:
        raise BlobError(f"expected one <archive>/data.pkl record, found {brief(sorted(infos))}")
    prefix = pkl[0][: -len("data.pkl")]
    try:
        order = archive.read(prefix + "byteorder") if prefix + "byteorder" in infos else b"little"
        args = _TensorPickle(archive.read(pkl[0]), "data.pkl").load()
    except BlobError:
        raise
    except Exception as e:  # zip CRC errors, damaged pickles: anything
        raise BlobError(f"data.pkl does not load ({type(e).__name__}: {str(e)[:160]})") from None
    if order != b"little":
        raise BlobError(f"the blob was saved {brief(order)}-endian; ckpt reads little-endian blobs only")
    if type(args) is not _TensorArgs:
        raise BlobError(f"data.pkl holds a {type(args).__name__}, not a tensor")
    record = infos.get(f"{prefix}data/{args.storage.key}")
    if record is None:
        raise BlobError(f"data.pkl names storage record {args.storage.key!r}, which the archive lacks")
    nbytes = args.storage.numel * args.storage.dtype.itemsize
    if record.file_size != nbytes:
        raise BlobError(f"storage record {record.filename} holds {record.file_size} bytes but data.pkl declares "
                        f"{args.storage.numel} {args.storage.dtype} elements ({nbytes} bytes)")
    reader.seek(record.header_offset)
    header = reader.read(_LOCAL_HEADER.size)
    if len(header) != _LOCAL_HEADER.size or _LOCAL_HEADER.unpack(header)[0] != _LOCAL_SIG:
        raise BlobError(f"record {record.filename} has no local header at byte {record.header_offset}")
    *_, name_len, extra_len = _LOCAL_HEADER.unpack(header)
    payload = record.header_offset + _LOCAL_HEADER.size + name_len + extra_len
    if payload + nbytes > length:
        raise BlobError(f"storage record {record.filename} runs past the end of the blob")
    return BlobLayout(args.storage.dtype, payload, args.storage.numel, args.storage_offset, args.size, args.stride)


def tensor_view(layout: BlobLayout, payload: memoryview) -> torch.Tensor:
    """The tensor over ``payload`` (the storage record's bytes), without copying them."""
    if layout.storage_numel == 0:
        base = torch.empty(0, dtype=layout.dtype)
    else:
        base = torch.frombuffer(payload, dtype=layout.dtype, count=layout.storage_numel)
    try:
        return base.as_strided(layout.size, layout.stride, layout.storage_offset)
    except RuntimeError as e:
        raise BlobError(f"the tensor view does not fit its storage ({str(e)[:200]})") from None
