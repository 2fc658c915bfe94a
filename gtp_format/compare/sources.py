"""The two things a comparison reads: a checkpoint folder, or tensors a process holds.

The engine sees both as a :class:`Source`: a mapping of key to :class:`gtp_format.model.Entry`
(kind, global shape, dtype, chunk boxes: metadata only, torch-free) plus ways to fetch values.
A checkpoint's entries come from its reader; a dict of tensors (a rank's snapshot of its own
state) becomes one entry per tensor with a single chunk covering it. So the checkpoint-to-
checkpoint comparison of ``diff`` / ``verify-roundtrip PATH`` and the in-memory comparison the
runtime's ranks run after a load are one engine, with one meaning of "equal".
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

from gtp_format.model import TENSOR, Checkpoint, Chunk, Entry

if TYPE_CHECKING:
    from gtp_format.integrity.records import Records


class Source(Protocol):
    """What :func:`gtp_format.compare.engine.compare` needs from one side."""

    name: str
    entries: Mapping[str, Entry]

    def chunk(self, entry: Entry, chunk: Chunk) -> Any:
        """One chunk's elements as a ``torch.Tensor`` of ``chunk.sizes``."""

    def whole(self, entry: Entry, max_bytes: int) -> Any:
        """The whole global tensor (refused over ``max_bytes``)."""

    def object_bytes(self, entry: Entry) -> bytes:
        """A byte object's stored bytes."""

    def load_object(self, entry: Entry) -> Any:
        """A byte object, decoded."""

    def digest(self, entry: Entry, chunk: Chunk) -> str | None:
        """The chunk's recorded content hash, or None when there is none to trust."""


class CheckpointSource:
    """A checkpoint folder, read through :mod:`gtp_format.reader` (bounded, confined reads).

    ``records``: its chunk records (:func:`gtp_format.integrity.records.read_records`); with them the
    engine skips chunk pairs whose hashes are equal. ``bytes_read`` counts the data bytes fetched.
    """

    def __init__(self, ckpt: Checkpoint, name: str | None = None, records: Records | None = None) -> None:
        self.ckpt = ckpt
        self.name = name or str(ckpt.root)
        self.entries: Mapping[str, Entry] = ckpt.entries
        self.records = records
        self.bytes_read = 0

    def chunk(self, entry: Entry, chunk: Chunk) -> Any:
        from gtp_format.reader.chunks import load_chunk

        self.bytes_read += chunk.storage.length if chunk.storage else 0
        return load_chunk(self.ckpt, entry, chunk)

    def whole(self, entry: Entry, max_bytes: int) -> Any:
        from gtp_format.reader.region import assemble

        rows = entry.shape[0] if entry.shape else 0
        self.bytes_read += entry.stored_bytes
        return assemble(self.ckpt, entry, 0, rows, max_bytes).tensor

    def object_bytes(self, entry: Entry) -> bytes:
        from gtp_format.reader.chunks import chunk_bytes

        self.bytes_read += entry.stored_bytes
        return bytes(chunk_bytes(self.ckpt, entry, entry.chunks[0]))

    def digest(self, entry: Entry, chunk: Chunk) -> str | None:
        """The record's hash, when it names exactly the bytes the metadata gives this chunk and a
        manifest checksums the records (without one, as in Megatron's layout, the side file vouches
        only for itself, and the chunk is read)."""
        if self.ckpt.manifest is None:
            return None
        rec = self.records.get(entry.key, chunk.offsets) if self.records is not None else None
        s = chunk.storage
        if rec is None or s is None or (rec.file, rec.offset, rec.length) != (s.file, s.offset, s.length):
            return None
        return rec.digest

    def file_checksums(self, name: str) -> tuple[int, dict[str, str]] | None:
        """The manifest's size and checksums of a data file, or None when it gives none."""
        files = self.ckpt.manifest.files if self.ckpt.manifest is not None else None
        entry = files.get(name) if files is not None else None
        return None if entry is None or not entry.checksums else (entry.size, dict(entry.checksums))

    def load_object(self, entry: Entry) -> Any:
        from gtp_format.reader.chunks import load_object

        return load_object(self.ckpt, entry)


def tensor_entry(key: str, tensor: Any) -> Entry:
    """The entry of one in-memory tensor: its shape and dtype, one chunk covering all of it."""
    from gtp_format.dtypes import from_torch

    shape = tuple(int(n) for n in tensor.shape)
    return Entry(key, TENSOR, shape, from_torch(tensor.dtype), (Chunk(0, (0,) * len(shape), shape, None),))


class TensorSource:
    """Tensors held in memory (a rank's snapshot), keyed by name."""

    def __init__(self, tensors: Mapping[str, Any], name: str = "tensors") -> None:
        self.name = name
        self.tensors = tensors
        self.entries: Mapping[str, Entry] = {k: tensor_entry(k, t) for k, t in tensors.items()}

    def chunk(self, entry: Entry, chunk: Chunk) -> Any:
        return self.tensors[entry.key]

    def whole(self, entry: Entry, max_bytes: int) -> Any:
        return self.tensors[entry.key]

    def object_bytes(self, entry: Entry) -> bytes:
        raise TypeError(f"{entry.key} is a tensor, not a byte object")

    def load_object(self, entry: Entry) -> Any:
        raise TypeError(f"{entry.key} is a tensor, not a byte object")

    def digest(self, entry: Entry, chunk: Chunk) -> str | None:
        return None  # tensors in memory carry no recorded hash
