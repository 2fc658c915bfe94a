"""Read a DCP ``torch_dist`` checkpoint folder (``.metadata`` + ``__{rank}_{k}.distcp``) as metadata.

The ``.metadata`` pickle goes through :mod:`ckpt_tool.reader.safe_pickle`; what comes out is a
tree of inert records whose every field is then type-checked here, because an allow-listed
class can still carry a string where an offset belongs. Data files are only ``stat``-ed.

How the pickle maps to the model: ``state_dict_metadata[key]`` gives the kind, global shape,
dtype and chunk boxes; ``storage_data[MetadataIndex(key, chunk offsets)]`` gives the file and
byte range of each chunk (``offset`` is ``None`` for byte objects). Each range holds one complete
``torch.save`` blob.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ckpt_tool.errors import CkptError
from ckpt_tool.model import BYTES, TENSOR, Chunk, Entry, Problem, StorageRef
from ckpt_tool.reader.locate import METADATA_LIMIT_ENV, Located, metadata_limit
from ckpt_tool.reader.safe_pickle import (
    BytesStorageRecord,
    ChunkRecord,
    MetadataIndexRecord,
    MetadataRecord,
    StorageInfoRecord,
    TensorPropertiesRecord,
    TensorStorageRecord,
    load_metadata_pickle,
)
from ckpt_tool.reader.storage import read_small_file
from gtp_runtime.checkpoint.format import DCP_METADATA_FILE, DISTCP_RE


def data_file_sizes(folder: Path, names: Sequence[str]) -> dict[str, int]:
    """Sizes of the ``__{rank}_{k}.distcp`` regular files in the folder (stat only)."""
    sizes: dict[str, int] = {}
    for name in names:
        if not DISTCP_RE.match(name):
            continue
        try:
            st = os.stat(folder / name)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode):
            sizes[name] = st.st_size
    return sizes


class _Malformed(Exception):
    pass


def _dims(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)) or not all(type(d) is int and d >= 0 for d in value):
        raise _Malformed(f"{what} is {value!r}, not a tuple of non-negative ints")
    return tuple(value)


def _int(value: Any, what: str) -> int:
    if type(value) is not int or value < 0:
        raise _Malformed(f"{what} is {value!r}, not a non-negative int")
    return value


def _storage_index(storage_data: Any) -> tuple[dict[tuple[str, tuple[int, ...] | None], StorageRef], int]:
    """``(key, chunk offsets or None) -> StorageRef`` and how many duplicate indices were seen."""
    if storage_data is None:
        return {}, 0
    if not isinstance(storage_data, dict):
        raise _Malformed(f"storage_data is a {type(storage_data).__name__}, not a dict")
    index: dict[tuple[str, tuple[int, ...] | None], StorageRef] = {}
    duplicates = 0
    for k, v in storage_data.items():
        if not isinstance(k, MetadataIndexRecord) or not isinstance(k.get("fqn"), str):
            raise _Malformed(f"storage_data key {k!r} is not a MetadataIndex")
        fqn = k.get("fqn")
        offset = k.get("offset")
        offsets = None if offset is None else _dims(offset, f"storage_data[{fqn!r}].offset")
        if not isinstance(v, StorageInfoRecord):
            raise _Malformed(f"storage_data[{fqn!r}] is not a _StorageInfo")
        rel = v.get("relative_path")
        if not isinstance(rel, str):
            raise _Malformed(f"storage_data[{fqn!r}].relative_path is {rel!r}, not a string")
        transforms = v.get("transform_descriptors") or ()
        if not isinstance(transforms, (list, tuple)) or not all(isinstance(t, str) for t in transforms):
            raise _Malformed(f"storage_data[{fqn!r}].transform_descriptors is {transforms!r}")
        ref = StorageRef(
            file=rel,
            offset=_int(v.get("offset"), f"storage_data[{fqn!r}].offset"),
            length=_int(v.get("length"), f"storage_data[{fqn!r}].length"),
            transforms=tuple(transforms),
        )
        if (fqn, offsets) in index:
            duplicates += 1
        index[(fqn, offsets)] = ref
    return index, duplicates


def _tensor_entry(key: str, md: TensorStorageRecord,
                  storage: dict[tuple[str, tuple[int, ...] | None], StorageRef]) -> Entry:
    props = md.get("properties")
    if not isinstance(props, TensorPropertiesRecord) or not isinstance(props.get("dtype"), torch.dtype):
        raise _Malformed("properties.dtype is missing or not a torch dtype")
    shape = _dims(md.get("size"), "size")
    raw_chunks = md.get("chunks")
    if not isinstance(raw_chunks, list):
        raise _Malformed("chunks is not a list")
    chunks = []
    for i, c in enumerate(raw_chunks):
        if not isinstance(c, ChunkRecord):
            raise _Malformed(f"chunk {i} is not a ChunkStorageMetadata")
        offsets = _dims(c.get("offsets"), f"chunk {i} offsets")
        sizes = _dims(c.get("sizes"), f"chunk {i} sizes")
        chunks.append(Chunk(index=i, offsets=offsets, sizes=sizes, storage=storage.get((key, offsets))))
    return Entry(key=key, kind=TENSOR, shape=shape, dtype=props.get("dtype"), chunks=tuple(chunks))


def read_dcp_metadata(loc: Located, data_files: dict[str, int]) -> tuple[dict[str, Entry], list[Problem], str | None]:
    """Entries, notes and the DCP version of a torch_dist folder; reads ``.metadata`` only."""
    path = loc.folder / DCP_METADATA_FILE
    fix = f"restore {DCP_METADATA_FILE} from a good copy, or raise {METADATA_LIMIT_ENV} if it is genuine"
    raw = read_small_file(path, metadata_limit(sum(data_files.values())), "DCP metadata", fix)
    md = load_metadata_pickle(raw, str(path))
    if not isinstance(md, MetadataRecord):
        raise CkptError(f"{path} holds a {type(md).__name__}, not DCP Metadata; restore it from a good copy")
    key = None
    try:
        storage, duplicates = _storage_index(md.get("storage_data"))
        sdm = md.get("state_dict_metadata")
        if not isinstance(sdm, dict):
            raise _Malformed("state_dict_metadata is not a dict")
        entries: dict[str, Entry] = {}
        for key, item in sdm.items():
            if not isinstance(key, str):
                raise _Malformed(f"key {key!r} is not a string")
            if isinstance(item, TensorStorageRecord):
                entries[key] = _tensor_entry(key, item, storage)
            elif isinstance(item, BytesStorageRecord):
                entries[key] = Entry(key=key, kind=BYTES, shape=None, dtype=None,
                                     chunks=(Chunk(index=0, offsets=(), sizes=(), storage=storage.get((key, None))),))
            else:
                raise _Malformed(f"metadata is a {type(item).__name__}, not Tensor/BytesStorageMetadata")
        key = None
    except _Malformed as e:
        where = f"key {key!r}: " if key is not None else ""
        raise CkptError(f"malformed {path}: {where}{e}; restore it from a good copy") from None
    notes = _orphan_notes(entries, storage, duplicates)
    version = md.get("version")
    return entries, notes, version if isinstance(version, str) else None


def _orphan_notes(entries: dict[str, Entry], storage: dict[tuple[str, tuple[int, ...] | None], StorageRef],
                  duplicates: int) -> list[Problem]:
    notes = []
    used = {(e.key, c.offsets if e.kind == TENSOR else None) for e in entries.values() for c in e.chunks}
    for (fqn, offsets), ref in storage.items():
        if (fqn, offsets) not in used:
            notes.append(Problem("warning", "orphan_storage",
                                 f"storage_data names {fqn!r} at offsets {offsets} but no such chunk exists",
                                 key=fqn, file=ref.file))
    if duplicates:
        notes.append(Problem("error", "duplicate_storage",
                             f"{duplicates} storage_data entries repeat a (key, offset) index"))
    return notes
