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

``CKPT_VERIFY_DIRECT=0`` turns the direct reads off (every window through the cache, as before): the
escape hatch for a disk that serves them slower than its readahead, and the switch of an A/B on one host.

Both reads end in the same check: fewer bytes than asked is a file that shrank under the pass, one
:class:`~gtp_format.errors.ChunkError` naming it (never a short window, never a ``SIGBUS``: nothing is
read through a mapping).
"""

from __future__ import annotations

import ctypes
import errno
import os

from gtp_format.errors import ChunkError, FormatError
from gtp_format.numbers import NumberError, parse_int
from gtp_format.reader.preads import ALIGN, PageCache, read_fully, reopen_direct

DIRECT_MIN = 256 << 10  # windows from this size are read from the disk when the cache lacks them
DIRECT_ENV = "CKPT_VERIFY_DIRECT"


def direct_reads() -> bool:
    """Whether cold windows are read with ``O_DIRECT``: yes, unless ``CKPT_VERIFY_DIRECT`` is 0."""
    value = os.environ.get(DIRECT_ENV)
    if value is None:
        return True
    try:
        return parse_int(value, DIRECT_ENV, 0, 1) == 1
    except NumberError as e:
        raise FormatError(f"{e}; set it to 1 (cold windows read from the disk) or 0 (through the cache)") from None


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

    def _direct(self, view: memoryview, start: int, stop: int) -> memoryview | None:
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
