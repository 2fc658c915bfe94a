"""Decode Megatron's byte objects (``common_state``, ``rng_state``, ``_extra_state``) as inert records.

megatron-core keeps the run's arguments (an ``argparse.Namespace``), the RNG states (numpy arrays,
torch byte tensors) and per-module ``_extra_state`` in ``torch.save`` blobs. ``torch.load(
weights_only=True)`` refuses the first two, and loading them for real would run whatever the
pickle names. Here every global the pickle names becomes an :class:`InertObject` subclass that
only *records* its name, its constructor arguments and its state: nothing is imported or called.
Tensors are recorded by their storage type and element count; their bytes are not read. The
unpickler is the pre-scanned, budgeted one of :mod:`gtp_format.reader.object_blob` (pickle at most
1 MiB, container copies charged to the file's size), so a hostile blob costs what it stores.

``ckpt show`` prints the result as one table of paths and values; ``ckpt inspect`` and the
topology derivation (:mod:`gtp_format.megatron.topology`) read the parallel sizes megatron records
in ``common_state``'s ``args`` from it.
"""

from __future__ import annotations

import pickle
from typing import Any

from gtp_format.model import Checkpoint, Entry
from gtp_format.reader.chunks import load_plain
from gtp_format.reader.object_blob import ObjectPickle
from gtp_format.reader.zip_blob import BlobError

_SCALARS = (int, float, bool, str, bytes, type(None))
MAX_GLOBALS = 256  # distinct globals one blob may name; megatron's common_state names one (argparse.Namespace)


class InertObject:
    """What a pickle would have built by calling ``qualname``: the call's arguments and state, nothing run."""

    qualname = "?"
    args: tuple[Any, ...] = ()  # class defaults: NEWOBJ builds with __new__ and never calls __init__
    state: Any = None

    def __init__(self, *args: Any) -> None:
        self.args, self.state = args, None

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __repr__(self) -> str:
        return f"<{self.qualname}>"

    def fields(self) -> dict[str, Any]:
        """The recorded attributes: the state dict (``Namespace``, plain classes) or args and state."""
        if isinstance(self.state, dict) and not self.args:
            return dict(self.state)
        out: dict[str, Any] = {f"arg{i}": a for i, a in enumerate(self.args)}
        if self.state is not None:
            out["state"] = self.state
        return out


class StorageRecord:
    """A tensor storage a pickle refers to: its type and element count (the bytes are never read)."""

    def __init__(self, pid: Any) -> None:
        parts = pid if isinstance(pid, tuple) else (pid,)
        self.kind = getattr(parts[1], "qualname", str(parts[1])) if len(parts) > 1 else "?"
        self.numel = parts[4] if len(parts) > 4 and isinstance(parts[4], int) else None

    def __repr__(self) -> str:
        return f"<storage {self.kind}, {self.numel} elements, not read>"


class _InertPickle(ObjectPickle):
    def __init__(self, data: bytes, source: str) -> None:
        super().__init__(data, source)
        self._classes: dict[tuple[str, str], type[InertObject]] = {}

    def find_class(self, module: str, name: str) -> Any:
        try:
            return super().find_class(module, name)
        except BlobError:
            pass
        found = self._classes.get((module, name))
        if found is None:
            if len(self._classes) >= MAX_GLOBALS:
                raise pickle.UnpicklingError(f"data.pkl names more than {MAX_GLOBALS} globals")
            found = type(name[:64] or "_", (InertObject,), {"qualname": f"{module}.{name}"[:200]})
            self._classes[(module, name)] = found
        return found

    def persistent_load(self, pid: Any) -> Any:
        return StorageRecord(pid)


def load_record(ckpt: Checkpoint, entry: Entry) -> Any:
    """A byte object of ``ckpt`` decoded as inert records (see the module docstring)."""
    return load_plain(ckpt, entry, _InertPickle)


def flatten(obj: Any, path: str = "", limit: int = 2000) -> list[tuple[str, str, str]]:
    """(path, type, value) rows of a decoded object, depth first, at most ``limit`` rows.

    One-element lists (megatron's ShardedObject wrapper) add ``[0]`` to the path like any list.
    """
    rows: list[tuple[str, str, str]] = []

    def walk(o: Any, p: str, depth: int) -> None:
        if len(rows) >= limit:
            return
        if isinstance(o, InertObject):
            rows.append((p or "(value)", o.qualname, "record"))
            items: Any = o.fields().items()
        elif isinstance(o, dict):
            items = o.items()
        elif isinstance(o, (list, tuple)) and len(o) > 8 and all(type(v) in _SCALARS for v in o):
            text = repr(o)  # an RNG state's 625 words: one row
            cut = text[:200] + ("..." if len(text) > 200 else "")
            rows.append((p or "(value)", f"{type(o).__name__}[{len(o)}]", cut))
            return
        elif isinstance(o, (list, tuple)):
            items = ((f"[{i}]", v) for i, v in enumerate(o))
        else:
            text = repr(o)
            rows.append((p or "(value)", type(o).__name__, text if len(text) <= 200 else text[:200] + "..."))
            return
        if depth > 32:
            rows.append((p, type(o).__name__, "(nested deeper than 32 levels, not shown)"))
            return
        empty = True
        for k, v in items:
            empty = False
            key = k if isinstance(k, str) and k.startswith("[") else f".{k}" if isinstance(k, str) else f"[{k!r}]"
            walk(v, f"{p}{key}" if p or not key.startswith(".") else key[1:], depth + 1)
        if empty and not isinstance(o, InertObject):
            rows.append((p or "(value)", type(o).__name__, repr(o)))

    walk(obj, path, 0)
    return rows
