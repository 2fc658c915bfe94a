"""Decode a ``torch.save`` blob of one tensor without copying its elements.

DCP stores every chunk as a complete ``torch.save`` zip archive inside a ``.distcp`` file.
``torch.load`` would copy the blob into a buffer, then copy the element record into a new
storage; verifying hundreds of GB that way is bound by memory copies and page faults. Here
:mod:`ckpt_tool.reader.zip_blob` reads the archive's structure (end records, central directory,
local headers, and the small ``data.pkl`` record, CRC-checked; only what torch.save writes is
accepted), ``data.pkl``
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
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch.storage import _get_dtype_from_pickle_storage_type

from ckpt_tool.reader.safe_pickle import brief
from ckpt_tool.reader.zip_blob import BlobError, BlobReader, record_bytes, small_record, zip_records
from gtp_runtime.checkpoint.pickle_scan import ScannedUnpickler

MAX_PICKLE = 1 << 20  # data.pkl of one tensor is ~150 bytes
MAX_DIMS = 64


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


def parse_blob(reader: BlobReader) -> BlobLayout:
    """Read a blob's structure (a few hundred bytes at its start and end) into a :class:`BlobLayout`."""
    infos = zip_records(reader)
    pkl = [n for n in infos if n.endswith("/data.pkl") and n.count("/") == 1]
    if len(pkl) != 1 or infos[pkl[0]].size > MAX_PICKLE:
        raise BlobError(f"expected one <archive>/data.pkl record, found {brief(sorted(infos))}")
    prefix = pkl[0][: -len("data.pkl")]
    order = small_record(reader, infos[prefix + "byteorder"]) if prefix + "byteorder" in infos else b"little"
    if order != b"little":
        raise BlobError(f"the blob was saved {brief(order)}-endian; ckpt reads little-endian blobs only")
    pickled = small_record(reader, infos[pkl[0]])
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
    payload, _ = record_bytes(reader, record)
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
