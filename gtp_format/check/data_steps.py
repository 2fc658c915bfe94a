"""What one step of the data pass does to its bytes, and what it found.

:mod:`gtp_format.check.data` plans the pass (which windows of which file, on which worker, in what
order) and merges the results; this module holds the other half, the work on one window's bytes:
decode and count a whole chunk (:func:`window_action`), read a chunk on its own when it crosses a
window (:func:`random_access`), scan a large payload piece by piece (:func:`payload_action`), and
the :class:`Found` each worker fills and the main thread merges in file order.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from gtp_format.check.hashes import StreamedHash, check_bytes, check_range
from gtp_format.check.padding import tally_key
from gtp_format.dtypes import DType
from gtp_format.errors import ChunkError
from gtp_format.hashing import CRCS, crc32
from gtp_format.integrity.records import ChunkRecord
from gtp_format.model import BYTES, Checkpoint, Chunk, Entry, Problem
from gtp_format.reader.chunks import check_byte_object, chunk_bytes, decode_elements, load_elements
from gtp_format.scan import carrier, count_nonfinite


@dataclass(frozen=True)
class Item:
    entry: Entry
    chunk: Chunk
    start: int
    stop: int
    record: ChunkRecord | None = None  # its chunk hash, when the checkpoint has records


class Found:
    """What one step found: NaN/Inf counts, problems, and the window's bytes and CRC.

    Workers fill their own; the main thread merges them in file order, so nothing is shared.
    """

    def __init__(self) -> None:
        self.nan: dict[str, int] = defaultdict(int)
        self.inf: dict[str, int] = defaultdict(int)
        self.problems: list[Problem] = []
        self.nbytes = 0
        self.crc = 0
        self.data: bytes | memoryview = b""  # kept only for order-dependent digests
        self.buffer: bytearray | None = None  # the read buffer the views above lie in, given back after the merge
        self.payload_parts: list[tuple[PayloadCrc, int, int]] = []  # (chunk, CRC-32 of a piece, its length)
        self.hash_parts: list[tuple[StreamedHash, memoryview]] = []  # pieces of large chunks, for their hashes

    def add(self, key: str, elements: np.ndarray, dtype: DType) -> None:
        nan, inf = count_nonfinite(elements, dtype)
        if nan:
            self.nan[key] += nan
        if inf:
            self.inf[key] += inf

    def error(self, err: ChunkError, entry: Entry, chunk: Chunk) -> None:
        self.problems.append(Problem("error", "decode", err.message, key=entry.key, chunk=chunk.index, file=err.file))

    def merge(self, other: Found) -> None:
        for key, n in other.nan.items():
            self.nan[key] += n
        for key, n in other.inf.items():
            self.inf[key] += n
        self.problems += other.problems


def random_access(ckpt: Checkpoint, entry: Entry, chunk: Chunk, found: Found, rec: ChunkRecord | None) -> None:
    try:
        if entry.kind == BYTES:
            check_byte_object(ckpt, entry, chunk)
            if rec is not None:
                check_range(ckpt, entry, chunk, rec, found.problems)
        elif rec is not None:  # one read for both: hash the bytes, then decode them
            buf = chunk_bytes(ckpt, entry, chunk)
            check_bytes(entry, chunk, rec, buf, found.problems)
            found.add(tally_key(ckpt, entry, chunk), decode_elements(ckpt, entry, chunk, buf), entry.dtype)
        else:
            found.add(tally_key(ckpt, entry, chunk), load_elements(ckpt, entry, chunk), entry.dtype)
    except ChunkError as err:
        found.error(err, entry, chunk)


Action = Callable[[memoryview, Found], None]


def window_action(ckpt: Checkpoint, start: int, stop: int, items: list[Item], record_crc: bool) -> Action:
    def action(window: memoryview, found: Found) -> None:
        for it in items:
            if it.stop > stop:  # overlaps the next window's chunk: decode it on its own
                random_access(ckpt, it.entry, it.chunk, found, it.record)
            else:
                try:
                    own = window[it.start - start: it.stop - start]
                    if it.record is not None:
                        check_bytes(it.entry, it.chunk, it.record, own, found.problems)
                    elements = decode_elements(ckpt, it.entry, it.chunk, own, record_crc)
                    found.add(tally_key(ckpt, it.entry, it.chunk), elements, it.entry.dtype)
                    del elements
                except ChunkError as err:
                    found.error(err, it.entry, it.chunk)

    return action


def fallback_action(ckpt: Checkpoint, items: list[Item]) -> Action:
    def action(_: memoryview, found: Found) -> None:
        for it in items:
            random_access(ckpt, it.entry, it.chunk, found, it.record)

    return action


class PayloadCrc:
    """The CRC-32 of one large chunk's payload, joined piece by piece in file order (main thread)."""

    def __init__(self, expected: int, entry: Entry, chunk: Chunk, nbytes: int) -> None:
        self.expected, self.entry, self.chunk, self.left = expected, entry, chunk, nbytes
        self.value = 0

    def add(self, crc: int, nbytes: int, found: Found) -> None:
        self.value = CRCS["crc32"].combine(self.value, crc, nbytes)
        self.left -= nbytes
        if self.left == 0 and self.value != self.expected:
            found.problems.append(Problem(
                "error", "decode", f"{self.entry.key} chunk {self.chunk.index}: the storage record fails its CRC-32 "
                f"check (the zip directory says {self.expected:08x}): its bytes are damaged", key=self.entry.key,
                chunk=self.chunk.index, file=self.chunk.storage.file if self.chunk.storage else None))


class PayloadAction:
    """One window of a large chunk's payload: its piece of the zip CRC-32, and the NaN/Inf scan.

    ``pieces``: the action may be called on consecutive pieces of its window in file order, each holding
    whole elements, with the same :class:`Found` (:meth:`gtp_format.check.data._FilePass.work` reads a warm
    window that way, each piece checked while it is still in the core's cache); the CRC-32 then continues
    from the previous piece's, so the window still gives one part to join.
    """

    pieces = True

    def __init__(self, key: str, dtype: DType, scan: bool, acc: PayloadCrc | None) -> None:
        self.key, self.dtype, self.scan, self.acc, self.kind = key, dtype, scan, acc, carrier(dtype)

    def __call__(self, view: memoryview, found: Found) -> None:  # windows of a payload hold whole elements
        acc = self.acc
        if acc is not None:
            parts = found.payload_parts
            if parts and parts[-1][0] is acc:  # the window's previous piece: continue its CRC
                _, crc, n = parts[-1]
                parts[-1] = (acc, crc32(view, crc), n + len(view))
            else:
                parts.append((acc, crc32(view), len(view)))
        if self.scan:
            found.add(self.key, np.frombuffer(view, dtype=self.kind), self.dtype)


def payload_action(key: str, dtype: DType, scan: bool, acc: PayloadCrc | None) -> Action:
    return PayloadAction(key, dtype, scan, acc)


class _Ignore:
    """Bytes that only the file's own digest reads (a large chunk's zip header and tail); in any pieces."""

    pieces = True

    def __call__(self, _: memoryview, __: Found) -> None:
        pass


ignore_bytes: Action = _Ignore()
