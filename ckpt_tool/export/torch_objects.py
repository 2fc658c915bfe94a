"""``export --to torch``: the checkpoint's non-tensor objects, as PyTorch's ``dcp_to_torch_save`` writes them.

DCP stores each non-tensor object (``BytesStorageMetadata``: megatron-core's ``common_state``,
``rng_state``, the optimizer's param groups and ``per_bucket_numel``, ``_extra_state``) as a
``torch.save`` blob; ``dcp_to_torch_save`` puts under its key whatever ``torch.load`` of that blob
returns. Here each blob is decoded with ``torch.load(weights_only=True)`` only
(:func:`gtp_format.reader.chunks.load_object`), never with ``weights_only=False`` nor ``pickle.load``,
and the object is pickled again into the output's ``data.pkl`` (protocol 2, no memo, so that it fits
among the tensors' records: :func:`gtp_format.writer.torch_file.state_pkl`). On megatron-core's own
checkpoints (``fixtures/megatron``) that takes every ``_extra_state`` and optimizer object, equal to
``dcp_to_torch_save``'s (``tests/cli/test_export_torch_objects.py``).

What weights_only refuses is not written, and the output says so (``left_out``, one reason per key;
the file is then not ``dcp_to_torch_save``'s whole, and ``equals_dcp_to_torch_save`` is false):

* objects whose pickle names only data types weights_only does not take (:data:`DATA_GLOBALS`:
  ``argparse.Namespace`` in ``common_state``, numpy arrays in ``rng_state``), found by decoding the blob
  as inert records (:mod:`gtp_format.reader.inert_object`: nothing is imported or called). The export
  goes on: these are the run's arguments and RNG states, read with ``ckpt show SRC KEY``;
* an object that holds tensors (written by PyTorch as storages of their own; none of megatron-core's
  accepted objects holds one).

A blob that names anything else (``os.system``, ``builtins.eval``, a class of some package) is not
data: the export stops with one line naming the key and the global (exit 2), nothing written. A
careful user of a genuine checkpoint loses only the objects above, named; one of a crafted
checkpoint gets no file that would pass for an export of it.

Memory: the blobs' stored bytes are bounded before any is read (:func:`object_budget`, a part of
``--max-memory``); each is decoded, re-encoded and dropped in turn, so what stays is the re-encoded
pickles, about the blobs' size.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

from gtp_format.errors import ChunkError, FormatError
from gtp_format.model import Checkpoint, Entry

# globals that weights_only refuses but that only carry data, as megatron-core and PyTorch write them
DATA_GLOBALS = frozenset({
    "argparse.Namespace",
    "numpy.core.multiarray._reconstruct", "numpy._core.multiarray._reconstruct",
    "numpy.core.multiarray.scalar", "numpy._core.multiarray.scalar", "numpy.ndarray", "numpy.dtype",
    "torch._utils._rebuild_tensor_v2", "torch._utils._rebuild_tensor",
})
_WALK_LIMIT = 1_000_000  # nodes of one decoded object looked at for globals and tensors


def object_budget(max_memory: int) -> int:
    """Stored bytes of byte objects one export decodes at most: an eighth of ``--max-memory``."""
    return max_memory // 8


def _walk(obj: Any, visit: Any) -> None:
    """Call ``visit`` on every node of ``obj`` (containers, inert records' arguments and state), each once."""
    from gtp_format.reader.inert_object import InertObject

    stack, seen, n = [obj], set(), 0
    while stack:
        o = stack.pop()
        if id(o) in seen:
            continue
        seen.add(id(o))
        n += 1
        if n > _WALK_LIMIT:
            raise FormatError(f"a byte object holds more than {_WALK_LIMIT} values")
        visit(o)
        if isinstance(o, dict):
            stack.extend(o.keys())
            stack.extend(o.values())
        elif isinstance(o, list | tuple | set | frozenset):
            stack.extend(o)
        elif isinstance(o, InertObject):
            stack.extend(o.args)
            stack.append(o.state)


def _globals_named(ckpt: Checkpoint, entry: Entry) -> set[str]:
    """The globals outside the plain decoder's own list that ``entry``'s pickle names (nothing run)."""
    from gtp_format.reader.inert_object import InertObject, load_record

    found: set[str] = set()
    _walk(load_record(ckpt, entry), lambda o: found.add(o.qualname) if isinstance(o, InertObject) else None)
    return found


def _holds_tensor(obj: Any) -> bool:
    import torch

    hit: list[bool] = []
    _walk(obj, lambda o: hit.append(True) if isinstance(o, torch.Tensor | torch.UntypedStorage
                                                       | torch.TypedStorage) else None)
    return bool(hit)


def fragment(obj: Any) -> bytes:
    """``obj`` as a protocol-2 pickle body without its PROTO and STOP opcodes and without memo opcodes,
    to be placed as a value inside another pickle."""
    buf = io.BytesIO()
    p = pickle.Pickler(buf, protocol=2)
    p.fast = True  # no PUT/GET: the enclosing pickle's memo stays its own
    p.dump(obj)
    data = buf.getvalue()
    if data[:2] != b"\x80\x02" or data[-1:] != b".":
        raise ValueError("unexpected pickle framing")
    return data[2:-1]


def decode_objects(ckpt: Checkpoint, keys: list[str], max_memory: int,
                   where: str) -> tuple[list[tuple[str, bytes]], dict[str, str]]:
    """The byte objects ``keys`` of ``ckpt``: (key, pickle fragment) of those written, and why each
    other one is left out. Raises :class:`FormatError` (one line) for a blob that is not data, or
    when their stored bytes exceed :func:`object_budget`."""
    from gtp_format.reader.chunks import load_object

    entries = [ckpt.entries[k] for k in keys]
    stored = sum(c.storage.length for e in entries for c in e.chunks[:1] if c.storage is not None)
    if stored > object_budget(max_memory):
        raise FormatError(f"{where}: its {len(keys)} non-tensor objects store {stored} bytes, more than the "
                          f"{object_budget(max_memory)} an export decodes within --max-memory {max_memory} (an "
                          "eighth of it); raise --max-memory, or check the source (ckpt verify --data)")
    written: list[tuple[str, bytes]] = []
    left: dict[str, str] = {}
    for e in entries:
        try:
            obj = load_object(ckpt, e)
        except ChunkError as err:
            if "does not load with weights_only=True" not in err.message:
                raise  # unreadable or damaged: the source's fault, as for a tensor chunk
            named = _globals_named(ckpt, e)
            other = sorted(named - DATA_GLOBALS)
            if other or not named:
                what = f"names {other[0]}" if other else "does not decode"
                raise FormatError(f"{where}: byte object {e.key} {what}, which is not data (torch.load with "
                                  "weights_only=True refuses it, and ckpt never runs a pickle); nothing was "
                                  "written: the source is not a checkpoint to export") from None
            left[e.key] = f"weights_only=True refuses {', '.join(sorted(named))}"
            continue
        if _holds_tensor(obj):
            left[e.key] = "holds tensors"
            continue
        try:
            written.append((e.key, fragment(obj)))
        except (ValueError, TypeError, pickle.PicklingError, RecursionError) as err:
            left[e.key] = f"cannot be written again ({type(err).__name__})"
    return written, left
