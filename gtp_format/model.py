"""The checkpoint model every command works on, whatever the on-disk layout.

Both readers (DCP ``.metadata`` pickles and DCP's safetensors layout) produce this model, so the
checks in :mod:`gtp_format.check.verify` and the commands never look at a layout again. It holds
metadata only: building it never opens a data file, which is what lets ``inspect`` promise not to
touch ``.distcp`` files.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from itertools import repeat
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from gtp_format.dtypes import DType

if TYPE_CHECKING:
    from gtp_format.manifest import Manifest

TENSOR = "tensor"
BYTES = "bytes"

# How a chunk's stored bytes decode: a complete torch.save blob (DCP's default) or raw
# little-endian elements in row-major order (safetensors).
ENC_TORCH_SAVE = "torch_save"
ENC_RAW = "raw"


class StorageRef(NamedTuple):
    """Where one chunk's bytes are, exactly as the metadata recorded it (not yet validated).

    Named tuples rather than dataclasses: a large checkpoint has millions of chunks, and a tuple is
    built several times faster (this is most of ``inspect``'s time after the unpickle).
    """

    file: str
    offset: int
    length: int
    transforms: tuple[str, ...] = ()


class Chunk(NamedTuple):
    """One stored box of a tensor (or the single blob of a byte object: empty offsets/sizes)."""

    index: int
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    storage: StorageRef | None

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


class ChunkTable(NamedTuple):
    """The chunks of a DCP ``.metadata`` as columns, one row per chunk (built by
    :mod:`gtp_format.reader.dcp_columns`); :class:`ChunkColumns` is one key's rows of it.

    Why columns: a million :class:`Chunk` tuples, their offsets, sizes and storage references were
    most of ``inspect``'s memory (the records and the model: 1.3 GB at 1M chunks, measured on the 2-core
    machine). Here they are a few numpy arrays of ints and one tuple of file names.
    """

    dims: Any  # int64: every offsets and sizes tuple, back to back
    offsets: Any  # int64 [rows, 2]: start in dims, length
    sizes: Any  # int64 [rows, 2]: start in dims, length
    file: Any  # int64: index in files, -1 where the chunk has no storage entry
    start: Any  # int64: byte offset in its file
    length: Any  # int64: bytes
    numel: Any  # int64: product of sizes
    files: tuple[str, ...]


def _dim_tuples(dims: Any, spans: Any) -> list[tuple[int, ...]]:
    """The tuples of ``dims`` at ``spans`` (rows of start, length): one gather when all have one length."""
    if not len(spans):
        return []
    n = spans[:, 1]
    width = int(n[0])
    if bool((n == width).all()):
        index = spans[:, :1] + np.arange(width)
        return list(map(tuple, dims[index].tolist()))
    return [tuple(dims[s:s + k].tolist()) for s, k in spans.tolist()]


class ChunkColumns(Sequence[Chunk]):
    """One key's chunks, rows ``first .. first + count`` of a :class:`ChunkTable`: a tuple of :class:`Chunk`
    to every reader (length, index, iteration, slices, equality with tuples), built as they are read."""

    __slots__ = ("table", "first", "count")

    def __init__(self, table: ChunkTable, first: int, count: int) -> None:
        self.table, self.first, self.count = table, first, count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return tuple(self)[i]
        if i < 0:
            i += self.count
        if not 0 <= i < self.count:
            raise IndexError("chunk index out of range")
        return self._rows(i, i + 1)[0]

    def __iter__(self) -> Iterator[Chunk]:
        return iter(self._rows(0, self.count))

    def _rows(self, lo: int, hi: int) -> list[Chunk]:
        a, b = self.first + max(lo, 0), self.first + min(hi, self.count)
        if a >= b:
            return []
        t = self.table
        offsets, sizes = _dim_tuples(t.dims, t.offsets[a:b]), _dim_tuples(t.dims, t.sizes[a:b])
        files, f = t.files, t.file[a:b].tolist()
        if min(f) >= 0:
            refs: Any = map(tuple.__new__, repeat(StorageRef), zip(map(files.__getitem__, f), t.start[a:b].tolist(),
                                                                  t.length[a:b].tolist(), repeat(())))
        else:
            refs = [StorageRef(files[i], s, n) if i >= 0 else None
                    for i, s, n in zip(f, t.start[a:b].tolist(), t.length[a:b].tolist())]
        return list(map(tuple.__new__, repeat(Chunk), zip(range(lo, lo + b - a), offsets, sizes, refs)))

    def boxes(self) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        """``(offsets, sizes)`` of each chunk, without the chunks."""
        t, a, b = self.table, self.first, self.first + self.count
        return list(zip(_dim_tuples(t.dims, t.offsets[a:b]), _dim_tuples(t.dims, t.sizes[a:b])))

    def stored_bytes(self) -> int:
        t, a, b = self.table, self.first, self.first + self.count
        return sum(t.length[a:b][t.file[a:b] >= 0].tolist())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (tuple, ChunkColumns)):
            return tuple(self) == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return repr(tuple(self))

    def __reduce__(self) -> tuple[Any, ...]:
        return tuple, (tuple(self),)  # a copy elsewhere is the plain tuple, not the whole table

    def __deepcopy__(self, memo: dict[int, Any]) -> tuple[Chunk, ...]:
        return tuple(self)


@dataclass(frozen=True)
class Entry:
    """One key of the checkpoint."""

    key: str
    kind: str  # TENSOR or BYTES
    shape: tuple[int, ...] | None
    dtype: DType | None  # a torch-free description; .torch gives the torch.dtype
    chunks: tuple[Chunk, ...]  # or ChunkColumns (a large DCP .metadata): the same to every reader

    @property
    def numel(self) -> int:
        return math.prod(self.shape) if self.shape is not None else 0

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize if self.dtype is not None else 1

    @property
    def stored_bytes(self) -> int:
        if isinstance(self.chunks, ChunkColumns):
            return self.chunks.stored_bytes()
        return sum(c.storage.length for c in self.chunks if c.storage is not None)


def is_optimizer_key(key: str) -> bool:
    """An optimizer state key: ``optimizer.*``, or megatron-core's chained ``chained_<i>.optimizer.*``."""
    head, _, rest = key.partition(".")
    return head == "optimizer" or (head.startswith("chained_") and rest.startswith("optimizer."))


@dataclass(frozen=True)
class Problem:
    """One finding. ``check`` is a stable short code that scripts can match on."""

    severity: str  # "error" fails verify; "warning" and "info" do not
    check: str
    message: str
    key: str | None = None
    chunk: int | None = None
    file: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


MAX_PROBLEMS_PER_CHECK = 100  # a crafted file can fail once per entry: a million entries were 2.3 GB of problems


@dataclass
class ProblemCap:
    """Problems of one check from untrusted input, kept up to :data:`MAX_PROBLEMS_PER_CHECK`; the rest
    are counted, and :meth:`done` ends the list with one line saying how many more there were."""

    check: str
    limit: int = MAX_PROBLEMS_PER_CHECK
    kept: list[Problem] = field(default_factory=list)
    more: int = 0

    def add(self, problem: Problem) -> None:
        if len(self.kept) < self.limit:
            self.kept.append(problem)
        else:
            self.more += 1

    def done(self, file: str | None = None) -> list[Problem]:
        if not self.more:
            return self.kept
        worst = "error" if any(p.severity == "error" for p in self.kept) else self.kept[-1].severity
        return [*self.kept, Problem(worst, self.check, f"... and {self.more:,} more {self.check} problems like "
                                    "these (not listed)", file=file)]


@dataclass
class Checkpoint:
    """A checkpoint folder, read as metadata only."""

    root: Path
    layout: str  # one of gtp_format.names.LAYOUTS
    backend: str  # human description: "megatron torch_dist", "dcp", "dcp safetensors"
    encoding: str  # ENC_TORCH_SAVE or ENC_RAW
    entries: dict[str, Entry]
    data_files: dict[str, int]  # data files present in the folder -> size (from stat)
    metadata_file: str | None = None
    dcp_version: str | None = None
    megatron_metadata: dict[str, Any] | None = None
    manifest: Manifest | None = None  # parsed leniently; see gtp_format.reader.locate.load_side_files
    iteration: int | None = None
    notes: list[Problem] = field(default_factory=list)
    # The allow-listed records the model was built from (a MetadataRecord for torch_dist), kept only
    # when asked (open_checkpoint(..., keep_raw_metadata=True)): a tool that rewrites .metadata
    # (migrate-aliased) starts from them instead of unpickling the file a second time. Not kept by
    # default: the records outweigh the model, and inspect/verify hold the model for their whole run.
    raw_metadata: Any = field(default=None, repr=False, compare=False)
    # (key, chunk index) of chunks that hold only alignment padding (megatron-core's torch.empty
    # gaps, gtp_format.megatron.padding.padding_chunks): verify --data counts their NaN/Inf apart.
    padding_chunks: frozenset[tuple[str, int]] = field(default=frozenset(), repr=False, compare=False)
    # the storage its files are read through (gtp_format.storage.base.Storage), chosen once by the session
    # that opened it (open_checkpoint(..., session=)): its reads obey that command's one set of limits
    storage: Any = field(default=None, repr=False, compare=False)

    @property
    def store(self) -> Any:
        """Where the readers reach its files (a :data:`gtp_format.reader.storage.Root`): its session's storage,
        else its root (a storage of its own per request)."""
        return self.root if self.storage is None else self.storage

    def chunk_count(self) -> int:
        return sum(len(e.chunks) for e in self.entries.values())

    def model_elements(self) -> int:
        """The elements of the model's tensor keys (optimizer states left out): what a target
        topology is bounded by (:func:`gtp_format.layout.config.target_world_problem`)."""
        return sum(e.numel for k, e in self.entries.items() if e.kind == TENSOR and not is_optimizer_key(k))
