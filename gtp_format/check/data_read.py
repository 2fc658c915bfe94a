"""How ``verify --data`` reads a window of a local data file: into a reused buffer, from the page cache
or straight from the disk.

* No allocation per read. A window used to be a new 2 MiB ``bytes`` from ``os.pread``: fresh memory
  that the kernel zeroes and faults in page by page before copying into it, on every worker at once
  (``benchmarks/verify_data_stages.py``: 0.13 CPU s per GB for that read against 0.12 for ``preadv``
  into one reused buffer on 2 cores, and the pass as a whole 0.43 against 0.36). Here each window is
  read with ``preadv`` into a buffer of :class:`Buffers`, given back once nothing needs its bytes
  (after the worker's step, or after the in-order merge for the steps that keep theirs).
* Cold pages from the disk, warm ones from the cache. A window whose sampled pages are not all in the
  cache (:class:`gtp_format.reader.preads.PageCache`, ``mincore``) is read with ``O_DIRECT`` on a
  second descriptor: the disk gets the whole window as one request, nothing is copied out of the
  page cache, and nothing is added to it (on the lent H200 a read through the cache reached 0.66x of
  ``dd iflag=direct`` with 8 threads and ``O_DIRECT`` 1.21x: docs/performance.md, loads). A warm
  window stays a copy from the cache: reading it from the disk again would be the slow way.
  The direct read covers the window's aligned pages (at most a page more on each side, read twice at
  the edge of two windows), and the bytes used are exactly ``[start, stop)``.

* Cold spans in one request, a bounded number in flight. A worker's task is several windows in a row
  (:data:`SPAN` bytes); when that span is cold it is read with one ``O_DIRECT`` request into a span
  buffer and the windows are views of it. At most :func:`span_depth` span buffers exist (a budget of
  :data:`SPAN_BUDGET` bytes, never more than the workers): a worker that finds none free waits for one,
  so the disk sees that many large requests in roughly file order, not one 2 MiB request per worker at
  16 offsets. Measured on the lent 16-core host's virtual disk (docs/performance.md, issue 41): see
  there for the depth and size sweep (``benchmarks/disk_ceiling.py --reads``) this default comes from.
* Through the cache, the span is asked for ahead (``posix_fadvise(WILLNEED)`` of each window of the
  task before the first is read): the kernel reads the whole span at once instead of a readahead
  window at a time behind the copying thread.

``CKPT_VERIFY_DIRECT=0`` turns the direct reads off (every window through the cache, as before): the
escape hatch for a disk that serves them slower than its readahead, and the switch of an A/B on one host.
``CKPT_VERIFY_SPAN_MIB`` sets the span (0: each window its own direct request, as before; default 8).

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

DIRECT_MIN = 256 << 10  # windows from this size are read from the disk when the cache lacks them
DIRECT_ENV = "CKPT_VERIFY_DIRECT"
SPAN = 8 << 20  # a worker's task of windows in a row, read cold as one O_DIRECT request
SPAN_ENV = "CKPT_VERIFY_SPAN_MIB"
ADVISE_PIECE = 1 << 20  # WILLNEED per call: under the kernel's cap (readahead or max request size, >= 1 MiB here)
SPAN_BUDGET = 40 << 20  # span buffers in all: with the pass's own ~60 MiB, under 128 MB at any worker count


def direct_reads() -> bool:
    """Whether cold windows are read with ``O_DIRECT``: yes, unless ``CKPT_VERIFY_DIRECT`` is 0."""
    value = os.environ.get(DIRECT_ENV)
    if value is None:
        return True
    try:
        return parse_int(value, DIRECT_ENV, 0, 1) == 1
    except NumberError as e:
        raise FormatError(f"{e}; set it to 1 (cold windows read from the disk) or 0 (through the cache)") from None


def span_bytes() -> int:
    """The bytes of a cold span (``CKPT_VERIFY_SPAN_MIB``, default :data:`SPAN`); 0: no spans."""
    value = os.environ.get(SPAN_ENV)
    if value is None:
        return SPAN
    try:
        return parse_int(value, SPAN_ENV, 0, 64) << 20
    except NumberError as e:
        raise FormatError(f"{e}; set it to the MiB of one cold read (8 by default, 0 for one read per window)") \
            from None


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

    def __init__(self, fd: int, size: int, rel: str, direct: bool = True) -> None:
        self.fd, self.size, self.rel = fd, size, rel
        self.direct = reopen_direct(fd) if direct else None
        self.cache = PageCache(fd, size) if self.direct is not None else None
        self.use_direct = self.cache is not None

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
        """Ask the kernel for ``[start, stop)`` now (``WILLNEED``): through the cache, a span's windows are
        read at once, not a readahead window at a time behind the thread that copies them out."""
        if self.use_direct or stop <= start or not hasattr(os, "posix_fadvise"):
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
