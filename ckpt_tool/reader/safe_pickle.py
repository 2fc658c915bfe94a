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

Nothing from torch.distributed is imported or constructed: every allowed class maps to an inert
:class:`Record` that only stores the state the pickle hands it, so no ``__setstate__`` or
``__init__`` of a third-party class ever runs. The readers then validate the records' contents.

Two resource guards live here as well:

* the pure-Python unpickler is used, not the C one: the C unpickler grows its memo table to
  twice the largest ``LONG_BINPUT`` index it sees, so an 11-byte pickle can ask for tens of GiB
  (measured: index 2**25 costs 512 MiB). The Python one keeps the memo in a dict.
* ``torch.Size`` arguments must be short tuples of non-negative ints; a size is only ever a
  number here, so a tensor declaring 10**15 elements is a value to report, never an allocation.
"""

from __future__ import annotations

import collections
import io
import pickle
from pathlib import PurePosixPath, PureWindowsPath
from typing import Any, ClassVar

import torch

from ckpt_tool.errors import CkptError

MAX_DIMS = 64

_DCP_META = "torch.distributed.checkpoint.metadata"
_DCP_FS = "torch.distributed.checkpoint.filesystem"
_DCP_PLANNER = "torch.distributed.checkpoint.planner"
_MCORE_TORCH = "megatron.core.dist_checkpointing.strategies.torch"


class UnsafePickle(CkptError):
    """The pickle references a global outside the allow-list; nothing in it was executed."""


class Record:
    """Inert stand-in for an allow-listed class: it stores what the pickle gives it, nothing else.

    ``NEWOBJ`` calls ``__new__`` with the class's args, ``REDUCE`` calls the class, ``BUILD``
    calls ``__setstate__``; all three just record data.
    """

    kind: ClassVar[str] = "record"
    args: tuple[Any, ...]
    state: dict[str, Any]

    def __new__(cls, *args: Any, **kwargs: Any) -> Record:
        self = object.__new__(cls)
        self.args = args
        self.state = dict(kwargs)
        return self

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # state was taken in __new__
        pass

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2 and all(s is None or isinstance(s, dict) for s in state):
            state = {**(state[0] or {}), **(state[1] or {})}  # (dict state, slot state)
        if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
            raise pickle.UnpicklingError(f"unexpected pickled state for {self.kind}: {type(state).__name__}")
        self.state.update(state)

    def get(self, name: str, default: Any = None) -> Any:
        return self.state.get(name, default)

    def __repr__(self) -> str:
        return f"<{self.kind} {self.state!r}>"


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
        if isinstance(state, tuple) and len(state) == len(self._FIELDS):
            self.state.update(zip(self._FIELDS, state, strict=True))
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
    """An Enum member, pickled as ``EnumClass(value)``."""

    kind = "enum"

    @property
    def value(self) -> Any:
        return self.args[0] if len(self.args) == 1 else None


class MemFormatEncodingRecord(EnumRecord):
    kind = "_MEM_FORMAT_ENCODING"


class WriteItemTypeRecord(EnumRecord):
    kind = "WriteItemType"


def _torch_size(dims: Any = ()) -> tuple[int, ...]:
    """``torch.Size(dims)`` as a plain tuple, refusing anything but a short tuple of ints >= 0."""
    if not isinstance(dims, (tuple, list)) or len(dims) > MAX_DIMS:
        raise pickle.UnpicklingError(f"torch.Size argument is not a tuple of at most {MAX_DIMS} ints")
    for d in dims:
        if type(d) is not int or d < 0:
            raise pickle.UnpicklingError(f"torch.Size holds {d!r}, not a non-negative int")
    return tuple(dims)


def _posix_path(*parts: Any) -> str:
    if not all(isinstance(p, str) for p in parts):
        raise pickle.UnpicklingError("pathlib path parts are not strings")
    return str(PurePosixPath(*parts))


def _windows_path(*parts: Any) -> str:
    if not all(isinstance(p, str) for p in parts):
        raise pickle.UnpicklingError("pathlib path parts are not strings")
    return str(PureWindowsPath(*parts))


_LAYOUTS = {str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)}


def _get_layout(name: Any) -> torch.layout:
    """Stand-in for ``torch.serialization._get_layout``: a lookup in a fixed table."""
    if not isinstance(name, str) or name not in _LAYOUTS:
        raise pickle.UnpicklingError(f"unknown torch layout {name!r}")
    return _LAYOUTS[name]


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
        ("collections", "OrderedDict"): collections.OrderedDict,
        ("builtins", "set"): set,
        ("builtins", "frozenset"): frozenset,
    }
    for module in ("pathlib", "pathlib._local"):  # Python 3.13 moved the classes to pathlib._local
        for name in ("PosixPath", "PurePosixPath"):
            allow[(module, name)] = _posix_path
        for name in ("WindowsPath", "PureWindowsPath"):
            allow[(module, name)] = _windows_path
    # dtypes, layouts and memory formats are pickled as module globals (``torch float32``); they
    # are inert values, and only values of those exact types are exposed.
    for name, value in vars(torch).items():
        if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
            allow[("torch", name)] = value
    return allow


ALLOWED_GLOBALS: dict[tuple[str, str], Any] = _build_allow_list()


class _AllowListUnpickler(pickle._Unpickler):  # the pure-Python one: see the module docstring
    def __init__(self, data: bytes, source: str) -> None:
        super().__init__(io.BytesIO(data))
        self._source = source

    def find_class(self, module: str, name: str) -> Any:
        try:
            return ALLOWED_GLOBALS[(module, name)]
        except KeyError:
            raise UnsafePickle(
                f"refusing to load {self._source}: it references the global {module}.{name}, which is not "
                "a DCP metadata type; nothing in the file was executed (do not open it with torch.load or "
                "torch.distributed.checkpoint)"
            ) from None

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafePickle(f"refusing to load {self._source}: it uses pickle persistent ids, which DCP "
                           "metadata never does; nothing in the file was executed")


def load_metadata_pickle(data: bytes, source: str) -> Any:
    """Unpickle DCP metadata bytes through the allow-list; one-line :class:`CkptError` on failure."""
    try:
        return _AllowListUnpickler(data, source).load()
    except CkptError:
        raise
    except RecursionError:
        raise CkptError(f"cannot parse {source}: objects nested too deeply for DCP metadata") from None
    except Exception as e:  # a damaged pickle raises anything from EOFError to TypeError
        raise CkptError(
            f"cannot parse {source} as DCP metadata ({type(e).__name__}: {e}); the file is damaged or is "
            "not a .metadata pickle: restore it from a good copy"
        ) from None
