"""Read a DCP ``torch_dist`` checkpoint folder (``.metadata`` + ``__{rank}_{k}.distcp``) as metadata.

The ``.metadata`` pickle goes through :mod:`gtp_format.reader.safe_pickle`; what comes out is a
tree of inert records whose every field is then type-checked here, because an allow-listed
class can still carry a string where an offset belongs. Data files are only ``stat``-ed.

How the pickle maps to the model: ``state_dict_metadata[key]`` gives the kind, global shape,
dtype and chunk boxes; ``storage_data[MetadataIndex(key, chunk offsets)]`` gives the file and
byte range of each chunk (``offset`` is ``None`` for byte objects). Each range holds one complete
``torch.save`` blob.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from itertools import chain, repeat
from operator import attrgetter
from pathlib import Path
from typing import Any, NamedTuple

from gtp_format.dtypes import DType
from gtp_format.errors import FormatError
from gtp_format.model import BYTES, TENSOR, Chunk, Entry, Problem, StorageRef
from gtp_format.names import DCP_METADATA_FILE, DISTCP_RE
from gtp_format.reader.dcp_columns import columns_model, orphan_notes
from gtp_format.reader.dcp_columns import wanted as columns_wanted
from gtp_format.reader.locate import Located
from gtp_format.reader.safe_pickle import (
    BytesStorageRecord,
    ChunkRecord,
    MetadataIndexRecord,
    MetadataRecord,
    Record,
    StorageInfoRecord,
    TensorPropertiesRecord,
    TensorStorageRecord,
    brief,
    load_metadata_pickle,
)
from gtp_format.reader.storage import (
    METADATA_LIMIT_ENV,
    is_regular_inside,
    metadata_limit,
    read_small_file,
    stored_size,
)
from gtp_format.reader.unpickler import gc_paused


def data_file_sizes(folder: Path, names: Sequence[str]) -> dict[str, int]:
    """Sizes of the ``__{rank}_{k}.distcp`` regular files in the folder (stat only)."""
    sizes: dict[str, int] = {}
    for name in names:
        if not DISTCP_RE.match(name):
            continue
        size = is_regular_inside(folder, name)
        if size is not None:
            sizes[name] = size
    return sizes


class _Malformed(Exception):
    pass


# Every field of every record is checked, but in bulk: a type census (``set(map(type, ...))``)
# over a whole column, and one ``min`` over all dims, run in C. Only when a column fails is it
# walked element by element, to name the first offender. This is what keeps ``inspect`` within
# a few percent of PyTorch's own metadata read on millions of chunks.

_NONE = type(None)
_MAX_INT = 1 << 63  # sizes, offsets and lengths fit int64 (torch's own limit); a bigger one is a crafted file


def _dims(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)) or not all(type(d) is int and 0 <= d < _MAX_INT for d in value):
        raise _Malformed(f"{what} is {brief(value)}, not a tuple of non-negative ints below 2**63")
    return tuple(value)


def _int(value: Any, what: str) -> int:
    if type(value) is not int or not 0 <= value < _MAX_INT:
        raise _Malformed(f"{what} is {brief(value)}, not a non-negative int below 2**63")
    return value


def _dims_column(values: list[Any], what: Callable[[int], str], none_ok: bool = False) -> list[Any]:
    """``values`` as tuples of non-negative ints (or ``None`` where allowed), checked in bulk."""
    allowed = {tuple, _NONE} if none_ok else {tuple}
    if set(map(type, values)) <= allowed:
        flat = list(chain.from_iterable(filter(None, values)))
        if set(map(type, flat)) <= {int} and (not flat or (min(flat) >= 0 and max(flat) < _MAX_INT)):
            return values
    return [None if v is None and none_ok else _dims(v, what(i)) for i, v in enumerate(values)]


def _int_column(values: list[Any], what: Callable[[int], str]) -> None:
    if not (set(map(type, values)) <= {int} and (not values or (min(values) >= 0 and max(values) < _MAX_INT))):
        for i, v in enumerate(values):
            _int(v, what(i))


def _type_column(values: list[Any], cls: type, what: Callable[[int], str]) -> None:
    if not set(map(type, values)) <= {cls}:
        i = next(i for i, v in enumerate(values) if type(v) is not cls)
        name = cls.kind if issubclass(cls, Record) else cls.__name__
        raise _Malformed(f"{what(i)} is {brief(values[i])}, not a {name}")


def _fields(records: list[Any], *names: str) -> list[list[Any]]:
    """Columns of the named fields over a list of records (``None`` where a record lacks one)."""
    if not records:
        return [[] for _ in names]
    try:  # a C-level pass per field (a pass of tuples transposed by zip(*rows) took twice as long)
        return [list(map(attrgetter(name), records)) for name in names]  # fails on a missing field
    except AttributeError:
        return [[vars(r).get(name) for r in records] for name in names]


def _new(cls: type, rows: Iterable[tuple[Any, ...]]) -> list[Any]:
    """Named tuples built by ``tuple.__new__`` in C, not by their Python ``__new__`` (millions of them)."""
    return list(map(tuple.__new__, repeat(cls), rows))


def _storage_index(storage_data: Any) -> tuple[dict[tuple[str, tuple[int, ...] | None], StorageRef], int]:
    """``(key, chunk offsets or None) -> StorageRef`` and how many duplicate indices were seen."""
    if storage_data is None:
        return {}, 0
    if type(storage_data) is not dict:
        raise _Malformed(f"storage_data is a {type(storage_data).__name__}, not a dict")
    keys, infos = list(storage_data), list(storage_data.values())
    _type_column(keys, MetadataIndexRecord, lambda i: "a storage_data key")
    fqns, raw_offsets = _fields(keys, "fqn", "offset")
    _type_column(fqns, str, lambda i: "a storage_data key's fqn")
    offsets = _dims_column(raw_offsets, lambda i: f"storage_data[{fqns[i]!r}].offset", none_ok=True)
    _type_column(infos, StorageInfoRecord, lambda i: f"storage_data[{fqns[i]!r}]")
    rels, starts, lengths = _fields(infos, "relative_path", "offset", "length")
    transforms = list(map(dict.get, map(vars, infos), repeat("transform_descriptors")))  # absent before torch 2.6
    _type_column(rels, str, lambda i: f"storage_data[{fqns[i]!r}].relative_path")
    _int_column(starts, lambda i: f"storage_data[{fqns[i]!r}].offset")
    _int_column(lengths, lambda i: f"storage_data[{fqns[i]!r}].length")
    if any(transforms):
        for i, t in enumerate(transforms):
            if not isinstance(t, (list, tuple, _NONE)) or not all(type(x) is str for x in t or ()):
                raise _Malformed(f"storage_data[{fqns[i]!r}].transform_descriptors is {brief(t)}")
        refs = _new(StorageRef, zip(rels, starts, lengths, (tuple(t or ()) for t in transforms)))
    else:
        refs = _new(StorageRef, zip(rels, starts, lengths, repeat(())))
    index = dict(zip(zip(fqns, offsets), refs))
    return index, len(keys) - len(index)


def _tensor_entry(key: str, md: TensorStorageRecord, storage: dict[tuple[str, tuple[int, ...] | None], StorageRef],
                  unclaimed: dict[tuple[str, tuple[int, ...] | None], StorageRef]) -> Entry:
    """One tensor key; each chunk's storage is popped from ``unclaimed``, so what is left there is orphaned."""
    fields = vars(md)
    props = fields.get("properties")
    if type(props) is not TensorPropertiesRecord or type(props.get("dtype")) is not DType:
        raise _Malformed("properties.dtype is missing or not a torch dtype")
    shape = _dims(fields.get("size"), "size")
    raw_chunks = fields.get("chunks")
    if type(raw_chunks) is not list:
        raise _Malformed("chunks is not a list")
    _type_column(raw_chunks, ChunkRecord, lambda i: f"chunk {i}")
    raw_offsets, raw_sizes = _fields(raw_chunks, "offsets", "sizes")
    offsets = _dims_column(raw_offsets, lambda i: f"chunk {i} offsets")
    sizes = _dims_column(raw_sizes, lambda i: f"chunk {i} sizes")
    refs = list(map(unclaimed.pop, zip(repeat(key), offsets), repeat(None)))
    if None in refs:  # no storage, or a second chunk at the same offsets (already popped)
        refs = [r if r is not None else storage.get((key, o)) for r, o in zip(refs, offsets)]
    chunks = tuple(_new(Chunk, zip(range(len(offsets)), offsets, sizes, refs)))
    return Entry(key=key, kind=TENSOR, shape=shape, dtype=props.get("dtype"), chunks=chunks)


class DcpMetadata(NamedTuple):
    """What :func:`read_dcp_metadata` found."""

    entries: dict[str, Entry]
    notes: list[Problem]
    version: str | None
    records: MetadataRecord | None  # the allow-listed records the entries came from, when asked for


def read_dcp_metadata(loc: Located, data_files: dict[str, int], keep_records: bool = False) -> DcpMetadata:
    """Entries, notes and the DCP version of a torch_dist folder; reads ``.metadata`` only.

    ``keep_records`` also returns the records themselves (checked: the entries were built from
    them), for a caller that rewrites the file; otherwise they are dropped here.
    """
    path = loc.folder / DCP_METADATA_FILE
    fix = f"restore {DCP_METADATA_FILE} from a good copy, or raise {METADATA_LIMIT_ENV} if it is genuine"
    stored = sum(stored_size(loc.folder, name) for name in data_files)  # not st_size: sparse files are free
    raw = read_small_file(path, metadata_limit(stored, loc.store), "DCP metadata", fix)
    if not keep_records and columns_wanted(len(raw)):  # a large file: scanned into columns (dcp_scan)
        got = columns_model(path, raw)
        if got is not None:
            return DcpMetadata(*got, None)
    with gc_paused():  # millions of small objects, none of them garbage: see gc_paused
        md = load_metadata_pickle(raw, str(path))
        size = len(raw)
        del raw  # freed before the model is built beside the records: the peak is then, 139 MB at 1M chunks
        entries, notes, version = metadata_entries(path, size, md)
        if not keep_records:
            md = None  # freed now, while the collector is still paused
    return DcpMetadata(entries, notes, version, md)


def metadata_entries(path: Path, size: int, md: Any) -> tuple[dict[str, Entry], list[Problem], str | None]:
    if not isinstance(md, MetadataRecord):
        raise FormatError(f"{path} holds a {type(md).__name__}, not DCP Metadata; restore it from a good copy")
    key = None
    try:
        storage, duplicates = _storage_index(md.get("storage_data"))
        sdm = md.get("state_dict_metadata")
        if not isinstance(sdm, dict):
            raise _Malformed("state_dict_metadata is not a dict")
        entries: dict[str, Entry] = {}
        unclaimed = dict(storage)
        declared = 0
        for key, item in sdm.items():
            if type(key) is not str:
                raise _Malformed(f"key {brief(key)} is not a string")
            if type(item) is TensorStorageRecord:
                chunk_list = vars(item).get("chunks")
                declared += len(chunk_list) if type(chunk_list) is list else 0
                if declared > size:  # each chunk costs pickle bytes, unless lists are shared
                    raise _Malformed(f"the keys declare more chunks than a {size}-byte file can describe "
                                     "(chunk lists are shared between keys)")
                entries[key] = _tensor_entry(key, item, storage, unclaimed)
            elif type(item) is BytesStorageRecord:
                unclaimed.pop((key, None), None)
                entries[key] = Entry(key=key, kind=BYTES, shape=None, dtype=None,
                                     chunks=(Chunk(index=0, offsets=(), sizes=(), storage=storage.get((key, None))),))
            else:
                raise _Malformed(f"metadata is a {type(item).__name__}, not Tensor/BytesStorageMetadata")
        key = None
    except _Malformed as e:
        where = f"key {brief(key)}: " if key is not None else ""
        raise FormatError(f"malformed {path}: {where}{e}; restore it from a good copy") from None
    notes = orphan_notes(unclaimed, duplicates)
    version = md.get("version")
    return entries, notes, version if isinstance(version, str) else None
