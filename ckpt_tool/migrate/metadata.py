"""The migrated ``.metadata``: the source's records, with aliased keys split per CP rank.

Built from the allow-listed records :func:`gtp_format.reader.checkpoint.open_checkpoint` kept on
the model (``Checkpoint.raw_metadata``), so SRC's ``.metadata`` is read and unpickled once, by the
reader, and never with ``pickle.load``. The new one is made of real
``torch.distributed.checkpoint`` objects, pickled the way ``FileSystemWriter.finish`` does
(``pickle.dump`` of the ``Metadata``), so DCP and Megatron load it as their own. Every record is
checked again here, field by field, because an allow-listed class can still carry anything, and
only what DCP itself writes is carried over (plain ``planner_data``, known ``Metadata`` fields).
"""

from __future__ import annotations

import pickle
import uuid
from pathlib import Path
from typing import Any

import torch

from ckpt_tool.migrate.plan import Plan
from gtp_format.dtypes import TENSOR_LAYOUTS, DType
from gtp_format.errors import FormatError
from gtp_format.model import Checkpoint
from gtp_format.names import DCP_METADATA_FILE
from gtp_format.reader.safe_pickle import (
    BytesStorageRecord,
    MemFormatEncodingRecord,
    MetadataIndexRecord,
    MetadataRecord,
    StorageInfoRecord,
    StorageMetaRecord,
    TensorPropertiesRecord,
    TensorStorageRecord,
    TorchConstant,
)

_KNOWN_METADATA_FIELDS = {"state_dict_metadata", "planner_data", "storage_data", "storage_meta", "version"}

_PLAIN_NODES_PER_KEY = 64  # DCP's planner_data holds a key path (a few strings) per key
_MEMORY_FORMATS = {0: torch.contiguous_format, 1: torch.channels_last, 2: torch.preserve_format}


def plain_copy(value: Any, where: str, budget: list[int]) -> Any:
    """A copy of plain data (planner_data); anything else is refused rather than re-pickled.

    ``budget`` (one mutable count) caps the values visited: a pickle can put one list in both
    slots of another, and so on, so that a few hundred bytes of file make a walk of 2**100 values.
    """
    budget[0] -= 1
    if budget[0] < 0:
        raise FormatError(f"{where} holds more values than its keys can use (shared sub-lists?); migrate-aliased only "
                        "rewrites plain planner_data (DCP's default planner writes a dict of key paths)")
    if value is None or type(value) in (str, int, float, bool):
        return value
    if type(value) in (list, tuple):
        return type(value)(plain_copy(v, where, budget) for v in value)
    if type(value) is dict:
        return {plain_copy(k, where, budget): plain_copy(v, where, budget) for k, v in value.items()}
    raise FormatError(f"{where} holds a {type(value).__name__}; migrate-aliased only rewrites plain planner_data "
                    "(DCP's default planner writes a dict of key paths)")


def _properties(rec: Any, where: str) -> Any:
    from torch.distributed.checkpoint.metadata import TensorProperties

    if not isinstance(rec, TensorPropertiesRecord):
        raise FormatError(f"{where}: properties are not TensorProperties")
    enc = rec.get("memory_format")
    fmt = _MEMORY_FORMATS.get(enc.value) if isinstance(enc, MemFormatEncodingRecord) else None
    layout, dtype = rec.get("layout"), rec.get("dtype")
    if (fmt is None or type(layout) is not TorchConstant or layout.name not in TENSOR_LAYOUTS
            or type(dtype) is not DType):
        raise FormatError(f"{where}: properties have an unknown memory format, layout or dtype")
    return TensorProperties(dtype=dtype.torch, layout=layout.torch, requires_grad=bool(rec.get("requires_grad", False)),
                            memory_format=fmt, pin_memory=bool(rec.get("pin_memory", False)))


def source_records(ckpt: Checkpoint) -> MetadataRecord:
    """SRC's ``.metadata`` records, as the reader kept them; refused if they hold fields DCP does not write."""
    path = ckpt.root / DCP_METADATA_FILE
    md = ckpt.raw_metadata
    if md is None:
        raise ValueError(f"{ckpt.root} was opened without keep_raw_metadata=True; migrate needs the records")
    assert isinstance(md, MetadataRecord)  # the reader refuses anything else
    extra = sorted(set(md.state) - _KNOWN_METADATA_FIELDS)
    if extra:
        raise FormatError(f"{path} has Metadata fields {extra} that migrate-aliased does not know how to carry over; "
                        "it handles torch.distributed.checkpoint metadata as torch 2.13 writes it")
    return md


def build_metadata(plan: Plan, md: Any, new_file: str, lost_storage: dict[tuple[str, tuple[int, ...]], tuple[int, int]],
                   checkpoint_id: Path | str) -> Any:
    """The migrated ``Metadata``: aliased keys split per CP rank, storage pointed at kept or new data."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorStorageMetadata,
    )

    path = plan.ckpt.root / DCP_METADATA_FILE
    by_key = {k.source_key: k for k in plan.keys}
    kept_cp = {(c.source_key, c.offsets): c.cp_rank for c in plan.kept}
    sdm: dict[str, Any] = {}
    for key, item in md.get("state_dict_metadata").items():
        if isinstance(item, BytesStorageRecord):
            sdm[key] = BytesStorageMetadata()
            continue
        if not isinstance(item, TensorStorageRecord):
            raise FormatError(f"{path}: key {key!r} is neither tensor nor bytes metadata")
        size = torch.Size(item.get("size"))
        chunks = [(tuple(c.get("offsets")), tuple(c.get("sizes"))) for c in item.get("chunks")]
        for new in (by_key[key].new_keys if key in by_key else [key]):
            sdm[new] = TensorStorageMetadata(
                properties=_properties(item.get("properties"), f"{path}: key {key!r}"), size=size,
                chunks=[ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for o, s in chunks])

    storage: dict[Any, Any] = {}
    for k, v in md.get("storage_data").items():
        if not isinstance(k, MetadataIndexRecord) or not isinstance(v, StorageInfoRecord):
            raise FormatError(f"{path}: storage_data holds something other than MetadataIndex -> _StorageInfo")
        fqn, offset, hint = k.get("fqn"), k.get("offset"), k.get("index")
        transforms = v.get("transform_descriptors") or None
        info = _StorageInfo(v.get("relative_path"), v.get("offset"), v.get("length"),
                            transform_descriptors=list(transforms) if transforms else None)
        if fqn not in by_key:
            storage[MetadataIndex(fqn, offset, hint)] = info
            continue
        offsets = tuple(offset)
        if (fqn, offsets) not in kept_cp:
            continue  # an orphan entry naming no chunk (verify warns about it): nothing to carry over
        for j, new in enumerate(by_key[fqn].new_keys):
            if j == kept_cp[(fqn, offsets)]:
                storage[MetadataIndex(new, offset, hint)] = info
            else:
                start, length = lost_storage[(new, offsets)]
                storage[MetadataIndex(new, offset, hint)] = _StorageInfo(new_file, start, length)

    try:
        planner = plain_copy(md.get("planner_data"), f"{path}: planner_data", [_PLAIN_NODES_PER_KEY * (len(sdm) + 16)])
    except RecursionError:
        raise FormatError(f"{path}: planner_data is nested too deeply for DCP's key paths; restore the file from a "
                        "good copy") from None
    if isinstance(planner, dict):
        for old, ak in by_key.items():
            if old not in planner:
                continue
            value = planner.pop(old)
            for new in ak.new_keys:
                planner[new] = _rename_path(value, old, new, path)

    old_meta = md.get("storage_meta")
    modules = old_meta.get("modules") if isinstance(old_meta, StorageMetaRecord) else None
    version = md.get("version")
    return Metadata(
        state_dict_metadata=sdm, planner_data=planner, storage_data=storage,
        storage_meta=StorageMeta(checkpoint_id=checkpoint_id, save_id=str(uuid.uuid4()),
                                 modules=list(modules) if isinstance(modules, list) else []),
        version=version if isinstance(version, str) else None)


def _rename_path(value: Any, old: str, new: str, path: Path) -> Any:
    """planner_data maps a flattened key to its path in the state dict; give the new key its own."""
    if value == (old,):
        return (new,)
    if isinstance(value, tuple) and value and ".".join(map(str, value)) == old and isinstance(value[-1], str):
        return (*value[:-1], value[-1] + new[len(old):])
    raise FormatError(f"{path}: planner_data maps {old!r} to {value!r}, which migrate-aliased cannot rename")


def encode(metadata: Any) -> bytes:
    """The bytes of ``.metadata``: what ``FileSystemWriter.finish`` writes (``pickle.dump`` of the ``Metadata``)."""
    return pickle.dumps(metadata)
