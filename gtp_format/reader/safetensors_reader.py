"""Read DCP's safetensors layout by parsing file headers directly: no pickle anywhere.

What torch 2.13 writes (``torch.distributed.checkpoint.HuggingFaceStorageWriter``, checked by
saving 2-rank ShardedTensors and reading the headers back):

* ``save_distributed=True`` (every rank writes its own shards, the layout for sharded training
  state): one file per rank, ``shard-{rank+1:05d}-model-{i:05d}-of-{n:05d}.safetensors`` (``i``/``n``
  from ``fqn_to_index_mapping``, else ``00001-of-00001``). No ``.metadata`` and no index file.
* Each file: 8-byte little-endian header length ``N``; ``N`` bytes of JSON; the data region.
  The JSON maps each key to ``{"dtype": "F32", "shape": [...], "data_offsets": [begin, end]}``
  (offsets relative to byte ``8 + N``) plus ``"__metadata__"``: ``{"DCP_SHARDING_INFO":
  "<json: {key: {\\"saved_offsets\\": [...]}}>", "DCP_VERSION": "1.0", "format": "pt"}``.
  A key's tensor in a file is that rank's chunk; ``saved_offsets`` place it in the global tensor.
* The global shape is stored nowhere. Readers (DCP's own included) take the elementwise max of
  ``offset + shape`` over chunks, so a chunk missing at the *end* of a tensor is undetectable;
  interior holes are detected.
* A rank holding several chunks of one key (Megatron's ``dp_reshardable`` buckets: one chunk per
  param plus padding) keeps only the last: the writer collects a dict keyed by name. torch 2.13
  does this silently; ``verify`` then reports the holes.
* Byte objects (``io.BytesIO`` values) are written as raw ``torch.save`` blobs *before* the
  safetensors header, so the file no longer parses; the header-length check reports it.
* ``save_distributed=False`` (rank 0 saves full tensors) writes ``model-00001-of-00001.safetensors``
  and ``model.safetensors.index.json`` (``weight_map``: key -> file) without sharding info:
  every tensor is one chunk at offset 0. ``enable_consolidation`` puts shards under ``sharded/``
  and full tensors in the folder; the folder's own files are read.

This project's own layout (``gtp_runtime.checkpoint.safetensors_storage``) avoids the two
losses above: ``__{rank}_0.safetensors`` files whose tensors are named ``{key}@{offsets}`` plus an
``index.json`` (written last) with every key's dtype, global shape and chunks (offsets, sizes,
file, tensor name). When ``index.json`` is present it is the source of truth and the headers only
locate each chunk's bytes.

Chunk bytes are raw little-endian elements in row-major order (``ENC_RAW``).
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

from gtp_format import safe_json
from gtp_format.dtypes import BY_SAFETENSORS, DTYPES, DType
from gtp_format.errors import FormatError
from gtp_format.model import TENSOR, Chunk, Entry, Problem, StorageRef
from gtp_format.names import GTP_INDEX_VERSION
from gtp_format.reader.locate import SAFETENSORS_INDEX_FILE, SAFETENSORS_SUFFIX, Located
from gtp_format.reader.storage import is_regular_inside, metadata_limit, read_range, stored_size, unsafe_reason
from gtp_format.safe_json import load_json_object

HEADER_LEN_BYTES = 8
HEADER_LIMIT = 100 << 20  # the safetensors library's own cap on header size
SHARDING_INFO_KEY = "DCP_SHARDING_INFO"
SAVED_OFFSETS_KEY = "saved_offsets"

def safetensors_files(loc: Located) -> dict[str, int]:
    """The ``*.safetensors`` regular files of the folder and their sizes (stat only)."""
    sizes: dict[str, int] = {}
    for name in loc.names:
        if not name.endswith(SAFETENSORS_SUFFIX):
            continue
        size = is_regular_inside(loc.folder, name)
        if size is not None:
            sizes[name] = size
    return sizes


def read_header(folder: Path, name: str, size: int) -> tuple[dict[str, Any], int]:
    """The JSON header of one safetensors file and where its data region starts.

    The declared header length is checked against the real file size before the header is read.
    """
    if size < HEADER_LEN_BYTES:
        raise FormatError(f"{folder / name} is {size} bytes, too short for a safetensors header; "
                          "the file is truncated: restore it")
    (n,) = struct.unpack("<Q", read_range(folder, name, 0, HEADER_LEN_BYTES))
    if n > HEADER_LIMIT or HEADER_LEN_BYTES + n > size:
        raise FormatError(
            f"{folder / name} declares a {n}-byte safetensors header but the file has {size} bytes; it is "
            "truncated or not a safetensors file (DCP writes byte objects ahead of the header): restore it"
        )
    raw = read_range(folder, name, HEADER_LEN_BYTES, n)
    header = safe_json.loads(raw, f"the safetensors header of {folder / name}", "restore the file")
    if not isinstance(header, dict):
        raise FormatError(f"{folder / name} has a safetensors header that is not a JSON object; restore the file")
    return header, HEADER_LEN_BYTES + n


def _sharding_info(header: dict[str, Any], where: str) -> dict[str, Any]:
    meta = header.get("__metadata__") or {}
    if not isinstance(meta, dict):
        raise FormatError(f"{where}: __metadata__ is not a JSON object; restore the file")
    raw = meta.get(SHARDING_INFO_KEY)
    if raw is None:
        return {}
    info = safe_json.loads(raw, f"{where}: __metadata__.{SHARDING_INFO_KEY}", "restore the file") \
        if isinstance(raw, str) else None
    if not isinstance(info, dict):
        raise FormatError(f"{where}: __metadata__.{SHARDING_INFO_KEY} is not a JSON object; restore the file")
    return info


def _dtype_from_str(name: Any) -> DType | None:
    """``"torch.float32"`` -> the float32 entry; only names of real dtypes are accepted."""
    if not isinstance(name, str) or not name.startswith("torch."):
        return None
    return DTYPES.get(name.removeprefix("torch."))


def nonnegative_ints(value: Any) -> tuple[int, ...] | None:
    """A JSON list of ints >= 0 (no bools) as a tuple, else None: the one shape check of a
    safetensors header's ``shape`` and ``data_offsets`` (this reader's and ``ckpt import``'s)."""
    if isinstance(value, list) and all(type(v) is int and v >= 0 for v in value):
        return tuple(value)
    return None


def read_gtp_index(loc: Located, files: dict[str, int], index_file: str,
                   ) -> tuple[dict[str, Entry], list[Problem]]:
    """Entries and notes of this project's safetensors layout: ``index.json`` plus chunk headers."""
    path = loc.folder / index_file
    stored = sum(stored_size(loc.folder, name) for name in files)  # not st_size: sparse files are free
    index = load_json_object(path, "the safetensors index", metadata_limit(stored, loc.store))
    fix = f"restore {index_file} from a good copy"
    if type(index.get("version")) is not int or index["version"] > GTP_INDEX_VERSION:
        raise FormatError(f"{path} has version {index.get('version')!r}; this ckpt reads version "
                          f"{GTP_INDEX_VERSION}: upgrade ckpt or {fix}")
    keys = index.get("keys")
    if not isinstance(keys, dict):
        raise FormatError(f"{path} has no 'keys' object; {fix}")
    headers: dict[str, tuple[dict[str, Any], int] | str] = {}
    notes: list[Problem] = []
    entries: dict[str, Entry] = {}
    for key, spec in keys.items():
        dtype = _dtype_from_str(spec.get("dtype")) if isinstance(spec, dict) else None
        shape = nonnegative_ints(spec.get("shape")) if isinstance(spec, dict) else None
        raw_chunks = spec.get("chunks") if isinstance(spec, dict) else None
        if dtype is None or shape is None or not isinstance(raw_chunks, list):
            raise FormatError(f"{path}: key {key!r} has no valid dtype, shape and chunks; {fix}")
        chunks = []
        for i, c in enumerate(raw_chunks):
            offsets = nonnegative_ints(c.get("offsets")) if isinstance(c, dict) else None
            sizes = nonnegative_ints(c.get("sizes")) if isinstance(c, dict) else None
            named = isinstance(c, dict) and isinstance(c.get("file"), str) and isinstance(c.get("name"), str)
            if offsets is None or sizes is None or not named:
                raise FormatError(f"{path}: key {key!r} chunk {i} lacks offsets, sizes, file or name; {fix}")
            ref, problem = _locate_named(loc, files, headers, c["file"], c["name"], dtype, sizes)
            if problem is not None:
                notes.append(Problem("error", "index", problem, key=key, chunk=i, file=c["file"]))
            chunks.append(Chunk(index=i, offsets=offsets, sizes=sizes, storage=ref))
        entries[key] = Entry(key=key, kind=TENSOR, shape=shape, dtype=dtype, chunks=tuple(chunks))
    return entries, notes


def _locate_named(loc: Located, files: dict[str, int], headers: dict[str, tuple[dict[str, Any], int] | str],
                  file: str, name: str, dtype: DType, sizes: tuple[int, ...]
                  ) -> tuple[StorageRef | None, str | None]:
    """Byte range of tensor ``name`` in ``file`` (headers parsed once per file), or why not."""
    if file not in headers:
        if unsafe_reason(file) is not None or file not in files:
            headers[file] = unsafe_reason(file) or f"data file {file} is missing or not a regular file"
        else:
            try:
                headers[file] = read_header(loc.folder, file, files[file])
            except FormatError as e:
                headers[file] = e.message
    got = headers[file]
    if isinstance(got, str):
        return None, f"chunk cannot be located: {got}"
    header, data_start = got
    spec = header.get(name)
    span = nonnegative_ints(spec.get("data_offsets")) if isinstance(spec, dict) else None
    if span is None or len(span) != 2 or span[0] > span[1]:
        return None, f"{file} has no tensor named {name!r}"
    code = spec.get("dtype")
    if (not isinstance(code, str) or BY_SAFETENSORS.get(code) is not dtype
            or nonnegative_ints(spec.get("shape")) != sizes):
        return None, (f"{file}:{name} is {spec.get('dtype')} {spec.get('shape')} but the index says {dtype} "
                      f"{list(sizes)}")
    return StorageRef(file=file, offset=data_start + span[0], length=span[1] - span[0]), None


def read_safetensors_metadata(loc: Located, files: dict[str, int]) -> tuple[dict[str, Entry], list[Problem]]:
    """Entries and notes of a DCP HuggingFaceStorageWriter folder, from the headers alone."""
    chunks: dict[str, list[tuple[tuple[int, ...], tuple[int, ...], StorageRef]]] = {}
    dtypes: dict[str, DType] = {}
    notes: list[Problem] = []
    for name, size in files.items():
        header, data_start = read_header(loc.folder, name, size)
        where = str(loc.folder / name)
        info = _sharding_info(header, where)
        for key, spec in header.items():
            if key == "__metadata__":
                continue
            if not isinstance(spec, dict):
                raise FormatError(f"{where}: header entry {key!r} is not a JSON object; restore the file")
            dtype_name = spec.get("dtype")
            dtype = BY_SAFETENSORS.get(dtype_name) if isinstance(dtype_name, str) else None
            shape = nonnegative_ints(spec.get("shape"))
            span = nonnegative_ints(spec.get("data_offsets"))
            if dtype is None or shape is None or span is None or len(span) != 2 or span[0] > span[1]:
                raise FormatError(f"{where}: header entry {key!r} has a bad dtype, shape or data_offsets "
                                  f"({spec!r}); restore the file")
            sharding = info.get(key, {})
            offsets = (nonnegative_ints(sharding.get(SAVED_OFFSETS_KEY)) if isinstance(sharding, dict) and sharding
                       else None)
            if offsets is None:
                if key in info:
                    raise FormatError(f"{where}: {SHARDING_INFO_KEY}[{key!r}] has no valid saved_offsets; "
                                      "restore the file")
                offsets = (0,) * len(shape)
            if len(offsets) != len(shape):
                raise FormatError(f"{where}: {key!r} has {len(shape)} dims but saved_offsets {list(offsets)}; "
                                  "restore the file")
            if key in dtypes and dtypes[key] != dtype:
                notes.append(Problem("error", "dtype_mismatch",
                                     f"{key} is {dtype} in {name} but {dtypes[key]} in another file",
                                     key=key, file=name))
            dtypes.setdefault(key, dtype)
            ref = StorageRef(file=name, offset=data_start + span[0], length=span[1] - span[0])
            chunks.setdefault(key, []).append((offsets, shape, ref))
    notes += _index_notes(loc, chunks)
    entries = {}
    for key in sorted(chunks):
        boxes = chunks[key]
        ndim = len(boxes[0][1])
        shape = tuple(max(o[d] + s[d] for o, s, _ in boxes) for d in range(ndim))
        entries[key] = Entry(
            key=key, kind=TENSOR, shape=shape, dtype=dtypes[key],
            chunks=tuple(Chunk(index=i, offsets=o, sizes=s, storage=r) for i, (o, s, r) in enumerate(boxes)),
        )
    return entries, notes


def _index_notes(loc: Located, chunks: dict[str, list[tuple[tuple[int, ...], tuple[int, ...], StorageRef]]]
                 ) -> list[Problem]:
    """Cross-check ``model.safetensors.index.json`` (rank-0 saves) against the headers."""
    if SAFETENSORS_INDEX_FILE not in loc.names:
        return []
    index = load_json_object(loc.folder / SAFETENSORS_INDEX_FILE, "a safetensors index")
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict):
        return [Problem("error", "index", f"{SAFETENSORS_INDEX_FILE} has no weight_map object",
                        file=SAFETENSORS_INDEX_FILE)]
    notes = []
    for key, file in weight_map.items():
        files = {ref.file for _, _, ref in chunks.get(key, [])}
        if file not in files:
            notes.append(Problem("error", "index", f"{SAFETENSORS_INDEX_FILE} puts {key} in {file}, "
                                 f"but the headers have it in {sorted(files) or 'no file'}",
                                 key=key, file=str(file)))
    for key in chunks.keys() - weight_map.keys():
        notes.append(Problem("warning", "index", f"{key} is in the files but not in {SAFETENSORS_INDEX_FILE}",
                             key=key))
    return notes

