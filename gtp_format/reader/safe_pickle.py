"""An allow-listing unpickler for DCP ``.metadata`` files.

PyTorch reads ``.metadata`` with a plain ``pickle.load``: whoever wrote the file can run any code
on the machine that inspects it. This module reads the same files while refusing every global
that a DCP metadata pickle has no business referencing, *before* anything is called.

What a torch 2.13 ``.metadata`` references (found by unpickling a real multi-rank save with a
recording ``find_class``)::

    torch.distributed.checkpoint.metadata  Metadata, TensorStorageMetadata, BytesStorageMetadata,
                                           ChunkStorageMetadata, TensorProperties, MetadataIndex,
                                           StorageMeta, _MEM_FORMAT_ENCODING
    torch.distributed.checkpoint.filesystem _StorageInfo
    torch.serialization                    _get_layout      (called with "torch.strided")
    torch                                  Size, and one global per dtype used (float32, bfloat16...)
    pathlib                                PosixPath        (StorageMeta.checkpoint_id)

Megatron adds, in some versions, ``Metadata.all_local_plans`` (DCP ``SavePlan``/``WriteItem``/
``TensorWriteData``/``WriteItemType`` and ``filesystem._StoragePrefix``) and pickles
``megatron.core.dist_checkpointing.strategies.torch.MCoreMetadata`` (a ``Metadata`` subclass,
mcore 0.15) or ``MCoreSavePlan`` (a ``SavePlan`` subclass, older versions); current Megatron keeps
empty dummy classes of those names only so that old files still load.

Nothing from torch is imported or constructed: every allowed class maps to an inert
:class:`Record` that only stores the state the pickle hands it, so no ``__setstate__`` or
``__init__`` of a third-party class ever runs. The readers then validate the records' contents.

Resource guards, because a small hostile file can still ask for a lot of memory or time:

* the stream is walked first by :func:`gtp_format.reader.pickle_scan.check_pickle`, which
  refuses memo indices no pickler could have written (the C unpickler sizes its memo array from
  them) and then the fast C unpickler runs, with the cyclic GC paused;
* no allowed callable copies an argument of unbounded size: ``torch.Size`` takes at most
  ``MAX_DIMS`` ints, a path at most ``MAX_PATH`` characters, and ``set``/``frozenset``/
  ``OrderedDict`` draw on a per-file element budget (the file's byte count). Otherwise one large
  list in the memo, passed to them a million times, would be copied a million times;
* ``BUILD`` hands a record its state dict, which the record keeps by reference rather than copying
  for the same reason. The records are read-only, so sharing is harmless;
* a size is only ever a number here, so a tensor declaring 10**15 elements is a value to report,
  never an allocation.
"""

from __future__ import annotations

import collections
import pickle
import reprlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import PurePosixPath, PureWindowsPath
from typing import Any, ClassVar

from gtp_format.dtypes import DTYPES, LAYOUTS, MEMORY_FORMATS
from gtp_format.errors import FormatError
from gtp_format.reader.pickle_scan import PickleScanError, ScannedUnpickler

MAX_DIMS = 64
MAX_PATH = 4096
MAX_FIELDS = 64  # a record with (dict, slots) state: DCP classes have fewer than 10 fields

_DCP_META = "torch.distributed.checkpoint.metadata"
_DCP_FS = "torch.distributed.checkpoint.filesystem"
_DCP_PLANNER = "torch.distributed.checkpoint.planner"
_MCORE_TORCH = "megatron.core.dist_checkpointing.strategies.torch"


class UnsafePickle(FormatError):
    """The pickle references a global outside the allow-list; nothing in it was executed."""


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


_BRIEF = reprlib.Repr()
_BRIEF.maxlevel, _BRIEF.maxdict, _BRIEF.maxlist, _BRIEF.maxtuple, _BRIEF.maxstring, _BRIEF.maxother = 2, 4, 4, 6, 60, 60


def brief(value: Any) -> str:
    """A short repr for error messages: bounded in depth and length, whatever the file built.

    ``repr`` of an int over 4,300 digits raises ``ValueError`` (CPython's conversion limit), and a
    value can nest such ints: those come out as a description instead of a second error.
    """
    try:
        return _BRIEF.repr(value)
    except (ValueError, RecursionError):
        return f"<a {type(value).__name__} too large to print>"


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


def _torch_size(dims: Any = ()) -> tuple[int, ...]:
    """``torch.Size(dims)`` as a plain tuple, refusing anything but a short tuple of ints >= 0."""
    if type(dims) not in (tuple, list) or len(dims) > MAX_DIMS:
        raise pickle.UnpicklingError(f"torch.Size argument is not a tuple of at most {MAX_DIMS} ints")
    dims = tuple(dims)  # a tuple is returned as is; a list (at most MAX_DIMS long) is copied
    for d in dims:
        if type(d) is not int or d < 0:
            raise pickle.UnpicklingError(f"torch.Size holds {brief(d)}, not a non-negative int")
    return dims


def _path_parts(parts: tuple[Any, ...]) -> tuple[str, ...]:
    if len(parts) > MAX_PATH or not all(type(p) is str for p in parts) or sum(map(len, parts)) > MAX_PATH:
        raise pickle.UnpicklingError(f"pathlib path parts are not at most {MAX_PATH} characters of strings")
    return parts


def _posix_path(*parts: Any) -> str:
    return str(PurePosixPath(*_path_parts(parts)))


def _windows_path(*parts: Any) -> str:
    return str(PureWindowsPath(*_path_parts(parts)))


@dataclass(frozen=True)
class TorchConstant:
    """A torch layout or memory format by name (``torch.strided``); nothing from torch is imported."""

    name: str

    def __repr__(self) -> str:
        return f"torch.{self.name}"

    @property
    def torch(self) -> Any:
        """The real constant, for code that rebuilds DCP objects (imports torch)."""
        import torch

        return getattr(torch, self.name)


def _get_layout(name: Any) -> TorchConstant:
    """Stand-in for ``torch.serialization._get_layout`` (called with ``"torch.strided"``): a table lookup."""
    if not isinstance(name, str) or name.removeprefix("torch.") not in LAYOUTS or not name.startswith("torch."):
        raise pickle.UnpicklingError(f"unknown torch layout {brief(name)}")
    return TorchConstant(name.removeprefix("torch."))


def _build_allow_list() -> dict[tuple[str, str], Any]:
    allow: dict[tuple[str, str], Any] = {
        (_DCP_META, "Metadata"): MetadataRecord,
        (_DCP_META, "TensorStorageMetadata"): TensorStorageRecord,
        (_DCP_META, "BytesStorageMetadata"): BytesStorageRecord,
        (_DCP_META, "ChunkStorageMetadata"): ChunkRecord,
        (_DCP_META, "TensorProperties"): TensorPropertiesRecord,
        (_DCP_META, "MetadataIndex"): MetadataIndexRecord,
        (_DCP_META, "StorageMeta"): StorageMetaRecord,
        (_DCP_META, "_MEM_FORMAT_ENCODING"): MemFormatEncodingRecord,
        (_DCP_FS, "_StorageInfo"): StorageInfoRecord,
        (_DCP_FS, "_StoragePrefix"): StoragePrefixRecord,
        (_DCP_PLANNER, "SavePlan"): SavePlanRecord,
        (_DCP_PLANNER, "WriteItem"): WriteItemRecord,
        (_DCP_PLANNER, "TensorWriteData"): TensorWriteDataRecord,
        (_DCP_PLANNER, "BytesIOWriteData"): BytesIOWriteDataRecord,
        (_DCP_PLANNER, "WriteItemType"): WriteItemTypeRecord,
        (_MCORE_TORCH, "MCoreMetadata"): MetadataRecord,
        (_MCORE_TORCH, "MCoreSavePlan"): SavePlanRecord,
        ("torch", "Size"): _torch_size,
        ("torch.serialization", "_get_layout"): _get_layout,
        ("collections", "OrderedDict"): collections.OrderedDict,  # resolved per file: CopyBudget
        ("builtins", "set"): set,
        ("builtins", "frozenset"): frozenset,
    }
    for module in ("pathlib", "pathlib._local"):  # Python 3.13 moved the classes to pathlib._local
        for name in ("PosixPath", "PurePosixPath"):
            allow[(module, name)] = _posix_path
        for name in ("WindowsPath", "PureWindowsPath"):
            allow[(module, name)] = _windows_path
    # dtypes, layouts and memory formats are pickled as module globals (``torch float32``); they
    # resolve to inert descriptions (gtp_format.dtypes), never to torch objects.
    allow.update({("torch", name): dtype for name, dtype in DTYPES.items()})
    allow.update({("torch", name): TorchConstant(name) for name in LAYOUTS | MEMORY_FORMATS})
    return allow


ALLOWED_GLOBALS: dict[tuple[str, str], Any] = _build_allow_list()


class CopyBudget:
    """Container constructors that copy their argument, charged against the file's size.

    A pickle can pass the same large list to ``set`` once per few bytes; each call copies it.
    The total number of elements copied is capped at the number of bytes in the file, which no
    genuine file comes near (each element it holds costs at least one opcode byte).
    """

    def __init__(self, limit: int, source: str) -> None:
        self.left, self.source = limit, source

    def charge(self, name: str, items: Any) -> Any:
        n = len(items) if hasattr(type(items), "__len__") else None
        if n is None or n > self.left:
            raise pickle.UnpicklingError(f"{name}() is given more elements than {self.source} can hold")
        self.left -= n
        return items

    def set(self, items: Any = ()) -> set[Any]:
        return set(self.charge("set", items))

    def frozenset(self, items: Any = ()) -> frozenset[Any]:
        return frozenset(self.charge("frozenset", items))

    def ordered_dict(self, items: Any = ()) -> collections.OrderedDict[Any, Any]:
        return collections.OrderedDict(self.charge("OrderedDict", items))


class _AllowListUnpickler(ScannedUnpickler):  # the C unpickler, after the opcode walk
    def __init__(self, data: bytes, source: str) -> None:
        super().__init__(data, source)
        budget = CopyBudget(len(data), source)
        self._per_file = {("builtins", "set"): budget.set, ("builtins", "frozenset"): budget.frozenset,
                          ("collections", "OrderedDict"): budget.ordered_dict}

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self._per_file.get((module, name)) or ALLOWED_GLOBALS[(module, name)]
        except KeyError:
            raise UnsafePickle(
                f"refusing to load {self.source}: it references the global {module}.{name}, which is not "
                "a DCP metadata type; nothing in the file was executed (do not open it with torch.load or "
                "torch.distributed.checkpoint)"
            ) from None

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafePickle(f"refusing to load {self.source}: it uses pickle persistent ids, which DCP "
                           "metadata never does; nothing in the file was executed")


def load_metadata_pickle(data: bytes, source: str) -> Any:
    """Unpickle DCP metadata bytes through the allow-list; one-line :class:`FormatError` on failure."""
    try:
        return _AllowListUnpickler(data, source).load()
    except FormatError:
        raise
    except PickleScanError as e:
        raise FormatError(f"cannot parse {source} as DCP metadata ({e}); nothing in it was executed; the file is "
                        "damaged or crafted: restore it from a good copy") from None
    except RecursionError:
        raise FormatError(f"cannot parse {source}: objects nested too deeply for DCP metadata") from None
    except Exception as e:  # a damaged pickle raises anything from EOFError to TypeError
        raise FormatError(
            f"cannot parse {source} as DCP metadata ({type(e).__name__}: {e}); the file is damaged or is "
            "not a .metadata pickle: restore it from a good copy"
        ) from None
