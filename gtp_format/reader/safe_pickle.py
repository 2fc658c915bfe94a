"""Inert records for DCP ``.metadata``: how ``ckpt`` unpickles a file nobody vouches for.

PyTorch reads ``.metadata`` with a plain ``pickle.load``: whoever wrote the file can run any code
on the machine that inspects it. This module reads the same files through the one allow-list
(:mod:`gtp_format.reader.allow_list`, which also says what each global is and why it is there)
with the *inert* resolver: nothing from torch is imported or constructed. Every allowed class maps
to an inert :class:`Record` that only stores the state the pickle hands it, so no
``__setstate__`` or ``__init__`` of a third-party class ever runs; dtypes become
:class:`~gtp_format.dtypes.DType` values and paths plain strings. The readers then validate the
records' contents. ``--load`` reads through the same records: DCP gets metadata built from the
checked model (:class:`gtp_runtime.checkpoint.verified.VerifiedReader`), never the file's own classes.

Beyond the table's shared guards, ``BUILD`` hands a record its state dict, which the record keeps
by reference rather than copying: a crafted file that passes one large dict to many ``BUILD``
opcodes costs nothing more here. The records are read-only, so sharing is harmless. A size is
only ever a number here, so a tensor declaring 10**15 elements is a value to report, never an
allocation.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import PurePosixPath, PureWindowsPath
from typing import Any, ClassVar

from gtp_format.dtypes import DTYPES
from gtp_format.reader.allow_list import (
    ALLOWED,
    Allowed,
    Kind,
    brief,
    layout_name,
    path_parts,
    size_dims,
    unpickle,
)
from gtp_format.reader.allow_list import (
    UnsafePickle as UnsafePickle,  # re-exported: callers catch it from here
)
from gtp_format.torch_adapter import torch_attr

MAX_FIELDS = 64  # a record with (dict, slots) state: DCP classes have fewer than 10 fields

ALLOWED_GLOBALS = ALLOWED  # the one table (gtp_format.reader.allow_list), under its old name here


class Record:
    """Inert stand-in for an allow-listed class: it holds what the pickle gives it, nothing else.

    ``NEWOBJ`` creates it with ``object.__new__`` (it defines no ``__new__``/``__init__``, so
    arguments are refused), and ``BUILD`` calls :meth:`__setstate__`, which adopts the state dict
    as the instance's ``__dict__`` without copying it. Fields are read with :meth:`get` (a
    property, so a field named ``get`` cannot shadow it) or ``vars(record)``.
    """

    kind: ClassVar[str] = "record"

    def __setstate__(self, state: Any) -> None:
        if type(state) is dict:
            self.__dict__ = state
            return
        if type(state) is tuple and len(state) == 2 and all(s is None or type(s) is dict for s in state):
            merged = {**(state[0] or {}), **(state[1] or {})}  # (dict state, slot state)
            if len(merged) <= MAX_FIELDS:
                self.__dict__ = merged
                return
        raise pickle.UnpicklingError(f"unexpected pickled state for {self.kind}: {brief(state)}")

    @property
    def get(self) -> Callable[..., Any]:
        return self.__dict__.get

    @property
    def state(self) -> dict[str, Any]:
        return self.__dict__

    def __repr__(self) -> str:
        return f"<{self.kind} {brief(self.__dict__)}>"


class MetadataRecord(Record):
    kind = "Metadata"


class TensorStorageRecord(Record):
    kind = "TensorStorageMetadata"


class BytesStorageRecord(Record):
    kind = "BytesStorageMetadata"


class ChunkRecord(Record):
    kind = "ChunkStorageMetadata"


class TensorPropertiesRecord(Record):
    """``TensorProperties.__getstate__`` pickles a 5-tuple rather than a dict."""

    kind = "TensorProperties"
    _FIELDS = ("dtype", "layout", "requires_grad", "memory_format", "pin_memory")

    def __setstate__(self, state: Any) -> None:
        if type(state) is tuple and len(state) == len(self._FIELDS):
            self.__dict__ = dict(zip(self._FIELDS, state, strict=True))
        else:
            super().__setstate__(state)


class MetadataIndexRecord(Record):
    kind = "MetadataIndex"


class StorageMetaRecord(Record):
    kind = "StorageMeta"


class StorageInfoRecord(Record):
    kind = "_StorageInfo"


class StoragePrefixRecord(Record):
    kind = "_StoragePrefix"


class SavePlanRecord(Record):
    kind = "SavePlan"


class WriteItemRecord(Record):
    kind = "WriteItem"


class TensorWriteDataRecord(Record):
    kind = "TensorWriteData"


class BytesIOWriteDataRecord(Record):
    kind = "BytesIOWriteData"


class EnumRecord(Record):
    """An Enum member, pickled as ``EnumClass(value)`` (a ``REDUCE``, so it takes arguments)."""

    kind = "enum"
    args: tuple[Any, ...]

    def __new__(cls, *args: Any) -> EnumRecord:
        self = object.__new__(cls)
        self.args = args  # the tuple the pickle built: kept, not copied
        return self

    def __init__(self, *args: Any) -> None:  # taken in __new__
        pass

    @property
    def value(self) -> Any:
        return self.args[0] if len(self.args) == 1 else None


class MemFormatEncodingRecord(EnumRecord):
    kind = "_MEM_FORMAT_ENCODING"


class WriteItemTypeRecord(EnumRecord):
    kind = "WriteItemType"


@dataclass(frozen=True)
class TorchConstant:
    """A torch layout or memory format by name (``torch.strided``); nothing from torch is imported."""

    name: str

    def __repr__(self) -> str:
        return f"torch.{self.name}"

    @property
    def torch(self) -> Any:
        """The real constant, for code that rebuilds DCP objects (imports torch)."""
        return torch_attr(self.name)


_RECORDS: dict[str, type[Record]] = {cls.kind: cls for cls in (
    MetadataRecord, TensorStorageRecord, BytesStorageRecord, ChunkRecord, TensorPropertiesRecord,
    MetadataIndexRecord, StorageMetaRecord, StorageInfoRecord, StoragePrefixRecord, SavePlanRecord,
    WriteItemRecord, TensorWriteDataRecord, BytesIOWriteDataRecord, MemFormatEncodingRecord, WriteItemTypeRecord)}


def _get_layout(name: Any) -> TorchConstant:
    """Stand-in for ``torch.serialization._get_layout`` (called with ``"torch.strided"``): a table lookup."""
    return TorchConstant(layout_name(name))


def _posix_path(*parts: Any) -> str:
    return str(PurePosixPath(*path_parts(parts)))


def _windows_path(*parts: Any) -> str:
    return str(PureWindowsPath(*path_parts(parts)))


def inert(entry: Allowed) -> Any:
    """The inert resolver: what the unpickler gets for an allowed global, never a torch object."""
    kind = entry.kind
    if kind in (Kind.CLASS, Kind.ENUM):
        return _RECORDS[entry.name]
    if kind is Kind.DTYPE:
        return DTYPES[entry.name]
    if kind is Kind.CONSTANT:
        return TorchConstant(entry.name)
    return {Kind.SIZE: size_dims, Kind.GET_LAYOUT: _get_layout, Kind.POSIX_PATH: _posix_path,
            Kind.WINDOWS_PATH: _windows_path}[kind]


def load_metadata_pickle(data: bytes, source: str) -> Any:
    """Unpickle DCP metadata bytes into inert records; one-line :class:`FormatError` on failure."""
    return unpickle(data, source, inert)
