"""Megatron's indexed dataset (``PREFIX.idx`` + ``PREFIX.bin``) and flat token files, read as untrusted.

``.idx`` layout (megatron-core ``indexed_dataset.py``, version 1, little-endian)::

    9 bytes  b"MMIDIDX\\x00\\x00"
    u64      version (1)
    u8       dtype code of the tokens in .bin (1 uint8, 2 int8, 3 int16, 4 int32, 5 int64,
             6 float64, 7 float32, 8 uint16)
    u64      sequence count S
    u64      document-index count D (= documents + 1)
    i32[S]   sequence lengths in tokens
    i64[S]   sequence pointers: byte offsets into .bin
    i64[D]   document indices: sequence ids, from 0 to S, where each document starts
    i8[S]    sequence modes (multimodal datasets only; ignored here)

Why so strict: the counts in the header decide how much is read, so a hostile or truncated file
could claim 2**64 sequences or point past the end of ``.bin``. Every count is checked against the
real file size *before* anything is mapped by it, every pointer, length and document index is
checked in bounds (in blocks, so a 10 GB corpus's index costs a bounded amount of memory), the
sequences must not overlap in ``.bin`` (so an epoch is at most the ``.bin``), and a file that
stores under half its size on disk (sparse) is refused (so the sizes themselves are real).

Nothing is memory-mapped: a mapped file that another process truncates kills the reader with SIGBUS
at the first access past the new end (no error line, no clean-up), and a dataset is a user's file
that may be rewritten under a running job. The ``.idx`` arrays are read whole (their size is the
``.idx``'s, checked real above: a 10 GB corpus's index is tens of MB); the ``.bin`` stays on disk and
a batch reads only its own tokens, in runs of neighbouring elements, with ``pread``
(:class:`TokenFile`), so the resident memory is the batches in flight, not the corpus. A read that
comes back short (the file shrank) is one :class:`DataError` naming the file.

A flat token file is a ``.bin`` of uint16 or uint32 tokens with no ``.idx``; it is cut into
pseudo-documents of :data:`FLAT_DOC_TOKENS` tokens so that it can be shuffled and split like an
indexed dataset.
"""

from __future__ import annotations

import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gtp_format.reader.storage import SPARSE_SLACK, stored_bytes

INDEX_HEADER = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
HEADER_BYTES = 9 + 8 + 1 + 8 + 8
DTYPE_CODES: dict[int, type[np.number]] = {
    1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16,
}
FLAT_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
FLAT_DOC_TOKENS = 1 << 16
_BLOCK = 1 << 20  # index entries validated per block


class DataError(ValueError):
    """A data file that cannot be used. One line that names the file and the fix."""


def code_of(dtype: type[np.number]) -> int:
    return next(c for c, d in DTYPE_CODES.items() if np.dtype(d) == np.dtype(dtype))


def _regular_size(path: Path) -> int:
    """Size of a data file that really stores its bytes.

    Why the sparse check: the sizes of ``.idx`` and ``.bin`` decide how many sequences,
    documents and samples get per-element arrays, and a sparse file has any size for free. A
    3.6 GB ``.idx`` of holes declaring 3e8 sequences, or a 16 TiB flat ``.bin`` (2.7 GB of
    pseudo-document arrays), exhausted memory before a batch was read. A file that
    stores under half its size is refused, so every array is bounded by bytes that exist.
    """
    try:
        st = os.stat(path)
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror}); check --data-path") from None
    if not stat.S_ISREG(st.st_mode):
        raise DataError(f"{path}: not a regular file; point --data-path at a dataset prefix or a .bin file")
    stored = stored_bytes(st)
    if st.st_size > SPARSE_SLACK and stored * 2 < st.st_size:
        raise DataError(f"{path}: {st.st_size} bytes, but only {stored} are stored on disk (a sparse file: the rest "
                        "are holes nobody wrote); regenerate the dataset, or copy it in full (cp --sparse=never)")
    return st.st_size


_GAP = 64  # elements: neighbours of a batch closer than this are read in one run (fewer, larger preads)


def _pread(fd: int, path: Path, nbytes: int, offset: int) -> bytearray:
    """``nbytes`` at ``offset`` of ``fd``, whole, or one :class:`DataError` if the file ends first."""
    buf = bytearray(nbytes)
    view, got = memoryview(buf), 0
    while got < nbytes:
        try:
            n = os.preadv(fd, [view[got:]], offset + got)
        except OSError as e:
            raise DataError(f"{path}: cannot read ({e.strerror}); check --data-path") from None
        if n == 0:
            raise DataError(f"{path}: the file ended at byte {offset + got} while {nbytes} bytes from {offset} were "
                            "read (it shrank or was replaced while training read it); keep a dataset unchanged "
                            "while a job uses it")
        got += n
    return buf


class TokenFile:
    """The tokens of a ``.bin``: indexed like a 1-D array (an int, a slice or an array of ints), each
    read served by bounded ``pread`` calls (see the module docstring for why never a memory map)."""

    def __init__(self, path: Path, dtype: type[np.number], count: int) -> None:
        self.path, self.dtype, self.count = path, np.dtype(dtype), count
        self._fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))

    def __len__(self) -> int:
        return self.count

    def __del__(self) -> None:
        fd, self._fd = getattr(self, "_fd", -1), -1
        if fd >= 0:
            os.close(fd)

    def _read(self, first: int, n: int) -> np.ndarray:
        size = self.dtype.itemsize
        return np.frombuffer(_pread(self._fd, self.path, n * size, first * size), dtype=self.dtype)

    def __getitem__(self, key: int | slice | np.ndarray) -> np.ndarray | np.number:
        if isinstance(key, slice):
            start, stop, step = key.indices(self.count)
            return self._read(start, max(0, stop - start))[::step] if stop > start else np.empty(0, self.dtype)
        if isinstance(key, int | np.integer):
            k = int(key) + (self.count if key < 0 else 0)
            if not 0 <= k < self.count:
                raise IndexError(f"token {int(key)} outside {self.count}")
            return self._read(k, 1)[0]
        idx = np.asarray(key, dtype=np.int64)
        if idx.size == 0:
            return np.empty(idx.shape, self.dtype)
        lo, hi = int(idx.min()), int(idx.max()) + 1
        if lo < 0 or hi > self.count:
            raise IndexError(f"token index outside {self.count}")
        if hi - lo <= 2 * idx.size + _GAP:  # dense (a batch in file order): one read, no sort
            return self._read(lo, hi - lo)[idx - lo]
        u = np.unique(idx)
        cut = np.nonzero(np.diff(u) > _GAP)[0]
        starts = u[np.concatenate([[0], cut + 1])]
        ends = u[np.concatenate([cut, [len(u) - 1]])] + 1
        base = np.concatenate([[0], np.cumsum(ends - starts)[:-1]])
        buf = np.concatenate([self._read(int(a), int(b - a)) for a, b in zip(starts, ends)])
        run = np.searchsorted(starts, idx, side="right") - 1
        return buf[base[run] + idx - starts[run]]

    def __array__(self, dtype: np.dtype | None = None, copy: bool | None = None) -> np.ndarray:
        """Every token (tests and tools; training reads batches)."""
        out = self._read(0, self.count) if self.count else np.empty(0, self.dtype)
        return out.astype(dtype) if dtype is not None else out


@dataclass
class TokenDataset:
    """Tokens of a dataset (read on demand, :class:`TokenFile`) plus where each document's tokens are.

    ``starts``/``lengths`` are in tokens (element offsets into ``tokens``), one entry per
    sequence; ``doc_index`` has documents + 1 entries of sequence ids.
    """

    name: str
    tokens: TokenFile
    starts: np.ndarray
    lengths: np.ndarray
    doc_index: np.ndarray

    @property
    def num_documents(self) -> int:
        return len(self.doc_index) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum(dtype=np.int64))

    def release(self) -> None:
        """Nothing to give back: the tokens are read per batch, not mapped (the sampler still calls it)."""

    def fingerprint(self) -> dict[str, int | str]:
        """What identifies the data in a checkpoint (cheap: no pass over the tokens)."""
        return {"name": self.name, "dtype": str(self.tokens.dtype), "sequences": len(self.lengths),
                "documents": self.num_documents, "tokens": self.num_tokens}


def _array(path: Path, dtype: type[np.number], count: int, offset: int = 0) -> np.ndarray:
    """``count`` items at ``offset`` of ``path``, read whole (the caller checked the file holds them)."""
    if count == 0:
        return np.zeros(0, dtype=dtype)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        return np.frombuffer(_pread(fd, path, count * np.dtype(dtype).itemsize, offset), dtype=dtype)
    finally:
        os.close(fd)


def read_index(prefix: str | os.PathLike) -> TokenDataset:
    """Open and validate ``PREFIX.idx``/``PREFIX.bin``; raise :class:`DataError` on any defect."""
    idx, bin_ = Path(f"{prefix}.idx"), Path(f"{prefix}.bin")
    idx_size, bin_size = _regular_size(idx), _regular_size(bin_)
    if idx_size < HEADER_BYTES:
        raise DataError(f"{idx}: {idx_size} bytes, shorter than the {HEADER_BYTES}-byte header; the file is truncated")
    with open(idx, "rb") as f:
        head = f.read(HEADER_BYTES)
    if head[:9] != INDEX_HEADER:
        raise DataError(f"{idx}: not a Megatron indexed dataset (header {head[:9]!r}, expected {INDEX_HEADER!r})")
    version, code, n_seq, n_doc = struct.unpack("<QBQQ", head[9:])
    if version != INDEX_VERSION:
        raise DataError(f"{idx}: index version {version}, only version {INDEX_VERSION} is supported")
    if code not in DTYPE_CODES:
        raise DataError(f"{idx}: unknown dtype code {code} (valid: 1-8); the file is corrupt")
    dtype = DTYPE_CODES[code]
    if not np.issubdtype(dtype, np.integer):
        raise DataError(f"{idx}: dtype code {code} is {np.dtype(dtype).name}, which cannot hold token ids")
    need = HEADER_BYTES + 12 * n_seq + 8 * n_doc
    if idx_size not in (need, need + n_seq):  # + n_seq: multimodal sequence modes
        raise DataError(f"{idx}: header declares {n_seq} sequences and {n_doc} document indices ({need} bytes), "
                        f"but the file has {idx_size} bytes; the file is truncated or not an index")
    if n_doc < 2:
        raise DataError(f"{idx}: {max(n_doc, 1) - 1} documents; the dataset is empty")
    itemsize = np.dtype(dtype).itemsize
    lengths = _array(idx, np.int32, n_seq, HEADER_BYTES)
    pointers = _array(idx, np.int64, n_seq, HEADER_BYTES + 4 * n_seq)
    docs = _array(idx, np.int64, n_doc, HEADER_BYTES + 12 * n_seq)
    for lo in range(0, n_seq, _BLOCK):
        ln, pt = lengths[lo : lo + _BLOCK].astype(np.int64), pointers[lo : lo + _BLOCK]
        bad = (ln < 0) | (pt < 0) | (pt % itemsize != 0) | (pt > bin_size) | (ln > (bin_size - pt) // itemsize)
        if bad.any():
            i = lo + int(np.argmax(bad))
            raise DataError(f"{idx}: sequence {i} (pointer {int(pointers[i])}, length {int(lengths[i])} tokens of "
                            f"{itemsize} bytes) lies outside {bin_.name} ({bin_size} bytes); the index does not "
                            "match the .bin")
    _check_disjoint(idx, bin_.name, lengths, pointers, itemsize)
    if docs[0] != 0 or docs[-1] != n_seq:
        raise DataError(f"{idx}: document indices must run from 0 to {n_seq} (the sequence count), found "
                        f"{int(docs[0])} .. {int(docs[-1])}; the file is corrupt")
    for lo in range(0, n_doc - 1, _BLOCK):
        block = docs[lo : lo + _BLOCK + 1]
        if (np.diff(block) < 0).any():
            raise DataError(f"{idx}: document indices decrease near document {lo + int(np.argmax(np.diff(block) < 0))}"
                            "; the file is corrupt")
    if bin_size % itemsize:
        raise DataError(f"{bin_}: {bin_size} bytes is not a whole number of {np.dtype(dtype).name} tokens")
    tokens = TokenFile(bin_, dtype, bin_size // itemsize)
    return TokenDataset(Path(prefix).name, tokens, pointers // itemsize if n_seq else pointers, lengths, docs)


def _check_disjoint(idx: Path, bin_name: str, lengths: np.ndarray, pointers: np.ndarray, itemsize: int) -> None:
    """Refuse sequences whose token ranges overlap in ``.bin``.

    Why: every sequence is in bounds on its own, yet a million sequences all naming the whole
    ``.bin`` made an epoch a million times the file, and the sample permutation (8 bytes per
    sample) grew with it. Disjoint ranges bound the tokens of an epoch, hence its
    samples, by the ``.bin`` itself. Megatron writes sequences back to back, in order, so the
    check is a blockwise comparison with the next pointer; only an index out of order is sorted
    (8 bytes per sequence, bounded by the ``.idx`` that stores 12).
    """
    n = len(lengths)
    ordered = all(not (np.diff(pointers[lo : lo + _BLOCK + 1]) < 0).any() for lo in range(0, n, _BLOCK))
    order = None if ordered else np.argsort(pointers, kind="stable")
    reach, reach_seq = -1, -1  # the furthest end of any sequence so far (in pointer order), and whose
    for lo in range(0, n, _BLOCK):
        at = np.arange(lo, min(n, lo + _BLOCK)) if order is None else order[lo : lo + _BLOCK]
        pt = pointers[at]
        ln = lengths[at].astype(np.int64)
        ends = pt + ln * itemsize
        before = np.maximum.accumulate(np.concatenate([[reach], ends[:-1]]))  # furthest end before each
        bad = (ln > 0) & (before > pt)  # an empty sequence holds no token: it overlaps nothing
        if bad.any():
            j = int(np.argmax(bad))
            prior = np.concatenate([[reach], ends[:j]])
            k = int(np.argmax(prior))
            a = reach_seq if k == 0 else int(at[k - 1])
            raise DataError(f"{idx}: sequences {a} and {int(at[j])} overlap in {bin_name} (the first ends at byte "
                            f"{int(prior[k])}, the second starts at {int(pt[j])}); every token must belong to one "
                            "sequence: regenerate the index")
        k = int(np.argmax(ends))
        if ends[k] > reach:
            reach, reach_seq = int(ends[k]), int(at[k])


def read_flat(path: str | os.PathLike, dtype_name: str = "uint16") -> TokenDataset:
    """A flat ``.bin`` of tokens, cut into pseudo-documents of :data:`FLAT_DOC_TOKENS` tokens."""
    path = Path(path)
    if dtype_name not in FLAT_DTYPES:
        raise DataError(f"--data-dtype {dtype_name!r}: use one of {sorted(FLAT_DTYPES)}")
    dtype = FLAT_DTYPES[dtype_name]
    size, itemsize = _regular_size(path), np.dtype(dtype).itemsize
    if size % itemsize:
        raise DataError(f"{path}: {size} bytes is not a whole number of {dtype_name} tokens; check --data-dtype")
    n = size // itemsize
    if n == 0:
        raise DataError(f"{path}: no tokens; the file is empty")
    starts = np.arange(0, n, FLAT_DOC_TOKENS, dtype=np.int64)
    lengths = np.minimum(FLAT_DOC_TOKENS, n - starts).astype(np.int32)
    docs = np.arange(len(starts) + 1, dtype=np.int64)
    return TokenDataset(path.name, TokenFile(path, dtype, n), starts, lengths, docs)


def open_dataset(path: str | os.PathLike, flat_dtype: str = "uint16") -> TokenDataset:
    """``PREFIX`` (with ``PREFIX.idx``) is an indexed dataset; a ``.bin`` without an ``.idx`` is flat."""
    p = str(path)
    if p.endswith(".idx") or (p.endswith(".bin") and os.path.exists(p[:-4] + ".idx")):
        return read_index(p[:-4])
    if os.path.exists(p + ".idx"):
        return read_index(p)
    if p.endswith(".bin") or os.path.isfile(p):
        return read_flat(p, flat_dtype)
    raise DataError(f"{p}: neither {p}.idx/{p}.bin (an indexed dataset) nor a flat .bin file; check --data-path")
