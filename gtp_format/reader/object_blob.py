"""Decode a small ``torch.save``-d plain object without torch: Megatron's ``per_bucket_numel``.

``ckpt verify`` reads one byte object on every run: Megatron's ``per_bucket_numel`` (and its
``_unpadded`` twin), ``torch.save([data])`` with ``data`` a list over gbuf of
``{(param_dtype, grad_dtype): [numel per bucket]}``. ``torch.load(weights_only=True)`` would decode
it safely, but importing torch costs seconds, so this decodes exactly that kind of object: the
archive is read by :mod:`gtp_format.reader.zip_blob` (stored records only, bounds-checked) and
``data.pkl`` by an allow-list unpickler that knows builtin containers, numbers, strings, bytes,
and torch dtypes (as inert :class:`~gtp_format.dtypes.DType` values). DCP's default
planner ``torch.save``-s the ``io.BytesIO`` holding a blob once more; one such level is undone,
as :func:`gtp_format.reader.chunks.load_object` does.

Objects holding tensors, numpy arrays or other classes are refused here (nothing runs); ``show``
and ``diff`` decode those through ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import codecs
import pickle
from typing import Any

from gtp_format.dtypes import DTYPES
from gtp_format.reader.allow_list import CopyBudget, brief
from gtp_format.reader.blob import load_data_pkl
from gtp_format.reader.unpickler import ScannedUnpickler
from gtp_format.reader.zip_blob import BlobError, BlobReader, ViewReader, zip_records

MAX_OBJECT_PICKLE = 1 << 20


class _BytesIO:
    """``io.BytesIO`` as torch.save pickles it: ``NEWOBJ`` then ``BUILD`` with ``(bytes, pos, dict)``."""

    value: bytes = b""

    def __setstate__(self, state: Any) -> None:
        if type(state) is not tuple or len(state) != 3 or type(state[0]) is not bytes:
            raise pickle.UnpicklingError(f"io.BytesIO state is {brief(state)}, not (bytes, position, dict)")
        self.value = state[0]


class ObjectPickle(ScannedUnpickler):
    def __init__(self, data: bytes, source: str) -> None:
        super().__init__(data, source)
        self._budget = CopyBudget(len(data), source)

    def _encode(self, text: Any, encoding: Any = "utf-8") -> bytes:
        """``_codecs.encode``: how protocol 2 pickles ``bytes`` (latin-1 text), charged to the budget."""
        if type(text) is not str or encoding != "latin1":
            raise pickle.UnpicklingError("_codecs.encode is only allowed on latin-1 text (pickled bytes)")
        return codecs.encode(self._budget.charge("_codecs.encode", text), "latin1")

    @staticmethod
    def _empty_bytes(*args: Any) -> bytes:
        """``bytes()``: how protocol 2 pickles ``b""``; ``bytes(n)`` would allocate n bytes, so no arguments."""
        if args:
            raise pickle.UnpicklingError("builtins.bytes is only allowed without arguments (an empty bytes)")
        return b""

    def find_class(self, module: str, name: str) -> Any:
        module = {"__builtin__": "builtins"}.get(module, module)  # protocol 2 writes Python 2's name
        if module == "torch" and name in DTYPES:
            return DTYPES[name]
        allowed = {("_io", "BytesIO"): _BytesIO, ("_codecs", "encode"): self._encode,
                   ("collections", "OrderedDict"): self._budget.ordered_dict,
                   ("builtins", "set"): self._budget.set, ("builtins", "frozenset"): self._budget.frozenset,
                   ("builtins", "bytes"): self._empty_bytes}
        found = allowed.get((module, name))
        if found is None:
            raise BlobError(f"data.pkl references {module}.{name}; only plain objects (containers, numbers, "
                            "dtypes) are decoded here; nothing was run")
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise BlobError("data.pkl holds a tensor or storage; only plain objects are decoded here")


def load_plain_object(reader: BlobReader, nested: bool = False,
                      unpickler: type[ObjectPickle] | None = None) -> Any:
    """The object in a torch.save blob, built only from allow-listed plain types (or, with
    ``unpickler``, what that subclass builds: :mod:`gtp_format.reader.inert_object`'s records)."""
    _, obj = load_data_pkl(reader, zip_records(reader), unpickler or ObjectPickle, MAX_OBJECT_PICKLE)
    if type(obj) is _BytesIO:
        if nested:
            raise BlobError("the blob wraps a blob that wraps another; torch.save was applied more than twice")
        return load_plain_object(ViewReader(memoryview(obj.value)), True, unpickler)
    return obj
