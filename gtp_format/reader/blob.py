"""Decode a ``torch.save`` blob of one tensor without copying its elements.

DCP stores every chunk as a complete ``torch.save`` zip archive inside a ``.distcp`` file.
``torch.load`` would copy the blob into a buffer, then copy the element record into a new
storage; verifying hundreds of GB that way is bound by memory copies and page faults. Here
:mod:`gtp_format.reader.zip_blob` reads the archive's structure (end records, central directory,
local headers, and the small ``data.pkl`` record, CRC-checked; only what torch.save writes is
accepted), ``data.pkl`` goes through an allow-listing unpickler whose only callables record their
arguments, and the elements are a view over the caller's buffer, never copied. The view's sizes,
strides and offset are checked against the storage before it is made.

What the pickle may reference is what ``torch.save`` writes for a plain tensor:
``torch._utils._rebuild_tensor_v2`` with one ``torch.<Type>Storage`` class for the classic dtypes,
or ``_rebuild_tensor_v3`` with ``torch.storage.UntypedStorage`` and the dtype itself for those
without a storage class (float8, uint16...), ``collections.OrderedDict`` (empty backward hooks),
and a persistent id naming the storage record. Nothing here imports torch: dtypes come from
:mod:`gtp_format.dtypes`, :func:`element_view` gives the elements as a numpy array
(what ``verify --data`` scans), and only :func:`as_tensor` (``show``, ``diff``, ``migrate``)
turns them into a torch tensor, still without a copy. ``tests/format/test_blob.py`` checks both
against ``torch.load`` on every fixture chunk.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from gtp_format.dtypes import BY_STORAGE, DTYPES, DType
from gtp_format.hashing import crc32
from gtp_format.reader.safe_pickle import brief
from gtp_format.reader.unpickler import ScannedUnpickler
from gtp_format.reader.zip_blob import BlobError, BlobReader, ZipRecord, record_bytes, small_record, zip_records
from gtp_format.scan import carrier
from gtp_format.torch_adapter import load_torch

MAX_PICKLE = 1 << 20  # data.pkl of one tensor is ~150 bytes
MAX_DIMS = 64


@dataclass(frozen=True)
class BlobLayout:
    """Where a blob's elements are and how they view as a tensor."""

    dtype: DType
    payload_offset: int  # of the storage record's bytes, from the blob's start
    storage_numel: int
    storage_offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    payload_crc: int = 0  # the zip directory's CRC-32 of the storage record: checked wherever the payload is read

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


@dataclass(frozen=True)
class _StorageId:
    dtype: DType  # uint8 for an untyped storage, whose numel counts bytes
    key: str
    numel: int


@dataclass(frozen=True)
class _TensorArgs:
    storage: _StorageId
    storage_offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


class _StorageType:
    def __init__(self, dtype: DType) -> None:
        self.dtype = dtype


_UNTYPED = _StorageType(DTYPES["uint8"])


MAX_INT = 1 << 48  # sizes, strides and offsets: far beyond any tensor, far below int64 (strides times itemsize)


def _ints(value: Any, what: str) -> tuple[int, ...]:
    if type(value) is not tuple or len(value) > MAX_DIMS or \
            not all(type(v) is int and 0 <= v < MAX_INT for v in value):
        raise BlobError(f"data.pkl gives {what} {brief(value)}, not a short tuple of non-negative ints below 2**48 "
                        "(a stride that large would overflow)")
    return value


def _rebuild_tensor_v2(storage: Any, storage_offset: Any, size: Any, stride: Any, requires_grad: Any = False,
                       backward_hooks: Any = None, metadata: Any = None) -> _TensorArgs:
    if type(storage) is not _StorageId or type(storage_offset) is not int or not 0 <= storage_offset < MAX_INT:
        raise BlobError("data.pkl rebuilds a tensor from something other than one stored record")
    if backward_hooks:
        raise BlobError("data.pkl attaches backward hooks to the tensor")
    return _TensorArgs(storage, storage_offset, _ints(size, "size"), _ints(stride, "stride"))


def _rebuild_tensor_v3(storage: Any, storage_offset: Any, size: Any, stride: Any, requires_grad: Any,
                       backward_hooks: Any, dtype: Any, metadata: Any = None) -> _TensorArgs:
    """The dtypes without a storage class: an untyped storage (numel in bytes) and the dtype."""
    if type(storage) is not _StorageId or storage.dtype is not _UNTYPED.dtype or type(dtype) is not DType:
        raise BlobError("data.pkl rebuilds a tensor from something other than one untyped record and a dtype")
    numel, rest = divmod(storage.numel, dtype.itemsize)
    if rest:
        raise BlobError(f"storage record {storage.key!r} holds {storage.numel} bytes, not a whole number of "
                        f"{dtype} elements")
    return _rebuild_tensor_v2(_StorageId(dtype, storage.key, numel), storage_offset, size, stride,
                              requires_grad, backward_hooks)


_REBUILD = {("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
            ("torch._utils", "_rebuild_tensor_v3"): _rebuild_tensor_v3,
            ("collections", "OrderedDict"): dict,  # backward hooks: must be empty, checked above
            ("torch.storage", "UntypedStorage"): _UNTYPED}


class _TensorPickle(ScannedUnpickler):
    def find_class(self, module: str, name: str) -> Any:
        found = _REBUILD.get((module, name))
        if found is not None:
            return found
        if module == "torch" and name in BY_STORAGE:
            return _StorageType(BY_STORAGE[name])
        if module == "torch" and name in DTYPES:
            return DTYPES[name]  # _rebuild_tensor_v3's dtype argument
        raise BlobError(f"data.pkl references {module}.{name}, which a saved tensor never needs; nothing was run")

    def persistent_load(self, pid: Any) -> _StorageId:
        if (type(pid) is not tuple or len(pid) != 5 or pid[0] != "storage" or type(pid[1]) is not _StorageType
                or type(pid[2]) is not str or type(pid[4]) is not int or not 0 <= pid[4] < MAX_INT):
            raise BlobError(f"data.pkl names storage {brief(pid)}, not ('storage', type, key, location, numel)")
        return _StorageId(pid[1].dtype, pid[2], pid[4])


MEMO_PICKLE = 4096  # a tensor's data.pkl up to this size is parsed once per process (see _tensor_args)


@functools.lru_cache(maxsize=1024)
def _tensor_args(pickled: bytes) -> Any:
    """What a tensor blob's ``data.pkl`` of exactly these bytes holds (:class:`_TensorArgs`, frozen: safe to share).

    Why: every chunk of a ``torch_dist`` checkpoint is a ``torch.save`` blob whose ``data.pkl`` names only the
    storage, dtype, shape and stride, so chunks of one shape carry the same bytes (13 distinct ones among a
    26.5 MB checkpoint's ~100 chunks), and each was scanned and replayed again: 15 ms of a 85 ms local
    ``reshard`` or ``export --to torch`` of it. The result is a function of the bytes alone; failures are not
    kept (each damaged blob is judged, and named, on its own)."""
    return _TensorPickle(pickled, "data.pkl").load()


def load_data_pkl(reader: BlobReader, infos: dict[str, ZipRecord], unpickler: type[ScannedUnpickler],
                  limit: int) -> tuple[str, Any]:
    """The archive's ``<archive>/`` prefix and what its one ``data.pkl`` holds, through ``unpickler``.

    Shared by tensor blobs (here) and plain objects (:mod:`gtp_format.reader.object_blob`): a
    missing, repeated or oversized ``data.pkl``, a failed CRC and any exception of a damaged
    pickle all come out as one :class:`BlobError`.
    """
    pkl = [n for n in infos if n.endswith("/data.pkl") and n.count("/") == 1]
    if len(pkl) != 1 or infos[pkl[0]].size > limit:
        raise BlobError(f"expected one <archive>/data.pkl record of at most {limit} bytes, found "
                        f"{brief(sorted(infos))}")
    pickled = small_record(reader, infos[pkl[0]])
    try:
        if unpickler is _TensorPickle and len(pickled) <= MEMO_PICKLE:
            return pkl[0][: -len("data.pkl")], _tensor_args(bytes(pickled))
        return pkl[0][: -len("data.pkl")], unpickler(pickled, "data.pkl").load()
    except BlobError:
        raise
    except Exception as e:  # damaged pickles: anything
        raise BlobError(f"data.pkl does not load ({type(e).__name__}: {str(e)[:160]})") from None


def parse_blob(reader: BlobReader) -> BlobLayout:
    """Read a blob's structure (a few hundred bytes at its start and end) into a :class:`BlobLayout`."""
    infos = zip_records(reader)
    prefix, args = load_data_pkl(reader, infos, _TensorPickle, MAX_PICKLE)
    order = small_record(reader, infos[prefix + "byteorder"]) if prefix + "byteorder" in infos else b"little"
    if order != b"little":
        raise BlobError(f"the blob was saved {brief(order)}-endian; ckpt reads little-endian blobs only")
    if type(args) is not _TensorArgs:
        raise BlobError(f"data.pkl holds a {type(args).__name__}, not a tensor")
    record = infos.get(f"{prefix}data/{args.storage.key}")
    if record is None:
        raise BlobError(f"data.pkl names storage record {args.storage.key!r}, which the archive lacks")
    nbytes = args.storage.numel * args.storage.dtype.itemsize
    if record.size != nbytes:
        raise BlobError(f"storage record {record.name!r} holds {record.size} bytes but data.pkl declares "
                        f"{args.storage.numel} {args.storage.dtype} elements ({nbytes} bytes)")
    for other in infos.values():  # the small records (version, serialization id...): CRC-checked here
        if other is not record and other.name != prefix + "data.pkl":
            if other.size > MAX_PICKLE:
                raise BlobError(f"record {other.name!r} holds {other.size} bytes; torch.save writes only the "
                                "storage record that large")
            small_record(reader, other)
    payload, _ = record_bytes(reader, record)
    return BlobLayout(args.storage.dtype, payload, args.storage.numel, args.storage_offset, args.size, args.stride,
                      record.crc)


def check_payload_crc(layout: BlobLayout, payload: memoryview | bytes) -> None:
    """The storage record's bytes match the CRC-32 the zip directory records for them.

    :func:`gtp_format.hashing.crc32` (zlib's CRC-32, through zlib-ng) runs over bytes
    the caller already holds (the data pass's window), without the GIL; it is what makes one flipped bit in a
    genuine Megatron checkpoint, which has no manifest checksums, an error rather than a pass.
    """
    if crc32(payload) != layout.payload_crc:
        raise BlobError(f"the storage record fails its CRC-32 check (the zip directory says {layout.payload_crc:08x}): "
                        "its bytes are damaged")


def _check_fits(layout: BlobLayout) -> None:
    """The view's elements all lie inside its storage (numpy's as_strided, unlike torch's, does not check)."""
    if 0 in layout.size:
        return
    last = layout.storage_offset + sum((n - 1) * st for n, st in zip(layout.size, layout.stride))
    if last >= layout.storage_numel:
        raise BlobError(f"the tensor view (size {list(layout.size)}, stride {list(layout.stride)}, offset "
                        f"{layout.storage_offset}) reaches element {last} of a {layout.storage_numel}-element storage")


def element_view(layout: BlobLayout, payload: memoryview | bytes) -> np.ndarray:
    """The tensor's elements over ``payload`` (the storage record's bytes) as a numpy array, no copy.

    The elements keep their stored bits, viewed through :func:`gtp_format.scan.carrier` (bfloat16
    as uint16, for one): this is what the NaN/Inf scan reads, and it needs no torch.
    """
    _check_fits(layout)
    kind = carrier(layout.dtype)
    base = np.frombuffer(payload, dtype=kind, count=layout.storage_numel)
    if layout.contiguous_whole:
        return base.reshape(layout.size)
    strides = tuple(st * kind.itemsize for st in layout.stride)
    return np.lib.stride_tricks.as_strided(base[layout.storage_offset:], layout.size, strides, writeable=False)


def as_tensor(elements: np.ndarray, dtype: DType) -> Any:
    """The ``torch.Tensor`` over the same memory as ``elements`` (from :func:`element_view`), no copy.

    Only ``show``, ``diff`` and ``migrate-aliased`` need tensors, so only they import torch. The
    carrier's bits are reinterpreted as the real dtype (uint16 as bfloat16, say): same width.
    """
    torch = load_torch()
    t = torch.from_numpy(elements)
    return t if t.dtype == dtype.torch else t.view(dtype.torch)
