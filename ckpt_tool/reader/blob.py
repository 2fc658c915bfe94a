"""Decode a ``torch.save`` blob of one tensor without copying its elements.

DCP stores every chunk as a complete ``torch.save`` zip archive inside a ``.distcp`` file.
``torch.load`` would copy the blob into a buffer, then copy the element record into a new
storage; verifying hundreds of GB that way is bound by memory copies and page faults. Here the
archive's structure is read directly (end records, central directory, local headers, and the
small ``data.pkl`` record, CRC-checked; only what torch.save writes is accepted), ``data.pkl``
goes through an allow-listing unpickler whose only callables record their arguments, and the
tensor is a view made by ``torch.frombuffer`` over the caller's buffer, so the elements are
never copied. Torch itself checks the view's sizes, strides and offset against the storage
(``as_strided``).

What the pickle may reference is what ``torch.save`` writes for a plain tensor:
``torch._utils._rebuild_tensor_v2``, ``collections.OrderedDict`` (empty backward hooks) and one
``torch.<Type>Storage`` class per dtype, with a persistent id naming the storage record.
``tests/cli/test_blob.py`` checks the result against ``torch.load`` on every fixture chunk.
"""

from __future__ import annotations

import math
import os
import struct
import warnings
import zlib
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


def _spend_readonly_warning() -> None:
    """Use up torch's once-per-process "buffer is not writable" warning, silenced.

    verify --data reads windows into immutable ``bytes`` (google-crc32c hashes those without the
    GIL), and the tensors made over them are only ever read, so the warning would be noise on a
    user's terminal. Torch emits it once per process, from whichever thread is first, so it is
    spent here, at import, where ``catch_warnings`` is safe.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.frombuffer(b"\0", dtype=torch.uint8)


_spend_readonly_warning()


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


class BlobReader:
    """The bytes of one blob of ``length`` bytes, handed out by range; subclasses say where they are."""

    def __init__(self, length: int) -> None:
        self.length = length

    def get(self, start: int, stop: int) -> bytes | memoryview:
        """Bytes ``[start, stop)``; a range outside the blob is a :class:`BlobError`, never a short read."""
        if not 0 <= start <= stop <= self.length:
            raise BlobError(f"not a zip archive: a record points at bytes [{start}, {stop}) of a "
                            f"{self.length}-byte blob")
        return self._bytes(start, stop)

    def _bytes(self, start: int, stop: int) -> bytes | memoryview:
        raise NotImplementedError


class ViewReader(BlobReader):
    """A blob in memory: ranges are views of it, never copies."""

    def __init__(self, view: memoryview) -> None:
        super().__init__(len(view))
        self._view = view

    def _bytes(self, start: int, stop: int) -> memoryview:
        return self._view[start:stop]


class RangeReader(BlobReader):
    """``[start, start + length)`` of an open file, by ``os.pread`` (for blobs too big to hold)."""

    def __init__(self, fd: int, start: int, length: int) -> None:
        super().__init__(length)
        self._fd, self._start = fd, start

    def _bytes(self, start: int, stop: int) -> bytes:
        if stop - start > MAX_PICKLE:
            raise BlobError(f"a {stop - start}-byte structural read; torch.save writes no such record")
        data = os.pread(self._fd, stop - start, self._start + start)
        if len(data) != stop - start:
            raise BlobError(f"the file ends inside the blob (wanted bytes [{start}, {stop}))")
        return data


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


# The zip structures torch.save writes (PKWARE APPNOTE 4.3): end of central directory, its zip64
# locator and record, central directory headers, local headers. Parsed directly rather than with
# zipfile, which costs about 1 ms per blob in Python-level reads; verify --data parses one blob per
# chunk, and that time would hold the GIL against every other worker.
_EOCD = struct.Struct("<IHHHHIIH")
_EOCD_SIG = 0x06054B50
_LOC64 = struct.Struct("<IIQI")
_LOC64_SIG = 0x07064B50
_EOCD64 = struct.Struct("<IQHHIIQQQQ")
_EOCD64_SIG = 0x06064B50
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")
_CENTRAL_SIG = 0x02014B50
MAX_RECORDS = 64  # torch.save of one tensor writes 5-7


@dataclass(frozen=True)
class _Record:
    name: str
    method: int
    crc: int
    size: int
    header_offset: int


def _zip_records(r: BlobReader) -> dict[str, _Record]:
    """The archive's records by name, from its central directory; anything torch.save would not write is refused."""
    n = r.length
    if n < _EOCD.size:
        raise BlobError(f"not a zip archive: {n} bytes is too short for an end record")
    sig, disk, cd_disk, n_here, n_total, cd_size, cd_offset, comment = _EOCD.unpack(r.get(n - _EOCD.size, n))
    if sig != _EOCD_SIG or comment:
        raise BlobError("not a zip archive: the last 22 bytes are not an end-of-central-directory record "
                        "(torch.save writes one there, with no comment)")
    if disk not in (0, 0xFFFF) or cd_disk not in (0, 0xFFFF):  # 0xFFFF: "see the zip64 record"
        raise BlobError(f"not a zip archive: it spans disks {disk}/{cd_disk}; a torch.save blob is single-disk")
    cd_end = n - _EOCD.size
    if cd_end >= _LOC64.size:
        loc_sig, _, eocd64, _ = _LOC64.unpack(r.get(cd_end - _LOC64.size, cd_end))
        if loc_sig == _LOC64_SIG:  # zip64: the real counts and offsets are in the zip64 record
            if eocd64 > cd_end - _LOC64.size - _EOCD64.size:
                raise BlobError(f"not a zip archive: the zip64 end record offset {eocd64} is out of place")
            (sig, _, _, _, disk, cd_disk, n_here, n_total, cd_size,
             cd_offset) = _EOCD64.unpack(r.get(eocd64, eocd64 + _EOCD64.size))
            if sig != _EOCD64_SIG:
                raise BlobError(f"not a zip archive: no zip64 end record at byte {eocd64}")
            cd_end = eocd64
    if disk or cd_disk or n_here != n_total or n_total > MAX_RECORDS or cd_offset + cd_size > cd_end:
        raise BlobError(f"not a zip archive: a central directory of {n_total} records at [{cd_offset}, "
                        f"{cd_offset + cd_size}) does not fit a single-disk torch.save blob")
    cd = r.get(cd_offset, cd_offset + cd_size)
    records: dict[str, _Record] = {}
    pos = 0
    for _ in range(n_total):
        if pos + _CENTRAL.size > cd_size:
            raise BlobError("not a zip archive: the central directory ends inside a record")
        (sig, _, _, flags, method, _, _, crc, csize, size, name_len, extra_len, comment_len, _, _, _,
         offset) = _CENTRAL.unpack_from(cd, pos)
        stop = pos + _CENTRAL.size + name_len + extra_len + comment_len
        if sig != _CENTRAL_SIG or stop > cd_size:
            raise BlobError(f"not a zip archive: no central directory record at byte {cd_offset + pos}")
        name = bytes(cd[pos + _CENTRAL.size: pos + _CENTRAL.size + name_len]).decode(
            "utf-8" if flags & 0x800 else "cp437", errors="replace")
        if 0xFFFFFFFF in (csize, size, offset):
            size, csize, offset = _zip64_extra(cd[pos + _CENTRAL.size + name_len: stop - comment_len], name,
                                               size, csize, offset)
        if method != 0 or csize != size or size > n or flags & 1:
            raise BlobError(f"record {name} is compressed, encrypted or larger than the blob ({size} bytes); "
                            "torch.save never writes that, refusing to inflate it")
        if name in records:
            raise BlobError(f"record {name} appears twice in the archive")
        records[name] = _Record(name, method, crc, size, offset)
        pos = stop
    return records


def _zip64_extra(extra: bytes | memoryview, name: str, size: int, csize: int, offset: int) -> tuple[int, int, int]:
    """Sizes and offset from the zip64 extra field (id 1): 8 bytes each, only for the fields saturated."""
    pos = 0
    while pos + 4 <= len(extra):
        tag, length = struct.unpack_from("<HH", extra, pos)
        body = bytes(extra[pos + 4: pos + 4 + length])
        if tag == 1:
            values, at = [], 0
            for v in (size, csize, offset):
                if v == 0xFFFFFFFF:
                    if at + 8 > len(body):
                        break
                    v = struct.unpack_from("<Q", body, at)[0]
                    at += 8
                values.append(v)
            else:
                return values[0], values[1], values[2]
            break
        pos += 4 + length
    raise BlobError(f"record {name} needs a zip64 extra field that is missing or short")


def _record_bytes(r: BlobReader, rec: _Record) -> tuple[int, int]:
    """``[start, stop)`` of a record's data, from its local header."""
    end = rec.header_offset + _LOCAL_HEADER.size
    header = r.get(rec.header_offset, end) if end <= r.length else b""
    if len(header) != _LOCAL_HEADER.size or _LOCAL_HEADER.unpack(header)[0] != _LOCAL_SIG:
        raise BlobError(f"record {rec.name} has no local header at byte {rec.header_offset}")
    *_, name_len, extra_len = _LOCAL_HEADER.unpack(header)
    start = rec.header_offset + _LOCAL_HEADER.size + name_len + extra_len
    if start + rec.size > r.length:
        raise BlobError(f"record {rec.name} runs past the end of the blob")
    return start, start + rec.size


def _small_record(r: BlobReader, rec: _Record) -> bytes:
    """A structural record's bytes (data.pkl, byteorder), CRC-checked as zip readers do."""
    start, stop = _record_bytes(r, rec)
    data = bytes(r.get(start, stop))
    if zlib.crc32(data) != rec.crc:
        raise BlobError(f"record {rec.name} fails its CRC-32 check (damaged)")
    return data


def parse_blob(reader: BlobReader, length: int) -> BlobLayout:
    """Read a blob's structure (a few hundred bytes at its start and end) into a :class:`BlobLayout`."""
    if length != reader.length:
        raise ValueError(f"parse_blob: length {length} != the reader's {reader.length}")
    infos = _zip_records(reader)
    pkl = [n for n in infos if n.endswith("/data.pkl") and n.count("/") == 1]
    if len(pkl) != 1 or infos[pkl[0]].size > MAX_PICKLE:
        raise BlobError(f"expected one <archive>/data.pkl record, found {brief(sorted(infos))}")
    prefix = pkl[0][: -len("data.pkl")]
    order = _small_record(reader, infos[prefix + "byteorder"]) if prefix + "byteorder" in infos else b"little"
    if order != b"little":
        raise BlobError(f"the blob was saved {brief(order)}-endian; ckpt reads little-endian blobs only")
    pickled = _small_record(reader, infos[pkl[0]])
    try:
        args = _TensorPickle(pickled, "data.pkl").load()
    except BlobError:
        raise
    except Exception as e:  # damaged pickles: anything
        raise BlobError(f"data.pkl does not load ({type(e).__name__}: {str(e)[:160]})") from None
    if type(args) is not _TensorArgs:
        raise BlobError(f"data.pkl holds a {type(args).__name__}, not a tensor")
    record = infos.get(f"{prefix}data/{args.storage.key}")
    if record is None:
        raise BlobError(f"data.pkl names storage record {args.storage.key!r}, which the archive lacks")
    nbytes = args.storage.numel * args.storage.dtype.itemsize
    if record.size != nbytes:
        raise BlobError(f"storage record {record.name} holds {record.size} bytes but data.pkl declares "
                        f"{args.storage.numel} {args.storage.dtype} elements ({nbytes} bytes)")
    payload, _ = _record_bytes(reader, record)
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
