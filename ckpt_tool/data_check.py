"""``verify --data``: read each data file once, front to back, and check everything from those bytes.

A checkpoint of hundreds of GB does not fit in the page cache, so what matters is touching every
byte once, in order, and keeping the CPU work off the disk's critical path:

* each data file is read sequentially into one of two reused window buffers (no per-chunk
  allocation, no page-fault churn, memory fixed at two windows);
* the file's manifest checksums (CRC-32, SHA-256) are updated from each window on a worker
  thread, in file order; ``zlib`` and ``hashlib`` release the GIL, so hashing one window overlaps
  reading and decoding the next;
* each chunk inside the window is decoded in place (:mod:`ckpt_tool.reader.blob`: the tensor is
  a view of the window, never a copy), checked against its declared dtype and shape, and scanned
  for NaN/Inf with one ``sum``: a sum is finite only if every element is, so the exact counts are
  taken only for chunks whose sum is not finite;
* a chunk larger than a window is parsed from its first and last bytes, then its elements are
  scanned window by window as they stream past.

Chunks that do not fit this pattern (bytes shared by two chunks, a view that is not its whole
storage in a chunk larger than a window) fall back to the random-access reader, so the results
are the same as decoding each chunk on its own; only the speed differs.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from ckpt_tool.errors import ChunkError
from ckpt_tool.hashing import HASHERS, Hasher
from ckpt_tool.model import BYTES, ENC_TORCH_SAVE, Checkpoint, Chunk, Entry, Problem
from ckpt_tool.reader.blob import BlobError, RangeReader, parse_blob
from ckpt_tool.reader.chunks import check_layout, checked_ref, decode_chunk, load_chunk
from ckpt_tool.reader.storage import open_regular, past_end_message

WINDOW = 32 << 20

Progress = Callable[[int], None]


@dataclass
class DataReport:
    problems: list[Problem] = field(default_factory=list)
    nonfinite: dict[str, dict[str, int]] = field(default_factory=dict)
    digests: dict[str, dict[str, str]] = field(default_factory=dict)  # file -> algorithm -> hex
    bytes_read: int = 0


@dataclass(frozen=True)
class _Item:
    entry: Entry
    chunk: Chunk
    start: int
    stop: int


def count_nonfinite(t: torch.Tensor) -> tuple[int, int]:
    """``(NaN count, Inf count)``; one summing pass when there are none, which is the usual case."""
    if not (t.is_floating_point() or t.is_complex()) or t.numel() == 0:
        return 0, 0
    try:
        total = t.sum(dtype=torch.float32) if t.dtype in (torch.float16, torch.bfloat16) else t.sum()
        if bool(torch.isfinite(total).all()):  # NaN and Inf propagate through every addition
            return 0, 0
        return int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
    except (RuntimeError, TypeError):  # dtypes without these kernels (float8): count in float32
        f = t.float()
        return int(torch.isnan(f).sum()), int(torch.isinf(f).sum())


class _Counts:
    def __init__(self, report: DataReport) -> None:
        self.report = report
        self.nan: dict[str, int] = defaultdict(int)
        self.inf: dict[str, int] = defaultdict(int)

    def add(self, key: str, t: torch.Tensor) -> None:
        nan, inf = count_nonfinite(t)
        self.nan[key] += nan
        self.inf[key] += inf

    def error(self, err: ChunkError, entry: Entry, chunk: Chunk) -> None:
        self.report.problems.append(Problem("error", "decode", err.message, key=entry.key, chunk=chunk.index,
                                            file=err.file))


def check_data(ckpt: Checkpoint, hash_files: dict[str, list[str]], progress: Progress | None = None) -> DataReport:
    """Decode every chunk, count NaN/Inf per key, and hash the listed files, in one read of each file.

    ``hash_files`` maps data files to the manifest's algorithms for them; the digests come back in
    :attr:`DataReport.digests` (files that could not be read are absent).
    """
    report = DataReport()
    counts = _Counts(report)
    tick = progress or (lambda n: None)
    by_file: dict[str, list[_Item]] = defaultdict(list)
    for e in ckpt.entries.values():
        for c in e.chunks:
            if e.kind == BYTES or ckpt.encoding != ENC_TORCH_SAVE:
                _random_access(ckpt, e, c, counts)  # byte objects and raw layouts: small or not torch.save
                tick(1)
                continue
            try:
                ref = checked_ref(ckpt, e, c)
            except ChunkError as err:
                counts.error(err, e, c)
                tick(1)
                continue
            by_file[ref.file].append(_Item(e, c, ref.offset, ref.offset + ref.length))
    buffers = [bytearray(WINDOW), bytearray(WINDOW)]
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-hash") as hasher_thread:
        for rel in sorted(by_file.keys() | hash_files.keys()):
            _FilePass(ckpt, rel, sorted(by_file.get(rel, []), key=lambda i: (i.start, i.stop)),
                      hash_files.get(rel, []), buffers, hasher_thread, counts, report, tick).run()
    for key in sorted(counts.nan.keys() | counts.inf.keys()):
        nan, inf = counts.nan[key], counts.inf[key]
        if nan or inf:
            report.nonfinite[key] = {"nan": nan, "inf": inf}
            report.problems.append(Problem("warning", "nonfinite", f"{nan} NaN and {inf} Inf values", key=key))
    return report


def _random_access(ckpt: Checkpoint, entry: Entry, chunk: Chunk, counts: _Counts) -> None:
    from ckpt_tool.reader.chunks import chunk_bytes

    try:
        if entry.kind == BYTES:
            chunk_bytes(ckpt, entry, chunk)
        else:
            counts.add(entry.key, load_chunk(ckpt, entry, chunk))
    except ChunkError as err:
        counts.error(err, entry, chunk)


class _FilePass:
    """One data file: windows in order, each hashed on the worker and its chunks decoded here."""

    def __init__(self, ckpt: Checkpoint, rel: str, items: list[_Item], algorithms: list[str],
                 buffers: list[bytearray], pool: ThreadPoolExecutor, counts: _Counts, report: DataReport,
                 tick: Progress) -> None:
        self.ckpt, self.rel, self.items, self.counts, self.report, self.tick = ckpt, rel, items, counts, report, tick
        self.hashers: dict[str, Hasher] = {a: HASHERS[a]() for a in algorithms}
        self.buffers, self.pool = buffers, pool
        self.pending: list[Future[None] | None] = [None, None]
        self.turn = 0

    def run(self) -> None:
        try:
            f = open_regular(self.ckpt.root, self.rel)
        except ChunkError as err:
            for it in self.items:
                self.counts.error(ChunkError(f"{it.entry.key} chunk {it.chunk.index}: {err.message}", file=self.rel),
                                  it.entry, it.chunk)
                self.tick(1)
            return
        with f:
            self.fd = f.fileno()
            self.size = os.fstat(self.fd).st_size
            try:
                self._stream()
            finally:
                self._drain()
        if self.hashers and self.ok:
            self.report.digests[self.rel] = {a: h.hexdigest() for a, h in self.hashers.items()}

    # -- reading and hashing ---------------------------------------------------------------------

    def _read(self, start: int, stop: int) -> memoryview:
        """Bytes ``[start, stop)`` (at most a window) into the next buffer; queue them for hashing."""
        slot = self.turn
        self.turn ^= 1
        if self.pending[slot] is not None:
            self.pending[slot].result()  # the worker is done with this buffer
        view = memoryview(self.buffers[slot])[: stop - start]
        got = os.preadv(self.fd, [view], start) if hasattr(os, "preadv") else self._pread_into(view, start)
        if got != stop - start:
            raise ChunkError(f"data file {self.rel} shrank while reading [{start}, {stop})", file=self.rel)
        self.report.bytes_read += got
        if self.hashers:
            self.pending[slot] = self.pool.submit(_update, list(self.hashers.values()), view)
        return view

    def _pread_into(self, view: memoryview, start: int) -> int:
        data = os.pread(self.fd, len(view), start)
        view[: len(data)] = data
        return len(data)

    def _drain(self) -> None:
        for i, fut in enumerate(self.pending):
            if fut is not None:
                fut.result()
                self.pending[i] = None

    # -- walking the file ------------------------------------------------------------------------

    def _stream(self) -> None:
        self.ok = True
        items = [it for it in self.items if self._in_file(it)]
        end = self.size if self.hashers else max((it.stop for it in items), default=0)
        pos, i, n = 0, 0, len(items)
        try:
            while i < n or pos < end:
                if i < n and items[i].start < pos:  # shares bytes with a chunk already read
                    self._fallback(items[i])
                    i += 1
                    continue
                if i < n and items[i].start == pos and items[i].stop - pos > WINDOW:
                    self._big(items[i])
                    pos = items[i].stop
                    i += 1
                    continue
                stop = min(end, pos + WINDOW)
                k = i
                while k < n and items[k].start < stop and items[k].stop <= stop:
                    k += 1
                if k < n and pos < items[k].start < stop:  # the window would cut items[k]: end before it
                    stop = items[k].start
                if stop <= pos:  # nothing left to read; only empty chunks remain
                    for it in items[i:]:
                        self._fallback(it)
                    break
                view = self._read(pos, stop)
                for it in items[i:k]:
                    if it.stop <= stop:
                        self._decode_in(view, pos, it)
                    else:
                        self._fallback(it)
                pos, i = stop, k
        except ChunkError as err:  # the file changed under us: report it, and do not trust its hash
            self.ok = False
            self.report.problems.append(Problem("error", "data_file", err.message, file=self.rel))
            for _ in items[i:]:
                self.tick(1)

    def _in_file(self, it: _Item) -> bool:
        if it.stop <= self.size:
            return True
        self.counts.error(ChunkError(f"{it.entry.key} chunk {it.chunk.index}: "
                                     f"{past_end_message(self.rel, it.start, it.stop - it.start, self.size)}",
                                     file=self.rel), it.entry, it.chunk)
        self.tick(1)
        return False

    def _decode_in(self, window: memoryview, window_start: int, it: _Item) -> None:
        try:
            t = decode_chunk(self.ckpt, it.entry, it.chunk, window[it.start - window_start: it.stop - window_start])
            self.counts.add(it.entry.key, t)
            del t
        except ChunkError as err:
            self.counts.error(err, it.entry, it.chunk)
        self.tick(1)

    def _fallback(self, it: _Item) -> None:
        _random_access(self.ckpt, it.entry, it.chunk, self.counts)
        self.tick(1)

    def _big(self, it: _Item) -> None:
        """A chunk larger than a window: structure from its ends, elements window by window."""
        layout = None
        try:
            layout = parse_blob(RangeReader(self.fd, it.start, it.stop - it.start), it.stop - it.start)
            check_layout(layout, it.entry, it.chunk)
        except BlobError as e:
            self.counts.error(ChunkError(f"{it.entry.key} chunk {it.chunk.index} in {self.rel} does not decode as a "
                                         f"torch.save blob of the declared tensor: {e}", file=self.rel),
                              it.entry, it.chunk)
            layout = None
        if layout is not None and not layout.contiguous_whole:
            self._fallback(it)  # a view into a larger storage: decode it whole, then just hash below
            layout = None
        else:
            self.tick(1)
        lo_payload = it.start + (layout.payload_offset if layout else 0)
        hi_payload = lo_payload + (layout.payload_bytes if layout else 0)
        cuts = sorted({it.start, it.stop, lo_payload, hi_payload, *range(lo_payload, hi_payload, WINDOW)})
        for a, b in zip(cuts, cuts[1:]):
            for lo in range(a, b, WINDOW):
                hi = min(b, lo + WINDOW)
                view = self._read(lo, hi)
                if layout is not None and lo_payload <= lo and hi <= hi_payload:
                    self.counts.add(it.entry.key, torch.frombuffer(view, dtype=layout.dtype))


def _update(hashers: list[Hasher], view: memoryview) -> None:
    for h in hashers:
        h.update(view)
