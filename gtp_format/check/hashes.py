"""``verify --data``'s chunk hashes: match the records to the chunks, and check each chunk's digest.

The data pass (:mod:`gtp_format.check.data`) calls in here from its workers: a chunk inside one
read window is hashed there, from the window it already holds (no second read); a chunk larger
than a window is fed piece by piece, in file order, on the main thread (:class:`StreamedHash`:
xxh3 is faster than the read, ``benchmarks/bench_chunk_hash.py``); a chunk read on its own is
hashed from the bytes read. A mismatch is one ``error`` naming key, chunk, file and byte range.

Which record is a chunk's: the one with its key and global offsets, and only if it names the
same file and byte range as the metadata. A record that names other bytes is itself reported
(the metadata or the records were altered), and the chunk is checked by its file checksum alone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gtp_format.errors import ChunkError
from gtp_format.hashing import BLOCK
from gtp_format.integrity.hash import chunk_digest, chunk_hasher
from gtp_format.integrity.records import ChunkRecord, Records
from gtp_format.model import Checkpoint, Chunk, Entry, Problem
from gtp_format.names import CHUNK_RECORDS_FILE
from gtp_format.reader.storage import open_regular, pread, source_of

MAX_LISTED = 3  # chunks without a record named one by one; the rest are counted


def match_records(ckpt: Checkpoint, records: Records) -> tuple[dict[tuple[str, int], ChunkRecord], list[Problem]]:
    """``(key, chunk index) -> record`` for every chunk whose record names its bytes, and what did not match."""
    out: dict[tuple[str, int], ChunkRecord] = {}
    problems = list(records.problems)
    missing: list[str] = []
    used: set[tuple[str, tuple[int, ...]]] = set()
    for e in ckpt.entries.values():
        for c in e.chunks:
            rec = records.get(e.key, c.offsets)
            if rec is None:
                missing.append(f"{e.key} chunk {c.index}")
                continue
            used.add((rec.key, rec.offsets))
            s = c.storage
            if s is None or (s.file, s.offset, s.length) != (rec.file, rec.offset, rec.length):
                where = "no storage" if s is None else f"{s.file} bytes [{s.offset}, {s.offset + s.length})"
                problems.append(Problem("error", "chunk_hash", f"{e.key} chunk {c.index}: the chunk record names "
                                        f"{rec.where()} but the metadata says {where}; one of them was altered",
                                        key=e.key, chunk=c.index, file=rec.file))
                continue
            out[(e.key, c.index)] = rec
    if missing:
        more = f" and {len(missing) - MAX_LISTED} more" if len(missing) > MAX_LISTED else ""
        problems.append(Problem("error", "chunk_hash", f"{len(missing)} chunk(s) have no record in "
                                f"{CHUNK_RECORDS_FILE} ({', '.join(missing[:MAX_LISTED])}{more}): the records are "
                                "incomplete or the metadata gained chunks", file=CHUNK_RECORDS_FILE))
    stale = len(records.by_chunk) - len(used)
    if stale:
        problems.append(Problem("warning", "chunk_hash", f"{stale} record(s) in {CHUNK_RECORDS_FILE} name chunks the "
                                "metadata does not have", file=CHUNK_RECORDS_FILE))
    return out, problems


def mismatch(entry: Entry, chunk: Chunk, rec: ChunkRecord, got: str) -> Problem:
    return Problem("error", "chunk_hash", f"{entry.key} chunk {chunk.index}: {rec.where()} hash to {got} but the "
                   f"chunk record says {rec.digest}: the chunk's bytes are damaged; restore {rec.file} from a good "
                   "copy", key=entry.key, chunk=chunk.index, file=rec.file)


def check_bytes(entry: Entry, chunk: Chunk, rec: ChunkRecord, data: Any, problems: list[Problem]) -> None:
    """Compare the digest of a chunk's bytes held whole against its record."""
    got = chunk_digest(data)
    if got != rec.digest:
        problems.append(mismatch(entry, chunk, rec, got))


def check_range(ckpt: Checkpoint, entry: Entry, chunk: Chunk, rec: ChunkRecord, problems: list[Problem]) -> None:
    """Read the record's byte range on its own, in blocks (bounded memory), and compare its digest."""
    h = chunk_hasher()
    try:
        with open_regular(ckpt.store, rec.file) as f:
            fd = source_of(f)
            for pos in range(rec.offset, rec.offset + rec.length, BLOCK):
                want = min(BLOCK, rec.offset + rec.length - pos)
                piece = pread(fd, want, pos)
                if len(piece) != want:
                    raise ChunkError(f"data file {rec.file} ends inside {rec.where()}", file=rec.file)
                h.update(piece)
    except ChunkError as err:
        problems.append(Problem("error", "chunk_hash", f"{entry.key} chunk {chunk.index}: {err.message}",
                                key=entry.key, chunk=chunk.index, file=rec.file))
        return
    if h.hexdigest() != rec.digest:
        problems.append(mismatch(entry, chunk, rec, h.hexdigest()))


class StreamedHash:
    """The digest of a chunk larger than a window, fed its pieces in file order."""

    def __init__(self, entry: Entry, chunk: Chunk, rec: ChunkRecord) -> None:
        self.entry, self.chunk, self.rec = entry, chunk, rec
        self.hasher = chunk_hasher()
        self.left = rec.length

    def add(self, piece: memoryview, problems: list[Problem]) -> None:
        self.hasher.update(piece)
        self.left -= len(piece)
        if self.left == 0 and self.hasher.hexdigest() != self.rec.digest:
            problems.append(mismatch(self.entry, self.chunk, self.rec, self.hasher.hexdigest()))


def hashed(action: Callable[[memoryview, Any], None], streamed: StreamedHash) -> Callable[[memoryview, Any], None]:
    """A data-pass step's action (window bytes, the step's findings) that also hands its piece to a large
    chunk's :class:`StreamedHash`; the main thread feeds the pieces in file order."""
    def both(view: memoryview, found: Any) -> None:
        found.hash_parts.append((streamed, view))
        action(view, found)

    return both


def covered_files(ckpt: Checkpoint, matched: dict[tuple[str, int], ChunkRecord]) -> set[str]:
    """Data files whose every byte lies in exactly one matched chunk record (a DCP ``.distcp`` file is
    a run of whole ``torch.save`` blobs, one per chunk).

    For those, the chunk hashes check every byte the file checksum would, with 128 bits instead of
    32, so ``verify --data`` does not compute the CRC-32C as well: one hash per byte read, not two,
    which is what keeps the pass at the rate it had with file checksums alone (docs/performance.md).
    """
    spans: dict[str, list[tuple[int, int]]] = {}
    for rec in matched.values():
        spans.setdefault(rec.file, []).append((rec.offset, rec.offset + rec.length))
    out = set()
    for rel, ranges in spans.items():
        pos = 0
        for a, b in sorted(ranges):
            if a != pos:
                break
            pos = b
        else:
            if pos == ckpt.data_files.get(rel, -1) and pos > 0:
                out.add(rel)
    return out
