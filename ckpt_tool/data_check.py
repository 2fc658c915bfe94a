"""``verify --data``: read each data file once, front to back, and check everything from those bytes.

A checkpoint of hundreds of GB does not fit in the page cache, so what matters is touching every
byte once, in order, and keeping the CPU work off the disk's critical path:

* each data file is read sequentially, two windows ahead on a reader thread, into five reused
  window buffers (no per-chunk allocation, no page-fault churn, memory fixed at five windows),
  so the disk is busy while the CPU decodes;
* the file's manifest checksums are computed from the same windows on worker threads (``zlib``
  and ``hashlib`` release the GIL): a CRC-32 of each window on its own, two windows at a time,
  joined in file order with :func:`~ckpt_tool.hashing.crc32_combine`; other digests (SHA-256)
  one window after the other;
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
import zlib
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from ckpt_tool.errors import ChunkError
from ckpt_tool.hashing import HASHERS, Hasher, crc32_combine
from ckpt_tool.model import BYTES, ENC_TORCH_SAVE, Checkpoint, Chunk, Entry, Problem
from ckpt_tool.reader.blob import BlobError, RangeReader, parse_blob
from ckpt_tool.reader.chunks import blob_error, check_layout, checked_ref, chunk_bytes, decode_chunk, load_chunk
from ckpt_tool.reader.storage import open_regular, past_end_message

WINDOW = 16 << 20
BUFFERS = 5  # one being decoded, two being hashed, two being read ahead
CRC_THREADS = 2

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
    buffers = [bytearray(WINDOW) for _ in range(BUFFERS)]
    with ThreadPoolExecutor(1, "ckpt-read") as reader, ThreadPoolExecutor(CRC_THREADS, "ckpt-hash") as hasher:
        for rel in sorted(by_file.keys() | hash_files.keys()):
            _FilePass(ckpt, rel, sorted(by_file.get(rel, []), key=lambda i: (i.start, i.stop)),
                      hash_files.get(rel, []), buffers, reader, hasher, counts, report, tick).run()
    for key in sorted(counts.nan.keys() | counts.inf.keys()):
        nan, inf = counts.nan[key], counts.inf[key]
        if nan or inf:
            report.nonfinite[key] = {"nan": nan, "inf": inf}
            report.problems.append(Problem("warning", "nonfinite", f"{nan} NaN and {inf} Inf values", key=key))
    return report


def _random_access(ckpt: Checkpoint, entry: Entry, chunk: Chunk, counts: _Counts) -> None:
    try:
        if entry.kind == BYTES:
            chunk_bytes(ckpt, entry, chunk)
        else:
            counts.add(entry.key, load_chunk(ckpt, entry, chunk))
    except ChunkError as err:
        counts.error(err, entry, chunk)


@dataclass(frozen=True)
class _Step:
    """Read ``[start, stop)`` of the file (nothing when equal), then run ``action`` on those bytes."""

    start: int
    stop: int
    action: Callable[[memoryview], None]


class _FilePass:
    """One data file: a plan of window reads, run with reads ahead on one thread and hashing on others.

    The plan depends on the metadata only, so reads can be issued ahead: while the main thread
    decodes window k, the reader fills windows k+1 and k+2 and the hashers digest k and k-1.
    Window k reuses buffer ``k % BUFFERS`` once the hashers are done with it.
    """

    def __init__(self, ckpt: Checkpoint, rel: str, items: list[_Item], algorithms: list[str],
                 buffers: list[bytearray], reader: ThreadPoolExecutor, hasher: ThreadPoolExecutor, counts: _Counts,
                 report: DataReport, tick: Progress) -> None:
        self.ckpt, self.rel, self.items, self.counts, self.report, self.tick = ckpt, rel, items, counts, report, tick
        self.hashers: dict[str, Hasher] = {a: HASHERS[a]() for a in algorithms}
        # CRC-32 alone: windows are hashed independently on several threads, then combined in order
        self.crc: int | None = 0 if algorithms == ["crc32"] else None
        self.buffers, self.reader, self.hasher = buffers, reader, hasher

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
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            steps = self._plan()
            try:
                self._execute(steps)
            except ChunkError as err:  # the file changed under us: report it, and do not trust its hash
                self.report.problems.append(Problem("error", "data_file", err.message, file=self.rel))
                return
        if self.crc is not None:
            self.report.digests[self.rel] = {"crc32": f"{self.crc:08x}"}
        elif self.hashers:
            self.report.digests[self.rel] = {a: h.hexdigest() for a, h in self.hashers.items()}

    # -- executing -------------------------------------------------------------------------------

    def _execute(self, steps: list[_Step]) -> None:
        reads: dict[int, Future[memoryview]] = {}
        hashes: dict[int, Future[Any]] = {}
        ahead = BUFFERS - 1 - CRC_THREADS  # reads in flight beyond the current window

        def release(k: int) -> None:
            """Wait until the hasher is done with window k's buffer; fold its CRC in (in order)."""
            value = hashes.pop(k).result()
            if self.crc is not None:
                self.crc = crc32_combine(self.crc, value, steps[k].stop - steps[k].start)

        def launch(k: int) -> None:
            if k - BUFFERS in hashes:
                release(k - BUFFERS)
            step = steps[k]
            buf = memoryview(self.buffers[k % BUFFERS])[: step.stop - step.start]
            reads[k] = self.reader.submit(self._pread, buf, step.start)

        try:
            for k in range(min(ahead, len(steps))):
                launch(k)
            for k, step in enumerate(steps):
                if k + ahead < len(steps):
                    launch(k + ahead)
                view = reads.pop(k).result()
                if self.hashers and len(view):
                    hashes[k] = (self.hasher.submit(zlib.crc32, view) if self.crc is not None
                                 else self.hasher.submit(self._update, view, hashes.get(k - 1)))
                step.action(view)
            for k in sorted(hashes):
                release(k)
        finally:
            for fut in [*reads.values(), *hashes.values()]:
                fut.exception()  # wait: no buffer may be in use when the next file starts

    def _update(self, view: memoryview, previous: Future[Any] | None) -> None:
        """Order-dependent digests (SHA-256): after the previous window's update, in file order."""
        if previous is not None:
            previous.result()
        for h in self.hashers.values():
            h.update(view)

    def _pread(self, view: memoryview, start: int) -> memoryview:
        got = 0
        while got < len(view):
            n = os.preadv(self.fd, [view[got:]], start + got)
            if n <= 0:
                raise ChunkError(f"data file {self.rel} shrank while reading [{start}, {start + len(view)})",
                                 file=self.rel)
            got += n
        self.report.bytes_read += got
        return view

    # -- planning --------------------------------------------------------------------------------

    def _plan(self) -> list[_Step]:
        items = [it for it in self.items if self._in_file(it)]
        end = self.size if self.hashers else max((it.stop for it in items), default=0)
        steps: list[_Step] = []
        pos, i, n = 0, 0, len(items)
        while i < n or pos < end:
            if i < n and items[i].start < pos:  # shares bytes with a chunk already planned
                steps.append(_Step(pos, pos, self._fallback_action([items[i]])))
                i += 1
                continue
            if i < n and items[i].start == pos and items[i].stop - pos > WINDOW:
                steps += self._big(items[i])
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
                steps.append(_Step(pos, pos, self._fallback_action(items[i:])))
                break
            steps.append(_Step(pos, stop, self._window_action(pos, stop, items[i:k])))
            pos, i = stop, k
        return steps

    def _in_file(self, it: _Item) -> bool:
        if it.stop <= self.size:
            return True
        self.counts.error(ChunkError(f"{it.entry.key} chunk {it.chunk.index}: "
                                     f"{past_end_message(self.rel, it.start, it.stop - it.start, self.size)}",
                                     file=self.rel), it.entry, it.chunk)
        self.tick(1)
        return False

    def _window_action(self, start: int, stop: int, items: list[_Item]) -> Callable[[memoryview], None]:
        def action(window: memoryview) -> None:
            for it in items:
                if it.stop > stop:  # overlaps the next window's chunk: decode it on its own
                    _random_access(self.ckpt, it.entry, it.chunk, self.counts)
                else:
                    try:
                        t = decode_chunk(self.ckpt, it.entry, it.chunk, window[it.start - start: it.stop - start])
                        self.counts.add(it.entry.key, t)
                        del t
                    except ChunkError as err:
                        self.counts.error(err, it.entry, it.chunk)
                self.tick(1)

        return action

    def _fallback_action(self, items: list[_Item]) -> Callable[[memoryview], None]:
        def action(_: memoryview) -> None:
            for it in items:
                _random_access(self.ckpt, it.entry, it.chunk, self.counts)
                self.tick(1)

        return action

    def _big(self, it: _Item) -> list[_Step]:
        """A chunk larger than a window: structure from its ends now, elements window by window later."""
        layout = None
        try:
            layout = parse_blob(RangeReader(self.fd, it.start, it.stop - it.start), it.stop - it.start)
            check_layout(layout, it.entry, it.chunk)
        except BlobError as e:
            self.counts.error(blob_error(it.entry, it.chunk, e), it.entry, it.chunk)
            layout = None
        steps = []
        if layout is not None and not layout.contiguous_whole:
            steps.append(_Step(it.start, it.start, self._fallback_action([it])))  # a view into a larger storage
            layout = None
        else:
            self.tick(1)
        lo_payload = it.start + (layout.payload_offset if layout else 0)
        hi_payload = lo_payload + (layout.payload_bytes if layout else 0)
        cuts = sorted({it.start, it.stop, lo_payload, hi_payload, *range(lo_payload, hi_payload, WINDOW)})
        for a, b in zip(cuts, cuts[1:]):
            for lo in range(a, b, WINDOW):
                hi = min(b, lo + WINDOW)
                scan = layout is not None and lo_payload <= lo and hi <= hi_payload
                steps.append(_Step(lo, hi, self._scan_action(it, layout.dtype) if scan else _ignore))
        return steps

    def _scan_action(self, it: _Item, dtype: torch.dtype) -> Callable[[memoryview], None]:
        def action(view: memoryview) -> None:
            self.counts.add(it.entry.key, torch.frombuffer(view, dtype=dtype))

        return action


def _ignore(_: memoryview) -> None:
    pass


