"""``verify --data``: read each data file once, front to back, and check everything from those bytes.

A checkpoint of hundreds of GB does not fit in the page cache, so what matters is touching every
byte once, in order, and spreading the CPU work over the cores without leaving the disk idle:

* each file is cut into windows of at most ``WINDOW`` bytes, aligned to chunk boundaries where
  chunks fit. 2 MiB is small enough that a window is still in the core's cache when it is hashed
  and scanned; measured here, reading into 16 MiB windows made the kernel's copy alone 3x slower;
* a pool of worker threads takes the windows in file order. Each worker reads its window
  (``os.pread``), hashes it on its own, decodes the chunks in it in place
  (:mod:`gtp_format.reader.blob`: the elements are a numpy view of the window, never a copy) and
  scans them for NaN/Inf (:mod:`gtp_format.scan`: one pass per chunk when there are none).
  ``os.pread``, the CRC and numpy's loops release the GIL, so the workers run in parallel. No
  torch: importing it would cost a short ``verify`` more than its whole pass;
* the main thread takes the results back in file order: it joins the windows' CRCs with
  :meth:`~gtp_format.hashing.Crc.combine` (CRC-32C or CRC-32), feeds order-dependent digests
  (SHA-256) window after window, and adds up counts and problems, so the report is the same
  whatever the number of workers;
* memory is bounded whatever the checkpoint: a window that nothing keeps after its step is freed
  there (each worker holds one at a time, about 3 MiB per worker with the scan's temporary: peak RSS
  59 MiB at 2 workers, 100 MiB at 16, 4 GB checkpoint), and at most ``HELD`` windows (64 MiB) wait
  for the in-order merge when a digest keeps them;
* a chunk larger than a window is parsed from its first and last bytes at planning time, then
  its elements are scanned window by window as they stream past; with up to
  :data:`gtp_format.check.data_read.PIECE_WORKERS` workers a warm window of its payload is read, CRC'd and
  scanned in 512 KiB pieces of one buffer (:meth:`_FilePass._pieces`), each still in the core's cache when
  checked; with more, in whole windows (each piece's calls hand the GIL over: the workers wait on each other);
* from a bucket a window is one ranged request (:data:`gtp_format.storage.objects.PART`, 8 MiB), so
  a chunk up to that size is parsed from the bytes its window already holds: with 2 MiB windows every
  larger chunk cost two more requests for its structure (190 of the 226 ``GET`` s of a 304.8 MB
  checkpoint, benchmarks/bench_s3_ckpt.py), each a round trip, and on moto a copy of the whole object.
  A chunk of up to two requests is one window of its own there, for the same reason (96 chunks of
  8 MiB + 1.5 KiB in a 1.2 GB checkpoint made 192 of its 330 ``GET`` s); windows in flight then hold
  up to twice the 64 MiB.

Chunks that do not fit this pattern (bytes shared by two chunks, a view that is not its whole
storage in a chunk larger than a window) fall back to the random-access reader, so the results
are the same as decoding each chunk on its own; only the speed differs.
"""

from __future__ import annotations

import functools
import os
from collections import defaultdict, deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from gtp_format import ranks
from gtp_format.check.data_read import (
    HEAD,
    Buffers,
    Span,
    Spans,
    WindowReads,
    direct_reads,
    piece_bytes,
    span_bytes,
    span_depth,
)
from gtp_format.check.data_steps import (
    Action,
    Found,
    Item,
    PayloadCrc,
    fallback_action,
    ignore_bytes,
    payload_action,
    random_access,
    window_action,
)
from gtp_format.check.hashes import StreamedHash, hashed
from gtp_format.check.padding import split_padding, tally_key
from gtp_format.errors import ChunkError
from gtp_format.hashing import CRCS, HASHERS, Crc, Hasher
from gtp_format.integrity.records import ChunkRecord
from gtp_format.model import BYTES, ENC_TORCH_SAVE, Checkpoint, Chunk, Entry, Problem
from gtp_format.progress import Progress
from gtp_format.reader.blob import parse_blob
from gtp_format.reader.chunks import (
    blob_error,
    check_layout,
    checked_ref,
)
from gtp_format.reader.storage import open_regular, past_end_message
from gtp_format.reader.storage import streamed as streamed_file
from gtp_format.reader.zip_blob import BlobError, RangeReader
from gtp_format.scan import can_hold_nonfinite
from gtp_format.storage.base import storage_for
from gtp_format.storage.objects import PART, ObjectFile
from gtp_format.storage.prefetch import ObjectStream

WINDOW = 2 << 20
MAX_WORKERS = 16  # a bucket's: each worker waits on its requests' round trips
# A local file's: past this the workers wait on each other, not on the cores. Lent 16-core H100 host, 12.9 GB
# dcp.save file warm, whole windows, one call, 2 rounds: 4 workers 1.37-1.48 s, 6 1.21-1.30, 8 1.09-1.12, 12
# 1.37-1.49, 16 1.32-1.43 (cat 1.56-1.59), the CPU seconds the same (6.0-6.8) at every count; cold, 8 and 16
# workers 7.13-7.41 and 6.92-7.48 s (cat 7.42-7.61).
MAX_LOCAL_WORKERS = 8
IN_FLIGHT = 4  # windows kept until their merge, per worker: enough that one slow window stalls nobody
HELD = 32  # at most this many such windows in all (64 MiB), whatever the worker count
BATCH = 4  # windows a worker takes at once when it keeps none of them (8 MiB), without spans
END_BYTES = 8 << 10  # what planning reads of each end of a chunk larger than a window (RangeReader: 4 KiB)



def default_workers(remote: bool = True) -> int:
    """One worker per core this process may run on, at most ``MAX_WORKERS`` for a bucket and
    ``MAX_LOCAL_WORKERS`` for local files (``remote`` False). The cores of its affinity, not of the machine:
    under ``taskset -c 0,1`` on a 16-core host, 16 workers would take turns on 2 cores, each turn a hand-over
    of the GIL."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(MAX_WORKERS if remote else MAX_LOCAL_WORKERS, cores))


@dataclass
class DataReport:
    problems: list[Problem] = field(default_factory=list)
    nonfinite: dict[str, dict[str, int]] = field(default_factory=dict)
    digests: dict[str, dict[str, str]] = field(default_factory=dict)  # file -> algorithm -> hex
    bytes_read: int = 0


def data_bytes(ckpt: Checkpoint) -> int:
    """The total of ``verify --data``'s progress: the bytes of the checkpoint's data files (what it stores).

    The pass advances by the bytes it reads, and at its end by whatever of this total it did not read
    (a file nothing checksums is read up to its last chunk; a chunk of another encoding on its own),
    so a bar with this total ends full.
    """
    return sum(ckpt.data_files.values())


def check_data(ckpt: Checkpoint, hash_files: dict[str, list[str]], progress: Progress | None = None,
               workers: int | None = None, records: dict[tuple[str, int], ChunkRecord] | None = None,
               files: frozenset[str] | None = None) -> DataReport:
    """Decode every chunk, count NaN/Inf per key, and hash the listed files, in one read of each file.

    ``hash_files`` maps data files to the manifest's algorithms for them; the digests come back in
    :attr:`DataReport.digests` (files that could not be read are absent). ``workers`` threads read,
    hash and scan windows in parallel (default: :func:`default_workers`); the report does not
    depend on it. ``records`` (``(key, chunk index) -> record``, :func:`gtp_format.check.hashes.match_records`):
    those chunks' hashes are checked from the same read. ``progress`` advances in bytes, up to
    :func:`data_bytes`. ``files``: only the chunks stored in these data files are read (a writer
    checking the files it wrote, :func:`gtp_format.check.verify_data.verify_written`).
    """
    records = records or {}
    report = DataReport()
    total = Found()
    tick = _Bytes(data_bytes(ckpt), progress)
    by_file: dict[str, list[Item]] = defaultdict(list)
    group = ranks.current() if files is None else None  # under torchrun: this rank reads its share
    # chunks read on their own (and chunks refused before any read, their finding made: None to read), in order
    direct: list[tuple[Entry, Chunk, Found | None]] = []
    for e in ckpt.entries.values():
        for c in e.chunks:
            if files is not None and (c.storage is None or c.storage.file not in files):
                continue
            if e.kind == BYTES or ckpt.encoding != ENC_TORCH_SAVE:
                direct.append((e, c, None))
                continue
            try:
                ref = checked_ref(ckpt, e, c)
            except ChunkError as err:
                refused = Found()
                refused.error(err, e, c)
                direct.append((e, c, refused))
                continue
            by_file[ref.file].append(Item(e, c, ref.offset, ref.offset + ref.length, records.get((e.key, c.index))))
    buffers = Buffers(WINDOW)  # shared by the files' passes: a file's buffers serve the next one
    remote = storage_for(ckpt.store).remote
    # under torchrun: the host's cores shared by its ranks
    n = workers or ranks.cores_per_rank(default_workers(remote))
    cold_direct = direct_reads(n)  # read here: a bad CKPT_VERIFY_DIRECT is one line before any file is opened
    span = span_bytes()  # likewise CKPT_VERIFY_SPAN_MIB
    spans = Spans(span, span_depth(span, n)) if span >= 2 * WINDOW else None
    piece = piece_bytes(n)  # likewise CKPT_VERIFY_PIECE_KIB
    passes = [_FilePass(ckpt, rel, sorted(by_file.get(rel, []), key=lambda i: (i.start, i.stop)),
                        hash_files.get(rel, []), buffers, cold_direct, spans, piece)
              for rel in sorted(by_file.keys() | hash_files.keys())]
    batch = spans.span // WINDOW if spans is not None else BATCH

    def read(direct: list[tuple[Entry, Chunk, Found | None]], passes: list[_FilePass]) -> list[Found]:
        """Each direct chunk's and each file's findings, in the order given (merged in that order)."""
        out = []
        for e, c, refused in direct:
            if refused is not None:
                out.append(refused)
                continue
            found = Found()
            random_access(ckpt, e, c, found, records.get((e.key, c.index)))  # byte objects and raw layouts
            out.append(found)
            tick(c.storage.length if c.storage is not None else 0)
        # a bucket's windows are PART bytes, not WINDOW: as many bytes pending as IN_FLIGHT windows of 8 workers
        in_flight = max(2, HELD * WINDOW // PART) if remote else min(HELD, IN_FLIGHT * n)
        with ThreadPoolExecutor(n, "ckpt-data") as pool:
            # a bucket's step holds a whole request (PART) while it runs: there every task counts as held
            _run(passes, pool, in_flight, report, tick, in_flight if remote else max(2, 2 * n),
                 1 if remote else batch)
        return out + [fp.found for fp in passes]

    if group is None:
        for found in read(direct, passes):
            total.merge(found)
    else:
        _read_shared(group, ckpt, direct, passes, read, total, report)
    tick.finish()
    report.nonfinite, found = split_padding(total.nan, total.inf)
    report.problems = total.problems + found
    return report


def _read_shared(group: ranks.Group, ckpt: Checkpoint, direct: list[tuple[Entry, Chunk, Found | None]],
                 passes: list[_FilePass],
                 read: Callable[[list[tuple[Entry, Chunk, Found | None]], list[_FilePass]], list[Found]], total: Found,
                 report: DataReport) -> None:
    """The data pass over the ranks of a torchrun job: each rank reads its share of the direct chunks and of
    the files (:meth:`gtp_format.ranks.Group.mine`, by bytes), and every rank merges every rank's findings in
    the order one process does, so the report is the same as one process's (problems in the same order)."""
    mine_direct = group.mine([c.storage.length if c.storage is not None and f is None else 0 for _, c, f in direct])
    mine_files = group.mine([ckpt.data_files.get(fp.rel, 0) for fp in passes])

    def local() -> tuple[list[tuple[int, Any]], dict[str, dict[str, str]], int]:
        got = read([direct[i] for i in mine_direct], [passes[i] for i in mine_files])
        places = mine_direct + [len(direct) + i for i in mine_files]
        return ([(p, (dict(f.nan), dict(f.inf), f.problems)) for p, f in zip(places, got)], report.digests,
                report.bytes_read)

    found: dict[int, Any] = {}
    shares = group.exchange(local, "while reading its data files")
    report.digests, report.bytes_read = {}, 0  # this rank's own come back in the gather
    for parts, digests, nbytes in shares:
        found.update(parts)
        report.digests.update(digests)
        report.bytes_read += nbytes
    for p in sorted(found):
        nan, inf, problems = found[p]
        part = Found()
        part.nan.update(nan)
        part.inf.update(inf)
        part.problems = problems
        total.merge(part)
    report.digests = {fp.rel: report.digests[fp.rel] for fp in passes if fp.rel in report.digests}


def _run(passes: list[_FilePass], pool: ThreadPoolExecutor, in_flight: int, report: DataReport,
         tick: Progress, tasks: int, batch: int) -> None:
    """Submit every file's steps in order, in tasks of up to ``batch`` steps, and merge their results in
    the same order.

    A step that keeps its window until the merge (an order-dependent digest, or a piece of a large chunk's
    hash) is a task of its own, and at most ``in_flight`` such windows are pending. Other steps hold nothing
    once done, so only the workers' current windows are in memory; those go ``batch`` to a task, ``tasks``
    tasks ahead. Why: per window, the future, its lock and the main thread's wake-up cost more under the
    GIL than the step's own Python (profile of a 4 GB dcp.save checkpoint, 2 workers: 1.1 of 3.6 s in the
    lock release that wakes the main thread); a task of four windows pays them once.
    """
    pending: deque[tuple[_FilePass, list[_Step | None], bool, Future[list[Found | ChunkError]]]] = deque()
    held = 0  # windows kept by pending tasks until their merge

    def finish() -> None:
        nonlocal held
        fp, steps, keeps, fut = pending.popleft()
        held -= len(steps) if keeps else 0
        for step, got in zip(steps, fut.result()):
            if isinstance(got, ChunkError):  # the file changed under us: report it once, and do not trust its hash
                found = Found()
                if not fp.failed:
                    fp.failed = True
                    found.problems.append(Problem("error", "data_file", got.message, file=fp.rel))
            else:
                found = got
            planned = fp.absorb(step, found)
            if found.buffer is not None:  # nothing views it any more: the next read may fill it
                fp.buffers.give(found.buffer)
                found.buffer = None
            for part in ([planned] if planned else []) + [found]:
                fp.found.merge(part)  # each file's own, merged in file order after: the order does not change
            report.bytes_read += found.nbytes
            tick(found.nbytes)
        if fp.done():
            fp.close(report)

    # Planning a file reads the two ends of each chunk larger than a window: done on a worker,
    # one file ahead, so the main thread keeps the others fed while it runs.
    plans = [pool.submit(passes[0].open_and_plan)] if passes else []
    try:
        for i, fp in enumerate(passes):
            steps = plans[i].result()
            if i + 1 < len(passes):
                plans.append(pool.submit(passes[i + 1].open_and_plan))
            if not steps:
                done: Future[list[Found | ChunkError]] = Future()
                done.set_result([Found()])
                pending.append((fp, [None], False, done))
                continue
            keeps = fp.keeps_windows()
            size = 1 if keeps else batch
            for j in range(0, len(steps), size):
                group: list[_Step | None] = list(steps[j:j + size])
                while pending and (len(pending) >= tasks or (keeps and held + len(group) > in_flight)):
                    finish()
                held += len(group) if keeps else 0
                pending.append((fp, group, keeps, pool.submit(fp.work_all, group)))
        while pending:
            finish()
    finally:  # on an error: no worker may still be reading (or opening) a file when its descriptor closes
        for fut in [f for *_, f in pending] + plans:
            fut.cancel() or fut.exception()
        for fp in passes:
            fp.close(None)


class _Bytes:
    """``verify --data``'s progress in bytes: advances by what was read, never past ``total``, and to
    ``total`` at the end."""

    def __init__(self, total: int, progress: Progress | None) -> None:
        self.left, self.progress = total, progress

    def __call__(self, n: int) -> None:
        n = min(n, self.left)
        if n > 0 and self.progress is not None:
            self.left -= n
            self.progress(n)

    def finish(self) -> None:
        self(self.left)


@dataclass(frozen=True)
class _Step:
    """Read ``[start, stop)`` of the file (nothing when equal), then run ``action`` on those bytes."""

    start: int
    stop: int
    action: Action


class _FilePass:
    """One data file: its plan of window steps, the worker's job for one step, and the in-order merge.

    The plan depends on the metadata only, so steps can be read and checked ahead, on any worker;
    only :meth:`absorb` (main thread, file order) carries state from one window to the next.
    """

    def __init__(self, ckpt: Checkpoint, rel: str, items: list[Item], algorithms: list[str],
                 buffers: Buffers | None = None, direct: bool = False, spans: Spans | None = None,
                 piece: int = 0) -> None:
        self.ckpt, self.rel, self.items = ckpt, rel, items
        self.buffers = buffers or Buffers(WINDOW)
        self.spans = spans  # a task's windows in one cold read (gtp_format.check.data_read)
        self.direct = direct  # cold windows with O_DIRECT, else through the cache (gtp_format.check.data_read)
        self.piece = piece  # a warm payload window is read and checked in pieces of this size (0: whole)
        self.reads: WindowReads | None = None  # a local file's reads (reused buffers, O_DIRECT when cold)
        self.found = Found()  # what this file's steps found, merged in file order
        # one CRC alone is hashed per window on the workers and combined in order; anything else
        # (SHA-256, or several algorithms) is fed window by window on the main thread
        self.crc: Crc | None = CRCS[algorithms[0]] if len(algorithms) == 1 and algorithms[0] in CRCS else None
        # each zip record's own CRC-32 is what catches a flipped bit in a file the manifest has no checksum
        # for (every genuine Megatron checkpoint); a file the manifest checksums is covered by that already,
        # and one whose chunks all have records by their hashes (zlib's CRC-32 would be the slowest pass), if a
        # manifest checksums those records: a side file nothing checksums (Megatron's layout) replaces no check
        self.record_crc = not algorithms and not (ckpt.manifest is not None and items
                                                  and all(it.record is not None for it in items))
        self.hashers: dict[str, Hasher] = {} if self.crc else {a: HASHERS[a]() for a in algorithms}
        self.value = 0  # the CRC so far
        self.window = WINDOW  # a bucket's object: PART (one request per window)
        self.whole = WINDOW  # a chunk up to this is one window of its own; larger ones are read as _big
        self.planned: Found | None = Found()  # what planning found: merged before the first step
        self.fd: int | None = None
        self.obj: ObjectFile | None = None
        self.stream: ObjectStream | None = None  # a bucket's object: the plan's ranges, fetched ahead
        self.remaining = 0
        self.failed = False
        self.streams = False  # a chunk larger than a window is hashed piece by piece on the main thread

    # -- planning a file: on a worker, one file ahead of the main thread ---------------------------

    def open_and_plan(self) -> list[_Step]:
        try:
            f = open_regular(self.ckpt.store, self.rel)
        except ChunkError as err:
            for it in self.items:
                self.planned.error(ChunkError(f"{it.entry.key} chunk {it.chunk.index}: {err.message}",
                                              file=self.rel), it.entry, it.chunk)
            self.failed = True
            self.remaining = 1
            return []
        if f.remote:  # type: ignore[attr-defined]  # a bucket's object: ranged reads, its size the store's (no holes)
            self.obj, self.size = streamed_file(f), f.size  # type: ignore[assignment]
            self.window, self.whole = PART, 2 * PART
            steps = self._plan()
            self.stream = ObjectStream(f, [(s.start, s.stop) for s in steps], aligned=True)
            self.remaining = max(1, len(steps))
            return steps
        message = f.sparse_message(self.rel)  # type: ignore[attr-defined]
        if message is not None:
            # Holes: reading (and hashing) them costs time for bytes nobody wrote; a 16 TiB sparse
            # file under a matching manifest size would keep verify --data busy for hours.
            f.close()
            for it in self.items:
                self.planned.error(ChunkError(f"{it.entry.key} chunk {it.chunk.index}: {message}", file=self.rel),
                                   it.entry, it.chunk)
            self.failed = True
            self.remaining = 1
            return []
        self.size = f.size  # type: ignore[attr-defined]
        self.fd = os.dup(f.fileno())
        f.close()
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        self.reads = WindowReads(self.fd, self.size, self.rel, self.direct)
        self.reads.ask(0, min(self.size, HEAD))  # the disk reads the file's start while the plan is made
        self._ask_for_ends()
        steps = self._plan()
        self.remaining = max(1, len(steps))
        return steps

    def _ask_for_ends(self) -> None:
        """Ask the kernel for the two ends of every chunk larger than a window before planning parses them.

        Planning reads each such chunk's structure (a few KiB at each end) before any window of the file is
        read: one after the other, each a round trip to a cold disk (a 12.9 GB ``dcp.save`` file is 200
        chunks of 64 MiB, 400 such reads). ``WILLNEED`` puts them all in flight at once; the parse then
        finds them in the cache. Advice only: nothing else depends on it.
        """
        if not hasattr(os, "posix_fadvise") or self.fd is None:
            return
        try:
            for it in self.items:
                if it.stop - it.start > self.whole:
                    os.posix_fadvise(self.fd, it.start, END_BYTES, os.POSIX_FADV_WILLNEED)
                    os.posix_fadvise(self.fd, max(it.start, it.stop - END_BYTES), END_BYTES, os.POSIX_FADV_WILLNEED)
        except OSError:
            pass

    # -- main thread, in file order ---------------------------------------------------------------

    def absorb(self, step: _Step | None, found: Found) -> Found | None:
        """Fold one finished step into the file's digest; returns what planning found, the first time."""
        planned, self.planned = self.planned, None
        for acc, crc, n in found.payload_parts:  # pieces of one large chunk's payload, joined in file order
            acc.add(crc, n, found)
        for streamed, piece in found.hash_parts:
            streamed.add(piece, found.problems)
        found.hash_parts = []
        if self.crc is not None and step is not None:
            self.value = self.crc.combine(self.value, found.crc, found.nbytes)
        for h in self.hashers.values():
            h.update(found.data)
        found.data = b""
        self.remaining -= 1
        return planned

    def done(self) -> bool:
        return self.remaining == 0

    def close(self, report: DataReport | None) -> None:
        """Release the file; with ``report``, record its digest (unless reading it failed)."""
        if self.reads is not None:
            self.reads.close()
            self.reads = None
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        if self.stream is not None:
            self.stream.close()
        if report is None or self.failed:
            return
        if self.crc is not None:
            report.digests[self.rel] = {self.crc.name: f"{self.value:08x}"}
        elif self.hashers:
            report.digests[self.rel] = {a: h.hexdigest() for a, h in self.hashers.items()}

    # -- workers ---------------------------------------------------------------------------------

    def keeps_windows(self) -> bool:
        """Whether a step's window stays referenced until the main thread merges it (see :meth:`absorb`)."""
        return bool(self.hashers) or self.streams

    def work_all(self, steps: list[_Step]) -> list[Found | ChunkError]:
        """:meth:`work` on each step in turn; a step that fails does not stop the next. Steps in a row that
        nothing keeps past them are read as one span when cold (:meth:`_span`)."""
        out: list[Found | ChunkError] = []
        span = self._span(steps)
        try:
            for step in steps:
                try:
                    out.append(self.work(step) if span is None else self.work(step, span))
                except ChunkError as err:
                    out.append(err)
        finally:
            if span is not None and self.spans is not None:  # no view of it outlives its step (nothing keeps)
                self.spans.give(span.buf)
        return out

    def _span(self, steps: list[_Step]) -> Span | None:
        """The bytes of ``steps`` in one read, where they follow each other and their windows are not kept."""
        reads = self.reads
        runs = [(s.start, s.stop) for s in steps if s.stop > s.start]
        if reads is None or not runs or any(b != c for (_, b), (c, _) in zip(runs, runs[1:])):
            return None
        start, stop = runs[0][0], runs[-1][1]
        reads.advise(start, stop)  # through the cache: the task's windows asked for at once
        if len(runs) < 2 or self.keeps_windows():
            return None
        return reads.span(self.spans, start, stop)

    def work(self, step: _Step, span: Span | None = None) -> Found:
        found = Found()
        view = memoryview(b"")
        if step.stop > step.start:
            inside = span.window(step.start, step.stop) if span is not None else None
            if inside is None and self._in_pieces(step):
                return self._pieces(step, found)
            view = inside if inside is not None else self._read(step.start, step.stop, found)
            found.nbytes = len(view)
            if self.crc is not None:
                found.crc = self.crc.update(view, 0)
            elif self.hashers:
                found.data = view
        step.action(view, found)
        if found.buffer is not None and not self.keeps_windows():  # nothing holds a view of it past the step
            self.buffers.give(found.buffer)
            found.buffer = None
        return found

    def _in_pieces(self, step: _Step) -> bool:
        """Whether the step's window is read and checked piece by piece (:meth:`_pieces`): a local file's window
        larger than a piece, through the page cache, whose action takes pieces and keeps no view of them."""
        reads = self.reads
        return (reads is not None and 0 < self.piece < step.stop - step.start and getattr(step.action, "pieces", False)
                and not self.keeps_windows() and reads.cached(step.start, step.stop))

    def _pieces(self, step: _Step, found: Found) -> Found:
        """The step's window read, hashed and checked ``self.piece`` bytes at a time, each piece into the same
        start of one buffer, so the bytes the kernel copies are still in the core's cache when the CRC and the
        scan read them (a 2 MiB window is not: the source pages and the window together pass the 2 MiB of
        L2). The file's CRC continues from piece to piece, as the payload's CRC-32 does in the action."""
        reads = self.reads
        assert reads is not None
        buf = self.buffers.take(self.piece)
        try:
            whole, piece, crc, action = memoryview(buf), self.piece, self.crc, step.action
            for lo in range(step.start, step.stop, piece):
                view = reads.read_cached(whole[:min(piece, step.stop - lo)], lo, step.start, step.stop)
                if crc is not None:
                    found.crc = crc.update(view, found.crc)
                action(view, found)
                del view
        finally:
            del whole
            self.buffers.give(buf)
        found.nbytes = step.stop - step.start
        return found

    def _read(self, start: int, stop: int, found: Found) -> memoryview:
        """The bytes ``[start, stop)``: a local file's into a reused buffer (``found.buffer``, given back once
        nothing views it), a bucket's as the ``bytes`` of its ranged request."""
        reads = self.reads
        if reads is None:
            return memoryview(self._pread(start, stop))
        buf = self.buffers.take(stop - start)
        view = reads.read(buf, start, stop)
        found.buffer = buf
        return view

    def _pread(self, start: int, stop: int) -> bytes:
        """The bytes ``[start, stop)`` of a bucket's object as one immutable ``bytes``."""
        if self.stream is not None:
            return self.stream.read(start, stop)  # exactly those bytes, or an error naming the object
        read = self.obj.pread if self.obj is not None else functools.partial(os.pread, self.fd)
        data = read(stop - start, start)
        while len(data) < stop - start:  # short reads happen only at the end of a file that shrank
            more = read(stop - start - len(data), start + len(data))
            if not more:
                raise ChunkError(f"data file {self.rel} shrank while reading [{start}, {stop})", file=self.rel)
            data += more
        return data

    # -- planning (helpers of open_and_plan) -------------------------------------------------------

    def _plan(self) -> list[_Step]:
        items = [it for it in self.items if self._in_file(it)]
        end = self.size if (self.crc or self.hashers) else max((it.stop for it in items), default=0)
        steps: list[_Step] = []
        pos, i, n = 0, 0, len(items)
        while i < n or pos < end:
            if i < n and items[i].start < pos:  # shares bytes with a chunk already planned
                steps.append(_Step(pos, pos, fallback_action(self.ckpt, [items[i]])))
                i += 1
                continue
            if i < n and items[i].start == pos and items[i].stop - pos > self.whole:
                steps += self._big(items[i])
                pos = items[i].stop
                i += 1
                continue
            # a chunk a little over a window (a 2048 x 1024 fp32 chunk is 8 MiB and 1.5 KiB of zip) is one
            # window of its own in a bucket: as _big it cost two more requests for its structure
            stop = items[i].stop if i < n and items[i].start == pos and items[i].stop - pos > self.window \
                else min(end, pos + self.window)
            k = i
            while k < n and items[k].start < stop and items[k].stop <= stop:
                k += 1
            if k < n and pos < items[k].start < stop:  # the window would cut items[k]: end before it
                stop = items[k].start
            if stop <= pos:  # nothing left to read; only empty chunks remain
                steps.append(_Step(pos, pos, fallback_action(self.ckpt, items[i:])))
                break
            steps.append(_Step(pos, stop, window_action(self.ckpt, pos, stop, items[i:k], self.record_crc)))
            pos, i = stop, k
        return steps

    def _in_file(self, it: Item) -> bool:
        if it.stop <= self.size:
            return True
        self.planned.error(ChunkError(f"{it.entry.key} chunk {it.chunk.index}: "
                                      f"{past_end_message(self.rel, it.start, it.stop - it.start, self.size)}",
                                      file=self.rel), it.entry, it.chunk)
        return False

    def _big(self, it: Item) -> list[_Step]:
        """A chunk larger than a window: structure from its ends now, elements window by window later."""
        assert self.fd is not None or self.obj is not None
        layout = None
        try:
            layout = parse_blob(RangeReader(self.obj or self.fd, it.start, it.stop - it.start))
            check_layout(layout, it.entry, it.chunk)
        except BlobError as e:
            self.planned.error(blob_error(it.entry, it.chunk, e), it.entry, it.chunk)
            layout = None
        steps = []
        if layout is not None and not layout.contiguous_whole:
            steps.append(_Step(it.start, it.start, fallback_action(self.ckpt, [it])))  # a view into a larger storage
            layout = None
        lo_payload = it.start + (layout.payload_offset if layout else 0)
        hi_payload = lo_payload + (layout.payload_bytes if layout else 0)
        # a local file's payload pieces end on the file's window boundaries (where they keep whole elements): a
        # cold piece is then one aligned O_DIRECT request, not a window plus a page read again by the next one
        first = lo_payload
        if layout is not None and self.obj is None:
            edge = lo_payload + (-lo_payload) % self.window
            first = edge if (edge - lo_payload) % max(1, layout.dtype.itemsize) == 0 else lo_payload
        cuts = sorted({it.start, it.stop, lo_payload, hi_payload, *range(first, hi_payload, self.window)})
        acc = PayloadCrc(layout.payload_crc, it.entry, it.chunk, layout.payload_bytes) \
            if layout is not None and self.record_crc else None
        streamed = StreamedHash(it.entry, it.chunk, it.record) if it.record is not None and not steps else None
        self.streams = self.streams or streamed is not None
        for a, b in zip(cuts, cuts[1:]):
            for lo in range(a, b, self.window):
                hi = min(b, lo + self.window)
                inside = layout is not None and lo_payload <= lo and hi <= hi_payload
                scan = inside and can_hold_nonfinite(layout.dtype)
                tally = tally_key(self.ckpt, it.entry, it.chunk)
                action = payload_action(tally, layout.dtype, scan, acc) if inside else ignore_bytes
                steps.append(_Step(lo, hi, hashed(action, streamed) if streamed else action))
        return steps
