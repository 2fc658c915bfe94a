"""The one allow-list of globals a DCP ``.metadata`` pickle may reference, and what each one is.

One reader unpickles ``.metadata``, for ``ckpt`` and ``--load`` alike: the inert records of
:mod:`gtp_format.reader.safe_pickle`, which ``--load`` hands to DCP as a storage reader built from
the checked model (:mod:`gtp_runtime.checkpoint.verified`), so no real DCP class is ever built from
a file. There used to be two readers with a table each, and the tables drifted: Python 3.13
pickles paths as ``pathlib._local.PosixPath``, which one table listed and the other did not, so
``--load`` refused the runtime's own checkpoints on 3.13. Now there is one table, :data:`ALLOWED`,
from the name a pickle writes (module, qualified name) to an :class:`Allowed` entry saying what the
global *is*: its :class:`Kind` and its canonical home. The reader is a resolver, a function from an
entry to the object the unpickler gets.

What a torch 2.13 ``.metadata`` references (found by unpickling a real multi-rank save with a
recording ``find_class``)::

    torch.distributed.checkpoint.metadata   Metadata, TensorStorageMetadata, BytesStorageMetadata,
                                            ChunkStorageMetadata, TensorProperties, MetadataIndex,
                                            StorageMeta, _MEM_FORMAT_ENCODING
    torch.distributed.checkpoint.filesystem _StorageInfo
    torch.serialization                     _get_layout      (called with "torch.strided")
    torch                                   Size, and one global per dtype used (float32, bfloat16...)
    pathlib                                 PosixPath        (StorageMeta.checkpoint_id; Python 3.10-3.12)
    pathlib._local                          PosixPath        (the same, as Python 3.13 writes it)

How each Python pickles ``PosixPath("/ck/iter_1")`` (checked against the real interpreters):
3.10-3.12 write ``pathlib.PosixPath`` called with the parts ``("/", "ck", "iter_1")``; 3.13 writes
``pathlib._local.PosixPath`` called with the one string ``"/ck/iter_1"``. Both resolve to the
same entry, so a checkpoint saved on one version reads on every other.

Megatron adds, in some versions, ``Metadata.all_local_plans`` (DCP ``SavePlan``/``WriteItem``/
``TensorWriteData``/``WriteItemType`` and ``filesystem._StoragePrefix``) and pickles
``megatron.core.dist_checkpointing.strategies.torch.MCoreMetadata`` (a ``Metadata`` subclass,
mcore 0.15) or ``MCoreSavePlan`` (a ``SavePlan`` subclass, older versions); current Megatron keeps
empty dummy classes of those names only so that old files still load. Their canonical home is the
DCP base class: nothing the readers use lives in the subclass.

Resource guards, because a small hostile file can still ask for a lot of
memory or time: :class:`AllowListUnpickler` runs only after
:func:`gtp_format.reader.pickle_scan.check_pickle` has walked the stream; ``torch.Size`` takes at
most :data:`MAX_DIMS` ints and a path at most :data:`MAX_PATH` characters (:func:`size_dims`,
:func:`path_parts`); ``set``/``frozenset``/``OrderedDict`` draw on a per-file element budget
(:class:`CopyBudget`), else one large list in the memo passed to them a million times would be
copied a million times.
"""

from __future__ import annotations

import collections
import enum
import pickle
import reprlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gtp_format.dtypes import DTYPES, MEMORY_FORMATS, TENSOR_LAYOUTS
from gtp_format.errors import FormatError
from gtp_format.reader.pickle_scan import PickleScanError
from gtp_format.reader.unpickler import ScannedUnpickler

MAX_DIMS = 64
MAX_PATH = 4096

DCP_META = "torch.distributed.checkpoint.metadata"
DCP_FS = "torch.distributed.checkpoint.filesystem"
DCP_PLANNER = "torch.distributed.checkpoint.planner"
MCORE_TORCH = "megatron.core.dist_checkpointing.strategies.torch"


class Kind(enum.Enum):
    """What an allowed global is, which decides how a resolver builds it and what it may be called with."""

    CLASS = "class"  # a DCP class: NEWOBJ creates it (no arguments), BUILD hands it its state
    ENUM = "enum"  # an Enum class: REDUCE calls it with the member's value
    SIZE = "size"  # torch.Size(dims)
    GET_LAYOUT = "get_layout"  # torch.serialization._get_layout("torch.strided")
    DTYPE = "dtype"  # torch.float32 ... as a module global
    CONSTANT = "constant"  # a torch layout or memory format as a module global
    POSIX_PATH = "posix_path"  # pathlib.PosixPath / PurePosixPath called with parts or one string
    WINDOWS_PATH = "windows_path"  # pathlib.WindowsPath / PureWindowsPath, likewise
    CONTAINER = "container"  # set, frozenset, OrderedDict: copies its argument (charged to the budget)


@dataclass(frozen=True)
class Allowed:
    """One allowed global: its kind and its canonical (module, name), whatever name the pickle used."""

    kind: Kind
    module: str
    name: str


def _build() -> dict[tuple[str, str], Allowed]:
    table: dict[tuple[str, str], Allowed] = {}

    def add(kind: Kind, module: str, *names: str) -> None:
        table.update({(module, n): Allowed(kind, module, n) for n in names})

    add(Kind.CLASS, DCP_META, "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta")
    add(Kind.ENUM, DCP_META, "_MEM_FORMAT_ENCODING")
    add(Kind.CLASS, DCP_FS, "_StorageInfo", "_StoragePrefix")
    add(Kind.CLASS, DCP_PLANNER, "SavePlan", "WriteItem", "TensorWriteData", "BytesIOWriteData")
    add(Kind.ENUM, DCP_PLANNER, "WriteItemType")
    table[(MCORE_TORCH, "MCoreMetadata")] = Allowed(Kind.CLASS, DCP_META, "Metadata")
    table[(MCORE_TORCH, "MCoreSavePlan")] = Allowed(Kind.CLASS, DCP_PLANNER, "SavePlan")
    add(Kind.SIZE, "torch", "Size")
    add(Kind.GET_LAYOUT, "torch.serialization", "_get_layout")
    add(Kind.DTYPE, "torch", *DTYPES)
    add(Kind.CONSTANT, "torch", *TENSOR_LAYOUTS, *MEMORY_FORMATS)
    add(Kind.CONTAINER, "builtins", "set", "frozenset")
    add(Kind.CONTAINER, "collections", "OrderedDict")
    for module in ("pathlib", "pathlib._local"):  # Python 3.13 moved the classes to pathlib._local
        for name in ("PosixPath", "PurePosixPath"):
            table[(module, name)] = Allowed(Kind.POSIX_PATH, "pathlib", name)
        for name in ("WindowsPath", "PureWindowsPath"):
            table[(module, name)] = Allowed(Kind.WINDOWS_PATH, "pathlib", name)
    return table


ALLOWED: dict[tuple[str, str], Allowed] = _build()

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


def size_dims(dims: Any = ()) -> tuple[int, ...]:
    """``torch.Size``'s argument as a plain tuple, refusing anything but a short tuple of ints >= 0."""
    if type(dims) is not tuple:  # the common case (DCP pickles a tuple) skips both checks below
        if type(dims) is not list or len(dims) > MAX_DIMS:
            raise pickle.UnpicklingError(f"torch.Size argument is not a tuple of at most {MAX_DIMS} ints")
        dims = tuple(dims)
    elif len(dims) > MAX_DIMS:
        raise pickle.UnpicklingError(f"torch.Size argument is not a tuple of at most {MAX_DIMS} ints")
    for d in dims:
        if type(d) is not int or d < 0:
            raise pickle.UnpicklingError(f"torch.Size holds {brief(d)}, not a non-negative int")
    return dims


def path_parts(parts: tuple[Any, ...]) -> tuple[str, ...]:
    """A pathlib class's arguments: strings of at most :data:`MAX_PATH` characters in all."""
    if len(parts) > MAX_PATH or not all(type(p) is str for p in parts) or sum(map(len, parts)) > MAX_PATH:
        raise pickle.UnpicklingError(f"pathlib path parts are not at most {MAX_PATH} characters of strings")
    return parts


def layout_name(name: Any) -> str:
    """``_get_layout``'s argument (``"torch.strided"``) as a layout name from the table."""
    if not isinstance(name, str) or not name.startswith("torch.") or name.removeprefix("torch.") not in TENSOR_LAYOUTS:
        raise pickle.UnpicklingError(f"unknown torch layout {brief(name)}")
    return name.removeprefix("torch.")


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

    def resolve(self, entry: Allowed) -> Callable[..., Any]:
        return {"set": self.set, "frozenset": self.frozenset, "OrderedDict": self.ordered_dict}[entry.name]


class UnsafePickle(FormatError):
    """The pickle references a global outside the allow-list; nothing in it was executed."""


Resolver = Callable[[Allowed], Any]


class AllowListUnpickler(ScannedUnpickler):
    """The C unpickler, after the opcode walk, resolving globals through :data:`ALLOWED` and a resolver."""

    def __init__(self, data: bytes, source: str, resolve: Resolver) -> None:
        super().__init__(data, source)
        self._resolve = resolve
        self._budget = CopyBudget(len(data), source)

    def find_class(self, module: str, name: str) -> Any:
        entry = ALLOWED.get((module, name))
        if entry is None:
            raise UnsafePickle(
                f"refusing to load {self.source}: it references the global {module}.{name}, which is not "
                "a DCP metadata type; nothing in the file was executed (do not open it with torch.load or "
                "torch.distributed.checkpoint)"
            )
        return self._budget.resolve(entry) if entry.kind is Kind.CONTAINER else self._resolve(entry)

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafePickle(f"refusing to load {self.source}: it uses pickle persistent ids, which DCP "
                           "metadata never does; nothing in the file was executed")


def unpickle(data: bytes, source: str, resolve: Resolver) -> Any:
    """Unpickle DCP metadata bytes through the allow-list and ``resolve``; one-line :class:`FormatError`."""
    try:
        return AllowListUnpickler(data, source, resolve).load()
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
