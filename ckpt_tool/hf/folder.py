"""A Hugging Face model folder, both ways: the files ``export --to hf`` writes around the tensors, and
reading one (``import --from hf``) without trusting it.

Writing: HF's own naming (``save_pretrained``): ``model.safetensors`` when everything fits one file,
else ``model-0000k-of-0000n.safetensors`` and ``model.safetensors.index.json`` (``total_size`` and a
``weight_map``); the same for ``optimizer``. A tokenizer is copied only from a file the user names
(``--tokenizer``): a checkpoint records its data path as information and is never a reason to open it.

Reading: every file is opened by a name that must be a plain file name inside the folder (an index's
``weight_map`` names files: never a path, never a symlink out), JSON through the size-capped parser,
each safetensors header checked (size, dtypes, shapes, offsets inside the file, no overlap) before a
tensor byte is read; tensors are read as numpy memory maps, a box at a time. A folder in a bucket
(``s3://BUCKET/PREFIX``) is read through the storage functions every checkpoint read goes through
(:mod:`gtp_format.reader.storage`: keys confined to the prefix, sizes from the store, bounded ranged
reads), with the same checks; a box is then one ranged read instead of a memory map.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gtp_format.commit import write_durable
from gtp_format.dtypes import DType, by_name
from gtp_format.errors import FormatError
from gtp_format.reader import storage
from gtp_format.reader.safetensors_reader import nonnegative_ints
from gtp_format.safe_json import Budget, loads
from gtp_format.scan import carrier
from gtp_format.storage.base import storage_for
from gtp_format.storage.location import ObjectURL

Folder = Path | ObjectURL  # a local model folder, or one in a bucket

CONFIG = "config.json"
GENERATION = "generation_config.json"
TOKENIZER = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
MAX_JSON = 64 << 20  # a tokenizer.json of a 256k vocabulary is ~20 MB; configs and indexes are far smaller
MAX_HEADER = 100 << 20  # the safetensors library's own header limit
# Budgets of what each JSON input can need (parsed, a 64 MiB file of short values took 740 MB): a config is
# a few KB; an index names every tensor (~9 MB for 91k tensors); a tokenizer ~80 bytes and 2-3 values per
# token of the model's vocabulary (merges included); a safetensors header ~150 bytes per tensor, and a tensor
# stores at least 2 bytes, so the header is held to 1 MiB plus 1/16 of the data bytes the file stores.
CONFIG_BUDGET = Budget(1 << 20, 64 << 10, "a model config")
INDEX_BUDGET = Budget(16 << 20, 2 << 20, "a safetensors index")
TOKENIZER_BYTES_PER_TOKEN, TOKENIZER_VALUES_PER_TOKEN = 256, 8
HEADER_PER_DATA = 16
ST_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
EOS_NAMES = ("<|endoftext|>", "</s>", "<eos>")  # gtp_runtime.data prepare's BPE: <|endoftext|>, id 0


def shard_names(n: int, prefix: str) -> list[str]:
    """HF's file names for ``n`` files: ``model.safetensors`` alone, else ``model-0000k-of-0000n``."""
    if n == 1:
        return [f"{prefix}.safetensors"]
    return [f"{prefix}-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def index_name(prefix: str) -> str:
    return f"{prefix}.safetensors.index.json"


def write_index(folder: Path, prefix: str, total: int, weight_map: dict[str, str]) -> int:
    """The index of a sharded set (HF writes none for one file); returns the files written."""
    if len(set(weight_map.values())) <= 1:
        return 0
    write_durable(folder / index_name(prefix), json.dumps({"metadata": {"total_size": total},
                                                           "weight_map": weight_map}, indent=2))
    return 1


def read_capped(path: Path | ObjectURL, what: str, fix: str, follow: bool = False, limit: int = MAX_JSON) -> bytes:
    """A JSON file's bytes, within ``limit``; a file of a folder being read is never a symlink
    (``follow``: a file the user named on the command line may be)."""
    if storage_for(path).remote:  # the size the store reports is checked before a byte is read
        return storage.read_small_file(path, limit, what, fix)
    if (path.is_symlink() and not follow) or not path.is_file():
        raise FormatError(f"{path}: {'a symlink' if path.is_symlink() else 'missing or not a file'}; {fix}")
    with open(path, "rb") as f:
        raw = f.read(limit + 1)
    if len(raw) > limit:
        raise FormatError(f"{path}: more than {limit} bytes, larger than any genuine {what}; {fix}")
    return raw


def read_json(path: Path | ObjectURL, what: str, fix: str, budget: Budget = CONFIG_BUDGET) -> Any:
    """A JSON file of an HF folder, within ``budget`` (bytes and parsed values)."""
    return loads(read_capped(path, what, fix, limit=budget.limit), str(path), fix, budget)


def tokenizer_eos(path: Path, vocab_size: int) -> tuple[bytes, int | None, str | None]:
    """The bytes of a ``tokenizers`` JSON file named by ``--tokenizer`` and its end-of-text token (id and
    text), if any; refused when it has ids the model cannot embed (a tokenizer of another run)."""
    fix = "pass the PREFIX.tokenizer.json that `gtp_runtime.data prepare` wrote"
    tokens = max(1, vocab_size)
    budget = Budget.per_item(tokens, TOKENIZER_BYTES_PER_TOKEN, TOKENIZER_VALUES_PER_TOKEN,
                             f"a tokenizer of the model's {vocab_size:,}-token vocabulary", ceiling=MAX_JSON)
    raw = read_capped(path, "tokenizer.json", fix, follow=True, limit=budget.limit)
    doc = loads(raw, str(path), fix, budget)
    if not isinstance(doc, dict) or not isinstance(doc.get("model"), dict):
        raise FormatError(f"{path}: not a Hugging Face tokenizers file (no 'model' object); pass the "
                          "PREFIX.tokenizer.json that `python -m gtp_runtime.data prepare --tokenizer bpe` wrote")
    vocab = doc["model"].get("vocab")
    ids = [i for i in (vocab.values() if isinstance(vocab, dict) else []) if isinstance(i, int)]
    ids += [t["id"] for t in doc.get("added_tokens") or [] if isinstance(t, dict) and isinstance(t.get("id"), int)]
    if ids and max(ids) >= vocab_size:
        raise FormatError(f"{path}: has token id {max(ids)}, but the model embeds {vocab_size} tokens; pass the "
                          "tokenizer of the data this checkpoint was trained on")
    for tok in doc.get("added_tokens") or []:
        if isinstance(tok, dict) and tok.get("content") in EOS_NAMES and isinstance(tok.get("id"), int):
            return raw, tok["id"], tok["content"]
    return raw, None, None


def tokenizer_config(eos: int | None, eos_text: str | None) -> dict[str, Any]:
    out: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1 << 30}
    if eos is not None and eos_text is not None:
        out.update(bos_token=eos_text, eos_token=eos_text)
    return out


ADVISE_PIECE = 1 << 20  # WILLNEED per call (gtp_format.check.data_read: the kernel caps one call)

# -- reading ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Tensor:
    name: str
    file: Path | ObjectURL
    dtype: DType
    shape: tuple[int, ...]
    offset: int  # of the first byte in the file

    def read_rows(self, a: int, b: int, cols: tuple[int, int] | None = None) -> np.ndarray:
        """Rows ``[a, b)`` (and columns ``cols`` of a 2-D tensor), stored bits."""
        row = math.prod(self.shape[1:]) * self.dtype.itemsize
        # One bounded read of the rows, checked against the file (or the store) as it is now. Never a
        # memory map: a file cut while it is mapped ends the process with SIGBUS on the first page
        # past the new end, where a read returns short and is one line naming the file.
        raw = storage.read_range(self.file.parent, self.file.name, self.offset + a * row, (b - a) * row)
        rows = np.frombuffer(raw, dtype=carrier(self.dtype)).reshape((b - a, *self.shape[1:]))
        return rows if cols is None else np.array(rows[:, cols[0]:cols[1]])

    def will_need(self, a: int, b: int) -> None:
        """Ask the kernel to read rows ``[a, b)`` of a local file into the page cache now (``WILLNEED``, in
        :data:`ADVISE_PIECE` calls: one call reads about its readahead size), so a later read finds them; advice
        only: nothing is read into this process, an error is ignored, a bucket's object is left alone."""
        if storage_for(self.file.parent).remote or not hasattr(os, "posix_fadvise"):
            return
        row = math.prod(self.shape[1:]) * self.dtype.itemsize
        start, stop = self.offset + a * row, self.offset + b * row
        try:
            with storage.open_regular(self.file.parent, self.file.name) as f:
                for lo in range(start, stop, ADVISE_PIECE):
                    os.posix_fadvise(f.fileno(), lo, min(stop, lo + ADVISE_PIECE) - lo, os.POSIX_FADV_WILLNEED)
        except (OSError, FormatError):
            pass

    def read_rows_into(self, a: int, b: int, out: np.ndarray) -> None:
        """Rows ``[a, b)``, stored bits, read into ``out`` (C-contiguous, exactly their bytes: rows of the caller's
        own result), through the page cache, with :meth:`read_rows`'s checks; no buffer of their own."""
        row = math.prod(self.shape[1:]) * self.dtype.itemsize
        if not out.flags.c_contiguous or out.nbytes != (b - a) * row:
            raise ValueError(f"{self.name}: a {out.nbytes}-byte destination for {b - a} rows of {row} bytes")
        dest = memoryview(out.reshape(-1).view(np.uint8))
        storage.read_range(self.file.parent, self.file.name, self.offset + a * row, (b - a) * row,
                           into=lambda n: dest, cached=True)


def _plain_file(folder: Folder, name: Any, where: str) -> Path | ObjectURL:
    if not isinstance(name, str) or not name or os.sep in name or "/" in name or name in (".", "..") \
            or "\x00" in name:
        raise FormatError(f"{where}: names the file {name!r}, not a plain file name inside {folder}; an index "
                          "may only name files of its own folder")
    path = folder / name
    if storage_for(folder).remote:  # a store has no symlinks
        if storage.is_regular_inside(folder, name) is None:
            raise FormatError(f"{where}: names {name}, which is missing in {folder}; copy the complete model folder")
        return path
    if path.is_symlink() or not path.is_file():
        raise FormatError(f"{where}: names {name}, which is {'a symlink' if path.is_symlink() else 'missing'} in "
                          f"{folder}; copy the complete model folder")
    return path


def _header(path: Path | ObjectURL) -> tuple[dict[str, Tensor], dict[str, str]]:
    remote = storage_for(path).remote
    with (storage.open_regular(path.parent, path.name, "safetensors file") if remote else storage.open_path(path)) as f:
        size = storage.size_of(f)
        head = f.read(8)
        if len(head) < 8:
            raise FormatError(f"{path}: shorter than a safetensors header; the file is truncated")
        n = struct.unpack("<Q", head)[0]
        if n > min(MAX_HEADER, size - 8):
            raise FormatError(f"{path}: header of {n} bytes in a {size}-byte file; not a safetensors file or truncated")
        stored = size if remote else storage.stored_bytes(os.fstat(f.fileno()))  # an object stores every byte
        most = (1 << 20) + max(0, stored - 8 - n) // HEADER_PER_DATA  # by the data bytes the file really stores
        if n > most:
            raise FormatError(f"{path}: a header of {n} bytes for {max(0, stored - 8 - n)} stored data bytes, more "
                              f"than the {most} its tensors can need (a header spends ~150 bytes per tensor); "
                              "re-save the model with safetensors")
        doc = loads(f.read(n), str(path), "re-save the model with safetensors")
    if not isinstance(doc, dict):
        raise FormatError(f"{path}: the safetensors header is not an object")
    meta = doc.get("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise FormatError(f"{path}: the safetensors __metadata__ is not an object of strings; the file is damaged")
    out, spans = {}, []
    for name, e in doc.items():
        if name == "__metadata__":
            continue
        shape = nonnegative_ints(e.get("shape")) if isinstance(e, dict) else None
        span = nonnegative_ints(e.get("data_offsets")) if isinstance(e, dict) else None
        if not isinstance(e, dict) or not isinstance(e.get("dtype"), str) or e["dtype"] not in ST_DTYPES \
                or shape is None or span is None \
                or len(span) != 2:
            raise FormatError(f"{path}: tensor {name!r} has an ill-formed header entry (dtype one of "
                              f"{', '.join(ST_DTYPES)}, a shape and two data offsets)")
        dt = by_name(ST_DTYPES[e["dtype"]])
        a, b = span
        if not a <= b <= size - 8 - n or b - a != math.prod(shape) * dt.itemsize:
            raise FormatError(f"{path}: tensor {name!r} spans bytes [{a}, {b}), which is not its shape "
                              f"{list(shape)} of {dt.name} inside the file's {size - 8 - n} data bytes")
        spans.append((a, b, name))
        out[name] = Tensor(name, path, dt, shape, 8 + n + a)
    spans.sort()
    for (_, b0, n0), (a1, _, n1) in zip(spans, spans[1:]):
        if a1 < b0:
            raise FormatError(f"{path}: tensors {n0!r} and {n1!r} overlap; the file is damaged")
    return out, meta


def _exists(folder: Folder, name: str) -> bool:
    """Whether the folder has an entry ``name`` (a symlink counts: it is then refused by name)."""
    if storage_for(folder).remote:  # a store has no symlinks
        return storage.is_regular_inside(folder, name) is not None
    return (folder / name).exists() or (folder / name).is_symlink()


def read_set(folder: Folder, prefix: str, fix: str) -> tuple[dict[str, Tensor], list[dict[str, str]]] | None:
    """Every tensor of the set ``prefix`` (``model``, ``optimizer``; headers only) and each file's
    ``__metadata__``; ``None`` when the folder has neither ``PREFIX.safetensors`` nor its index."""
    index = folder / index_name(prefix)
    single = folder / f"{prefix}.safetensors"
    wmap: dict[str, Any] = {}
    if _exists(folder, index.name):
        doc = read_json(index, "index", fix, INDEX_BUDGET)
        got = doc.get("weight_map") if isinstance(doc, dict) else None
        if not isinstance(got, dict):
            raise FormatError(f"{index}: no weight_map object; {fix}")
        wmap = got
        files = sorted({_plain_file(folder, f, str(index)) for f in wmap.values()})
    elif _exists(folder, single.name):
        files = [_plain_file(folder, single.name, str(folder))]
    else:
        return None
    tensors: dict[str, Tensor] = {}
    metas = []
    for path in files:
        got_tensors, meta = _header(path)
        metas.append(meta)
        for name, t in got_tensors.items():
            if name in tensors:
                raise FormatError(f"{path}: tensor {name!r} is also in {tensors[name].file.name}; the folder is "
                                  "inconsistent")
            tensors[name] = t
    wrong = [k for k, f in wmap.items() if k not in tensors or tensors[k].file.name != f]
    if wrong:
        raise FormatError(f"{index}: weight_map puts {wrong[0]!r} in a file that does not hold it; {fix}")
    return tensors, metas


def read_folder(folder: Folder) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """``config.json`` and every weight tensor of an HF model folder (headers only)."""
    if not storage_for(folder).is_folder():
        raise FormatError(f"{folder}: not a folder; pass the Hugging Face model folder (config.json, "
                          "model*.safetensors)")
    fix = "pass a folder written by save_pretrained (safetensors)"
    cfg = read_json(folder / CONFIG, CONFIG, fix)
    if not isinstance(cfg, dict):
        raise FormatError(f"{folder / CONFIG}: not a JSON object; {fix}")
    got = read_set(folder, "model", fix)
    if got is None:
        raise FormatError(f"{folder}: names model.safetensors, which is missing in {folder}; copy the complete "
                          "model folder")
    return cfg, got[0]
