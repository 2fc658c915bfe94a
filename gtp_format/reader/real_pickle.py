"""The real DCP classes for DCP ``.metadata``: how ``--load`` unpickles a checkpoint.

``dcp.load`` needs genuine ``Metadata`` objects, so the runtime cannot use the inert records of
:mod:`gtp_format.reader.safe_pickle`. It reads the same allow-list
(:mod:`gtp_format.reader.allow_list`) with the resolver below, which maps each entry to the real
object in the installed torch and Python: the DCP class at its canonical home (so Megatron's
``MCoreMetadata`` becomes DCP ``Metadata``), ``torch.Size`` and ``_get_layout`` behind the same
bounds the inert reader applies, dtypes, layouts and memory formats from ``torch``, and paths as
``pathlib`` objects of *this* interpreter, whichever Python wrote them (3.13 writes
``pathlib._local.PosixPath``, earlier versions ``pathlib.PosixPath``). A Windows path becomes a
``PureWindowsPath``, since a concrete ``WindowsPath`` cannot be created on POSIX.

torch is imported lazily, on the first resolve: the format package must import without torch
(``tests/format/test_format_no_torch.py``), and only the runtime calls this.

What it cannot bound, because the real classes copy what they are given: a crafted file that
passes one large state dict to many ``BUILD`` opcodes gets it copied each time, as under
PyTorch's own reader; ``ckpt inspect`` reads such files with inert, sharing records.
"""

from __future__ import annotations

import importlib
import pathlib
from typing import Any

from gtp_format.errors import FormatError
from gtp_format.reader.allow_list import DCP_META, Allowed, Kind, layout_name, path_parts, size_dims, unpickle
from gtp_format.torch_adapter import load_torch


def _size(dims: Any = ()) -> Any:
    return load_torch().Size(size_dims(dims))


def _get_layout(name: Any) -> Any:
    return getattr(load_torch(), layout_name(name))


def _path(cls: type[pathlib.PurePath]) -> Any:
    def build(*parts: Any) -> pathlib.PurePath:
        return cls(*path_parts(parts))

    return build


def real(entry: Allowed) -> Any:
    """The real resolver: the object ``pickle.load`` would have found, for allowed globals only."""
    kind = entry.kind
    if kind in (Kind.CLASS, Kind.ENUM):
        return getattr(importlib.import_module(entry.module), entry.name)
    if kind in (Kind.DTYPE, Kind.CONSTANT):
        return getattr(load_torch(), entry.name)
    if kind is Kind.SIZE:
        return _size
    if kind is Kind.GET_LAYOUT:
        return _get_layout
    if kind is Kind.POSIX_PATH:
        return _path(pathlib.PurePosixPath if entry.name.startswith("Pure") else pathlib.PosixPath)
    if kind is Kind.WINDOWS_PATH:
        return _path(pathlib.PureWindowsPath)
    raise AssertionError(f"no real object for {entry}")  # containers are resolved by the unpickler


def load_real_metadata(data: bytes, source: str) -> Any:
    """Unpickle ``.metadata`` bytes into a real DCP ``Metadata``; one-line :class:`FormatError` otherwise."""
    md = unpickle(data, source, real)
    metadata_cls = real(Allowed(Kind.CLASS, DCP_META, "Metadata"))
    if not isinstance(md, metadata_cls):
        raise FormatError(f"{source}: holds a {type(md).__name__}, not DCP Metadata; the file is damaged or is "
                          "not a .metadata pickle: restore it from a good copy")
    return md
