"""The model of a large DCP ``.metadata`` from the columns of :mod:`gtp_format.reader.dcp_scan`.

The entries, notes and version are those :func:`gtp_format.reader.dcp_reader.metadata_entries` builds from
the inert records of the same file, but each tensor key's chunks are a :class:`~gtp_format.model.ChunkColumns`
(rows of one :class:`~gtp_format.model.ChunkTable`) instead of a tuple of :class:`Chunk`: the model holds a
few arrays instead of several Python objects per chunk. Every rule of ``metadata_entries`` holds here over
whole columns. Where one would fail (a malformed field, a key twice, a storage entry twice, two chunks of a
key at the same offsets), :func:`columns_model` returns ``None`` and the caller reads the file the old way,
which names the problem in its own words: this module never reports an error of its own.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from gtp_format.dtypes import DTYPES
from gtp_format.errors import FormatError
from gtp_format.model import BYTES, TENSOR, Chunk, ChunkColumns, ChunkTable, Entry, Problem, StorageRef
from gtp_format.numbers import NumberError, parse_int
from gtp_format.reader import dcp_scan as sc

MIN_BYTES = 32 << 20
"""Files below this are read the old way: numba's import (0.1-0.6 s) is then more than the scan saves."""

COMPILE_BYTES = 1 << 30
"""Where the scan is not compiled yet (a fresh machine, a CI container), only a file at least this large is
scanned: compiling takes 14-18 s, and the scan saves about 3 s per 139 MB (1M chunks: 7.4 s the old way,
4.7 s scanned, on the 16-core host), so the compile pays for itself in one file from about 0.8 GB."""

COMPILE_ENV = "CKPT_COMPILE_SCAN"
"""``1``: compile the scan now whatever the file's size (warm a machine or an image once); ``0``: never scan."""


def asked() -> int | None:
    """``CKPT_COMPILE_SCAN`` as 0 or 1, ``None`` where unset or empty; anything else is one line naming it."""
    value = os.environ.get(COMPILE_ENV, "").strip()
    if not value:
        return None
    try:
        return parse_int(value, COMPILE_ENV, 0, 1)
    except NumberError as e:
        raise FormatError(f"{e}; set it to 1 (compile the metadata scan now) or 0 (never scan)") from None


def wanted(size: int) -> bool:
    """Whether to scan a ``size``-byte metadata pickle: large enough, numba present, and the scan either
    compiled already, worth compiling for this one file, or asked for."""
    choice = asked()
    if size < MIN_BYTES or choice == 0 or not sc.available():
        return False
    return choice == 1 or size >= COMPILE_BYTES or sc.compiled()


def columns_model(path: Path, raw: bytes | bytearray | memoryview,
                  ) -> tuple[dict[str, Entry], list[Problem], str | None] | None:
    """``(entries, notes, version)`` of the pickle ``raw``, or ``None``: read it the old way."""
    cols = sc.scan(raw)
    if isinstance(cols, int):
        return None
    data = np.frombuffer(raw, np.uint8)
    meta = cols.meta
    if not meta[0] & 1:  # no state_dict_metadata
        return None

    def text(pos: int, n: int) -> str:
        return bytes(data[pos:pos + n]).decode("ascii")  # the scan took ASCII strings only

    sdm = cols.sdm[cols.sdm[:, 0] == meta[1]]
    keys = [text(p, n) for p, n in sdm[:, 1:3].tolist()]
    key_id = dict(zip(keys, range(len(keys))))
    if len(key_id) != len(keys):
        return None  # a key twice: the dict keeps the last one, the old way decides
    is_tsm = sdm[:, 3] == sc.C_TSM
    tsm = cols.tsm[sdm[is_tsm, 4]]
    if tsm.size and not (tsm[:, 4] == 7).all():
        return None  # a TensorStorageMetadata without properties, size or chunks
    lists = cols.lists
    list_ids = tsm[:, 3]
    first = np.where(lists[list_ids, 0] == sc.L_CHUNKS, lists[list_ids, 1], 0)
    count = lists[list_ids, 2]
    if int(count.sum()) > len(raw):
        return None
    chunk = cols.chunk
    owned = np.zeros(chunk.shape[0], bool)
    chunk_key = np.full(chunk.shape[0], -1, np.int64)
    tsm_keys = np.flatnonzero(is_tsm)
    for k, a, n in zip(tsm_keys.tolist(), first.tolist(), count.tolist()):
        if owned[a:a + n].any():
            return None
        owned[a:a + n] = True
        chunk_key[a:a + n] = k
    if not (chunk[owned, 4] == 3).all():
        return None  # a chunk without offsets or sizes

    # storage entries
    sd = cols.sd[cols.sd[:, 0] == meta[2]] if meta[2] >= 0 else cols.sd[:0]
    mdx, sinfo = cols.mdindex[sd[:, 1]], cols.sinfo[sd[:, 2]]
    if not (mdx[:, 4] & 1).all() or not ((sinfo[:, 4] & 7) == 7).all():  # a MetadataIndex may lack its offset
        return None
    fqn_ids, fqn_names = _names(data, mdx[:, 0], mdx[:, 1], text)
    sd_key = np.array([key_id.get(name, -1) for name in fqn_names], np.int64)[fqn_ids] if len(fqn_names) \
        else np.zeros(0, np.int64)
    file_of_sd, files = _names(data, sinfo[:, 0], sinfo[:, 1], text)
    status, found, numel = sc.compiled_join()(cols.dims, chunk, chunk_key, cols.mdindex, sd_key, sd[:, 1].copy())
    if status != 0:
        return None
    file = np.full(chunk.shape[0], -1, np.int64)
    start = np.zeros(chunk.shape[0], np.int64)
    length = np.zeros(chunk.shape[0], np.int64)
    hit = found >= 0
    file[found[hit]] = file_of_sd[hit]
    start[found[hit]] = sinfo[hit, 2]
    length[found[hit]] = sinfo[hit, 3]
    table = ChunkTable(cols.dims, np.ascontiguousarray(chunk[:, 0:2]), np.ascontiguousarray(chunk[:, 2:4]), file,
                       start, length, numel, tuple(files))

    # byte objects claim the storage entry of (key, None); the rest of the unmatched ones are orphans
    none_off = mdx[:, 2] < 0
    bytes_ref: dict[int, StorageRef] = {}
    orphans: dict[tuple[str, tuple[int, ...] | None], StorageRef] = {}
    dims = cols.dims
    kinds = sdm[:, 3]
    for i in np.flatnonzero(~hit).tolist():
        k = int(sd_key[i])
        ref = StorageRef(files[file_of_sd[i]], int(sinfo[i, 2]), int(sinfo[i, 3]), ())
        if k >= 0 and none_off[i] and kinds[k] == sc.C_BSM:
            if k in bytes_ref:
                return None  # a storage entry twice
            bytes_ref[k] = ref
            continue
        offsets = None if none_off[i] else tuple(dims[mdx[i, 2]:mdx[i, 2] + mdx[i, 3]].tolist())
        name = fqn_names[fqn_ids[i]]
        if (name, offsets) in orphans:
            return None
        orphans[(name, offsets)] = ref

    entries: dict[str, Entry] = {}
    tsm_at = dict(zip(tsm_keys.tolist(), range(len(tsm_keys))))
    for k, key in enumerate(keys):
        if kinds[k] == sc.C_BSM:
            entries[key] = Entry(key=key, kind=BYTES, shape=None, dtype=None,
                                 chunks=(Chunk(index=0, offsets=(), sizes=(), storage=bytes_ref.get(k)),))
            continue
        t = tsm_at[k]
        row = tsm[t]
        shape = tuple(dims[row[1]:row[1] + row[2]].tolist())
        dtype = DTYPES[sc.DTYPE_NAMES[row[0]]]
        entries[key] = Entry(key=key, kind=TENSOR, shape=shape, dtype=dtype,
                             chunks=ChunkColumns(table, int(first[t]), int(count[t])))
    version = text(int(meta[3]), int(meta[4])) if meta[3] >= 0 else None
    return entries, orphan_notes(orphans, 0), version


def _names(data: np.ndarray, pos: np.ndarray, lens: np.ndarray, text: Any) -> tuple[np.ndarray, list[str]]:
    """Strings by their place in the bytes: ``(id per row, distinct names)``, each distinct one decoded once."""
    if pos.size == 0:
        return np.zeros(0, np.int64), []
    ids, firsts = sc.compiled_intern()(data, np.ascontiguousarray(pos), np.ascontiguousarray(lens))
    return ids, [text(p, n) for p, n in zip(pos[firsts].tolist(), lens[firsts].tolist())]


def orphan_notes(unclaimed: dict[tuple[str, tuple[int, ...] | None], StorageRef], duplicates: int) -> list[Problem]:
    """Storage entries that no chunk claims (warnings, by key), and a count of repeated indices (an error)."""
    notes = [Problem("warning", "orphan_storage",
                     f"storage_data names {fqn!r} at offsets {offsets} but no such chunk exists", key=fqn,
                     file=ref.file)
             for (fqn, offsets), ref in unclaimed.items()]
    notes.sort(key=lambda p: (p.key or "", p.message))
    if duplicates:
        notes.append(Problem("error", "duplicate_storage",
                             f"{duplicates} storage_data entries repeat a (key, offset) index"))
    return notes
