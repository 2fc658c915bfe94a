"""How ``verify --data`` reads a window of a local data file: into a reused buffer, from the page cache
or straight from the disk.

* No allocation per read. A window used to be a new 2 MiB ``bytes`` from ``os.pread``: fresh memory
  that the kernel zeroes and faults in page by page before copying into it, on every worker at once
  (``benchmarks/verify_data_stages.py``: 0.13 CPU s per GB for that read against 0.12 for ``preadv``
  into one reused buffer on 2 cores, and the pass as a whole 0.43 against 0.36). Here each window is
  read with ``preadv`` into a buffer of :class:`Buffers`, given back once nothing needs its bytes
  (after the worker's step, or after the in-order merge for the steps that keep theirs).
* Cold windows through the cache, asked for ahead. A worker's task is several windows in a row
  (8 MiB); before reading the first, it asks the kernel for all of them (``posix_fadvise(WILLNEED)``,
  in 1 MiB calls: the kernel caps one call near its readahead size), so the disk gets the whole task at
  once from every worker, and the bytes in flight sit in the page cache, not in this process (which
  stays under 128 MB). Warm tasks (``mincore``, :class:`gtp_format.reader.preads.PageCache`: their
  first, middle and last pages resident) are not asked for. Planning asks for each file's first
  :data:`HEAD` bytes, so the disk works while the plan is made.
* Cold windows with ``O_DIRECT`` (``CKPT_VERIFY_DIRECT=1``, and the default under
  :data:`CACHE_FROM_WORKERS` workers): a window the cache lacks is read on a
  second descriptor, one request per window, straight into the buffer; optionally a task's windows as
  one span request (``CKPT_VERIFY_SPAN_MIB``, :class:`Spans`: at most :func:`span_depth` span buffers,
  :data:`SPAN_BUDGET` bytes, a worker waiting for one). The direct read covers the aligned pages
  around the range, and the bytes used are exactly ``[start, stop)``.

Why the cache is the default from 8 workers: on the lent 16-core host (ext4 on one virtual disk, ``read_ahead_kb``
8192), 12.9 GB written by ``dcp.save``, best of 3 cold rounds in one run against ``cat`` 7.29 s: through
the cache with the tasks asked for 7.30 s; ``O_DIRECT`` per 2 MiB window 7.74 s (and 8.77 s before the
chunks' ends were asked for); 8 MiB spans, 5 in flight, 8.54 s; 16 MiB spans, 2 in flight, 8.93 s
(docs/performance.md, cold reads on the lent host). That disk serves more bytes in flight faster than
larger requests, and direct reads can hold in flight only what the process's memory budget holds. The cost is CPU: the
kernel's copy out of the cache and its page handling, 33 CPU s against 11-12 for the direct reads. On
the 2-core VM (1.0 GB, the file evicted before each run, 2 workers) the cache path took 1.6-1.75 CPU s
against 1.05-1.2 direct, and twice the wall time in both rounds (a loaded machine: ``cat`` itself
varied 2.8-18 s), so with few workers, where that CPU competes with the checks, the direct reads stay
the default. 8 is between the two measured points (2 and 16), not a measured knee.
``CKPT_VERIFY_DIRECT`` (1 or 0) sets the path whatever the workers: the switch of an A/B on one host.

Both reads end in the same check: fewer bytes than asked is a file that shrank under the pass, one
:class:`~gtp_format.errors.ChunkError` naming it (never a short window, never a ``SIGBUS``: nothing is
read through a mapping).
"""

from __future__ import annotations

import ctypes
import errno
import os
import threading

from gtp_format.errors import ChunkError, FormatError
from gtp_format.numbers import NumberError, parse_int
from gtp_format.reader.preads import ALIGN, PageCache, read_fully, reopen_direct

DIRECT_MIN = 256 << 10  # with CKPT_VERIFY_DIRECT=1, windows from this size are read from the disk when cold
DIRECT_ENV = "CKPT_VERIFY_DIRECT"
HEAD = 64 << 20  # the bytes of a file asked for when its plan starts (the disk reads while planning parses)
CACHE_FROM_WORKERS = 8  # from this many workers, cold windows come through the cache (unless CKPT_VERIFY_DIRECT)
SPAN = 0  # with CKPT_VERIFY_DIRECT=1: a task of windows in a row read cold as one request of up to this (0: none)
SPAN_ENV = "CKPT_VERIFY_SPAN_MIB"
ADVISE_PIECE = 1 << 20  # WILLNEED per call: under the kernel's cap (readahead or max request size, >= 1 MiB here)
SPAN_BUDGET = 40 << 20  # span buffers in all: with the pass's own ~60 MiB, under 128 MB at any worker count
PIECE = 512 << 10  # a warm payload window is read and checked in pieces of this many bytes (0: whole windows)
# up to this many workers; more read whole windows. Each piece is four calls that hand the GIL back and take it
# again (preadv, the CRC-32, the scan's two): with 16 workers on the lent 16-core host, 512 KiB pieces took
# 2.29-2.84 s for a warm 12.9 GB file, 1 MiB 1.68-1.76 s, whole windows 1.32-1.43 s (same call; cat 1.40-1.53 s).
# With 2 workers (2-core VM) the pieces still pay: the copy's bytes are in the core's cache for the checks.
# 4 lies between those measured points (2 and 8, 16), not at a measured knee.
PIECE_WORKERS = 4
PIECE_ENV = "CKPT_VERIFY_PIECE_KIB"


def _setting(name: str, low: int, high: int, fix: str) -> int | None:
    """``$name`` as :func:`parse_int` reads it within [low, high]; None when unset. An empty value is refused as
    any other that is no number: one :class:`FormatError` line, ending with ``fix``."""
    value = os.environ.get(name)
    if value is None:
        return None
    try:
        return parse_int(value, name, low, high)
    except NumberError as e:
        raise FormatError(f"{e}; {fix}") from None


def direct_reads(workers: int) -> bool:
    """Whether cold windows are read with ``O_DIRECT``: ``CKPT_VERIFY_DIRECT`` (1 or 0), else below
    :data:`CACHE_FROM_WORKERS` workers (where the cache's CPU cost competes with the checks)."""
    value = _setting(DIRECT_ENV, 0, 1, "set it to 1 (cold windows read with O_DIRECT) or 0 (through the cache), "
                     "or unset it (the cache from 8 workers)")
    return workers < CACHE_FROM_WORKERS if value is None else value == 1


def span_bytes() -> int:
    """The bytes of a cold direct span (``CKPT_VERIFY_SPAN_MIB``, default :data:`SPAN`); 0: no spans."""
    value = _setting(SPAN_ENV, 0, 64, "set it to the MiB of one cold direct read (0, the default: one read per "
                     "window)")
    return SPAN if value is None else value << 20


def piece_bytes(workers: int = 1) -> int:
    """The bytes of one piece of a warm window (``CKPT_VERIFY_PIECE_KIB``; by default :data:`PIECE` for up to
    :data:`PIECE_WORKERS` workers, else whole windows); 0: whole windows. A multiple of 1 KiB, so a piece of a
    payload window holds whole elements of any dtype."""
    value = _setting(PIECE_ENV, 0, 2048, f"set it to the KiB a warm window is read and checked in (0: whole "
                     f"windows), or unset it ({PIECE >> 10} up to {PIECE_WORKERS} workers, whole windows above)")
    if value is None:
        return PIECE if workers <= PIECE_WORKERS else 0
    return value << 10


def span_depth(span: int, workers: int, budget: int | None = None) -> int:
    """How many span buffers a pass may hold: ``budget`` worth (:data:`SPAN_BUDGET`), at least one, never more
    than ``workers``."""
    return max(1, min(workers, (SPAN_BUDGET if budget is None else budget) // max(1, span)))


class Spans:
    """The span buffers of one data pass: at most ``depth`` at once, a worker waiting for one to be given back.

    A buffer holds a span plus the slack of an ``O_DIRECT`` read (its start, its first and last pages).
    """

    def __init__(self, span: int, depth: int) -> None:
        self.span, self.depth = span, depth
        self.size = span + 3 * ALIGN
        self.free: list[bytearray] = []
        self.made = 0
        self.lock = threading.Condition()

    def take(self) -> bytearray:
        with self.lock:
            while not self.free and self.made >= self.depth:
                self.lock.wait()
            if self.free:
                return self.free.pop()
            self.made += 1
        return bytearray(self.size)

    def give(self, buf: bytearray) -> None:
        with self.lock:
            self.free.append(buf)
            self.lock.notify()


class Span:
    """Bytes ``[start, stop)`` of a file read in one request: windows inside it are views, no copy."""

    def __init__(self, buf: bytearray, view: memoryview, start: int, stop: int) -> None:
        self.buf, self.view, self.start, self.stop = buf, view, start, stop

    def window(self, start: int, stop: int) -> memoryview | None:
        if self.start <= start and stop <= self.stop:
            return self.view[start - self.start:stop - self.start]
        return None


class Buffers:
    """Read buffers of one data pass, reused: as many exist as windows were ever in use at once.

    Each holds a window plus the slack that aligns an ``O_DIRECT`` read (its start, its first and last
    pages). ``list.pop`` and ``list.append`` are atomic, so workers and the merging thread share it
    without a lock.
    """

    def __init__(self, window: int) -> None:
        self.size = window + 3 * ALIGN
        self.free: list[bytearray] = []

    def take(self, n: int) -> bytearray:
        """A buffer for a read of ``n`` bytes (one of its own, not kept, past a window)."""
        if n + 3 * ALIGN > self.size:
            return bytearray(n + 3 * ALIGN)
        try:
            return self.free.pop()
        except IndexError:
            return bytearray(self.size)

    def give(self, buf: bytearray) -> None:
        if len(buf) == self.size:
            self.free.append(buf)


class WindowReads:
    """The reads of one open local data file (``fd``, ``size`` bytes when opened) by the pass's workers."""

    def __init__(self, fd: int, size: int, rel: str, direct: bool = False) -> None:
        self.fd, self.size, self.rel = fd, size, rel
        self.direct = reopen_direct(fd) if direct else None
        self.cache: PageCache | None = PageCache(fd, size)
        self.use_direct = self.direct is not None

    def read(self, buf: bytearray, start: int, stop: int) -> memoryview:
        """The bytes ``[start, stop)`` of the file, as a view into ``buf``."""
        n = stop - start
        view = memoryview(buf)
        cache = self.cache
        if self.use_direct and cache is not None and n >= DIRECT_MIN and not cache.resident(start, stop):
            got = self._direct(view, start, stop)
            if got is not None:
                return got
        out = view[:n]
        if read_fully(self.fd, out, start) < n:
            raise self._shrank(start, stop)
        return out

    def cached(self, start: int, stop: int) -> bool:
        """Whether :meth:`read` would take ``[start, stop)`` from the page cache (not with ``O_DIRECT``)."""
        cache = self.cache
        return not (self.use_direct and cache is not None and stop - start >= DIRECT_MIN
                    and not cache.resident(start, stop))

    def read_cached(self, view: memoryview, at: int, start: int, stop: int) -> memoryview:
        """``len(view)`` bytes of the file from ``at`` into ``view`` through the page cache: a piece of the window
        ``[start, stop)`` that :meth:`cached` said is there. Fewer is the file shrinking, named by its window as
        in :meth:`read`."""
        n = len(view)
        got = os.preadv(self.fd, [view], at)  # one call for all of it, but for a file that shrank
        if got < n and (got <= 0 or got + read_fully(self.fd, view[got:], at + got) < n):
            raise self._shrank(start, stop)
        return view

    def span(self, spans: Spans | None, start: int, stop: int) -> Span | None:
        """``[start, stop)`` in one ``O_DIRECT`` request into a buffer of ``spans`` when the cache lacks it (None:
        read window by window, as :meth:`read` does: the range is warm, small, or the disk refuses the read).

        A file that ends inside the span gives None too: the windows are then read one by one, and the
        first that comes short names the place where it shrank, as without spans.
        """
        cache = self.cache
        if spans is None or not self.use_direct or cache is None or stop - start < DIRECT_MIN \
                or stop - start > spans.span or cache.resident(start, stop):
            return None
        buf = spans.take()
        try:
            got = self._direct(memoryview(buf), start, stop, short_ok=True)
        except BaseException:
            spans.give(buf)
            raise
        if got is None:
            spans.give(buf)
            return None
        return Span(buf, got, start, stop)

    def advise(self, start: int, stop: int) -> None:
        """Through the cache, ask the kernel for ``[start, stop)`` now (:meth:`ask`): a task's windows are read at
        once, not a readahead window at a time behind the thread that copies them out."""
        if not self.use_direct:
            self.ask(start, stop)

    def ask(self, start: int, stop: int) -> None:
        """``WILLNEED`` of ``[start, stop)`` unless the cache holds it (advice: the kernel reads it in the
        background; a read of those pages then waits for them, or finds them)."""
        cache = self.cache
        if stop <= start or not hasattr(os, "posix_fadvise"):
            return
        if cache is not None and cache.addr is not None and cache.resident(start, stop):  # unknown: asked
            return
        try:  # in pieces: the kernel reads at most its readahead or largest request size per call
            for lo in range(start, stop, ADVISE_PIECE):
                os.posix_fadvise(self.fd, lo, min(stop, lo + ADVISE_PIECE) - lo, os.POSIX_FADV_WILLNEED)
        except OSError:
            pass  # advice only: the reads that follow are what count

    def _direct(self, view: memoryview, start: int, stop: int, short_ok: bool = False) -> memoryview | None:
        lo = start - start % ALIGN
        head = start - lo
        span = -(-(stop - lo) // ALIGN) * ALIGN
        skip = -ctypes.addressof(ctypes.c_char.from_buffer(view)) % ALIGN
        direct = self.direct
        if direct is None:
            return None
        try:
            got = read_fully(direct, view[skip:skip + span], lo)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            self.use_direct = False  # the file system took the flag but refuses the read: the cache from now on
            return None
        if got - head < stop - start:
            if short_ok:
                return None
            raise self._shrank(start, stop)
        return view[skip + head:skip + head + stop - start]

    def _shrank(self, start: int, stop: int) -> ChunkError:
        return ChunkError(f"data file {self.rel} shrank while reading [{start}, {stop})", file=self.rel)

    def close(self) -> None:
        if self.cache is not None:
            self.cache.close()
            self.cache = None
        if self.direct is not None:
            os.close(self.direct)
            self.direct = None
