"""Reading a checked byte range of an open data file into a caller's buffer: ``preadv``, and ``O_DIRECT``
for large ranges into a buffer that is kept (the runtime's loads).

Why ``O_DIRECT`` for the loads: a read through the page cache is cut by the kernel into readahead
windows of a few hundred KiB and every byte is copied once more, out of the cache, by the reading
thread; the H200 load reached 0.66x of ``dd iflag=direct`` that way with 8 reading threads
(docs/performance.md). With ``O_DIRECT`` a 64 MiB ``preadv`` goes to the disk as one request (the
block layer splits it, all pieces in flight at once) straight into the caller's buffer. It needs the
file offset, the length and the buffer address aligned (4096 covers every logical block size), so
the aligned range around the chunk is read into an aligned part of a slightly larger buffer and the
chunk's bytes are a view inside it. Where the file system refuses ``O_DIRECT`` (``EINVAL``: tmpfs
on older kernels, some FUSE and network file systems) the same range is read through the cache.
Small ranges stay on the cache path: under :data:`DIRECT_MIN` there is no window to gain and
readahead serves neighbouring small chunks from one disk read.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
from collections.abc import Callable

READ_PIECE = 64 << 20  # one preadv per 64 MiB: the kernel caps a single read near 2 GiB anyway
ALIGN = 4096  # O_DIRECT's alignment of offset, length and address: every logical block size divides it
DIRECT_MIN = 1 << 20  # ranges from 1 MiB are read with O_DIRECT (when the buffer is the caller's)
_O_DIRECT = getattr(os, "O_DIRECT", 0)

Into = Callable[[int], memoryview]  # a writable buffer of at least n bytes, asked for once a range is checked


def read_fully(fd: int, buf: bytearray | memoryview, offset: int) -> int:
    """``preadv`` into ``buf`` until it is full or the file ends; the bytes read. Unbuffered: the
    bytes go from the page cache into ``buf`` once (a buffered ``readinto`` of a large range does the
    same, but the file object's own buffer adds a copy for the first and last pieces)."""
    view, done = memoryview(buf).cast("B"), 0
    while done < view.nbytes:
        got = os.preadv(fd, [view[done:done + READ_PIECE]], offset + done)
        if got <= 0:
            break
        done += got
    return done


def _address(view: memoryview) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def read_direct(fd: int, offset: int, length: int, into: Into) -> tuple[memoryview, int] | None:
    """``length`` bytes at ``offset`` read with ``O_DIRECT`` into a buffer from ``into``: the view of
    those bytes and how many of them the file held (less than ``length``: it shrank), or None where
    the file system refuses ``O_DIRECT`` (the caller reads through the cache). ``fd`` is a descriptor
    of the caller's own (its flags are changed for the read and restored)."""
    if not _O_DIRECT or length < DIRECT_MIN:
        return None
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | _O_DIRECT)
    except OSError:
        return None
    try:
        lo = offset - offset % ALIGN
        head = offset - lo
        span = -(-(head + length) // ALIGN) * ALIGN
        buf = memoryview(into(span + ALIGN)).cast("B")  # the slack aligns the start
        skip = -_address(buf) % ALIGN
        try:
            got = read_fully(fd, buf[skip:skip + span], lo)
        except OSError as e:
            if e.errno == errno.EINVAL:  # accepted by fcntl, refused by the read
                return None
            raise
    finally:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags)
    return buf[skip + head:skip + head + length], max(0, min(length, got - head))


def reopen_direct(fd: int) -> int | None:
    """A second descriptor of the file open on ``fd``, with ``O_DIRECT``, or None where that cannot be had
    (not Linux, or a file system that refuses ``O_DIRECT``).

    Through ``/proc/self/fd``: the kernel opens the very file ``fd`` holds, no name is resolved again, so
    the storage's rules (a folder's confinement, no links out) hold for it as they did for ``fd``. A
    descriptor of its own because ``O_DIRECT`` is a flag of the open file, shared by every ``dup``:
    :func:`read_direct` toggles it on a descriptor one reader owns, which threads sharing one cannot do.
    """
    if not _O_DIRECT:
        return None
    try:
        return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | _O_DIRECT | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None


class PageCache:
    """Whether a range of an open file is in the page cache (``mincore`` over a mapping that is never read).

    The file is mapped read-only and shared, and no byte of the mapping is ever touched: ``mincore`` only
    looks the pages up, so a file that shrinks later cannot raise ``SIGBUS`` here (the reads stay
    ``preadv``). :meth:`resident` answers True where it cannot tell (no ``mincore``, a failed call): the
    caller then reads through the cache as it would without this.
    """

    def __init__(self, fd: int, size: int) -> None:
        self.addr: int | None = None
        self.size = size
        self.page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else ALIGN
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            self._mincore, self._munmap = libc.mincore, libc.munmap
            mmap_ = libc.mmap
        except (OSError, AttributeError):
            return
        mmap_.restype = ctypes.c_void_p
        mmap_.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        self._mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        self._munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        if size <= 0:
            return
        import mmap

        addr = mmap_(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr is not None and addr != ctypes.c_void_p(-1).value:
            self.addr = addr

    def resident(self, start: int, stop: int) -> bool:
        """The first, middle and last pages of ``[start, stop)`` are in the page cache (True where it cannot
        tell). Three pages, not all: ``mincore`` costs about 60 ns a page here (35 us for a 2 MiB window,
        a tenth of reading it from the cache), and a wrong guess only picks the slower of two correct reads."""
        if self.addr is None or stop > self.size or stop <= start:
            return True
        page = ctypes.c_ubyte()
        for at in (start, (start + stop) // 2, stop - 1):
            if self._mincore(self.addr + at - at % self.page, 1, ctypes.byref(page)) != 0:
                return True
            if not page.value & 1:  # bit 0: resident (the others are reserved)
                return False
        return True

    def close(self) -> None:
        if self.addr is not None:
            self._munmap(self.addr, self.size)
            self.addr = None
