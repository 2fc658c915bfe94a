"""Write a Megatron indexed dataset (``PREFIX.bin`` + ``PREFIX.idx``), atomically.

Same bytes as megatron-core's ``IndexedDatasetBuilder`` with one sequence per document (what
``tools/preprocess_data.py`` writes without sentence splitting): tests read files written by the
genuine builder and by this writer through the same reader. Both files are written under
temporary names, fsynced and renamed, ``.bin`` first: a crash leaves either the old pair, or a new
``.bin`` with an old ``.idx`` that the reader's bounds checks refuse, never a half-written file
that looks complete.
"""

from __future__ import annotations

import os
import struct
import uuid
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from gtp_runtime.data.indexed import INDEX_HEADER, INDEX_VERSION, code_of


def write_dataset(prefix: str | os.PathLike, documents: Iterable[np.ndarray], dtype: type[np.number]) -> int:
    """Write every document (a 1-D token array) as one sequence; return the token count."""
    prefix = Path(prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    nonce = uuid.uuid4().hex[:8]
    tmp_bin = prefix.with_name(f".{prefix.name}.{nonce}.bin.tmp")
    tmp_idx = prefix.with_name(f".{prefix.name}.{nonce}.idx.tmp")
    lengths: list[int] = []
    try:
        with open(tmp_bin, "wb") as f:
            for doc in documents:
                arr = np.asarray(doc)
                if arr.size and (arr.min() < np.iinfo(dtype).min or arr.max() > np.iinfo(dtype).max):
                    raise ValueError(f"token ids {arr.min()}..{arr.max()} do not fit {np.dtype(dtype).name}")
                f.write(arr.astype(dtype, copy=False).tobytes())
                lengths.append(int(arr.size))
            f.flush()
            os.fsync(f.fileno())
        _write_index(tmp_idx, np.array(lengths, dtype=np.int64), dtype)
        os.replace(tmp_bin, f"{prefix}.bin")
        os.replace(tmp_idx, f"{prefix}.idx")
    finally:
        for t in (tmp_bin, tmp_idx):
            t.unlink(missing_ok=True)
    return int(sum(lengths))


def _write_index(path: Path, lengths: np.ndarray, dtype: type[np.number]) -> None:
    itemsize = np.dtype(dtype).itemsize
    pointers = np.zeros(len(lengths), dtype=np.int64)
    np.cumsum(lengths[:-1] * itemsize, out=pointers[1:])
    with open(path, "wb") as f:
        f.write(INDEX_HEADER + struct.pack("<QBQQ", INDEX_VERSION, code_of(dtype), len(lengths), len(lengths) + 1))
        f.write(lengths.astype(np.int32).tobytes())
        f.write(pointers.tobytes())
        f.write(np.arange(len(lengths) + 1, dtype=np.int64).tobytes())
        f.flush()
        os.fsync(f.fileno())


def write_index(prefix: str | os.PathLike, lengths: np.ndarray, dtype: type[np.number]) -> None:
    """``PREFIX.idx`` for a ``PREFIX.bin`` written elsewhere: one sequence per document, back to back."""
    prefix = Path(prefix)
    tmp = prefix.with_name(f".{prefix.name}.{uuid.uuid4().hex[:8]}.idx.tmp")
    try:
        _write_index(tmp, np.asarray(lengths, dtype=np.int64), dtype)
        os.replace(tmp, f"{prefix}.idx")
    finally:
        tmp.unlink(missing_ok=True)
