"""A new data file written front to back with ``O_DIRECT`` through an aligned staging buffer.

Why (measured on the 2-core, one-virtual-disk machine, 4.67 GB reshard, warm source): the data
must be on disk before the folder is committed (every file is fsynced), so the disk bounds the
run: ``dd ... conv=fdatasync`` writes 0.35-0.45 GB/s there, ``dd ... oflag=direct`` 0.53 GB/s.
Written through the page cache, the kernel only starts writing back after 10 % of memory is
dirty, so for the first 2 GB the disk idled and the final fsyncs waited 5.5 s per worker (11 s
of 34 thread-seconds); starting writeback per chunk (``posix_fadvise(DONTNEED)`` or
``sync_file_range``) moved that wait into the writes (16-18.6 s wall, about 0.29 GB/s). The
page-cache copy and writeback also took a third of the CPU (sys 7-8 s of 14 s) on cores that other
jobs share. ``O_DIRECT`` writes go from our buffer to the disk: no copy into the page cache, no
dirty-page writeback, and the fsync at the end only flushes the disk cache and the metadata.

``O_DIRECT`` needs the buffer address, file offset and length aligned to the device's logical
block (512 B or 4 KiB; :data:`ALIGN` covers both), and the files here are a byte stream with
records of any length. So everything is copied into a :data:`ALIGN`-aligned staging buffer and
written a whole number of blocks at a time; the remainder (under one block) moves to the front.
The last block is written padded with zeros and the file cut back to its real size with
``ftruncate``. A file system that refuses ``O_DIRECT`` (tmpfs before Linux 6.6, some FUSE and
network file systems, any OS without it) or a write it refuses with ``EINVAL`` (e.g. a short write
that left the offset unaligned) switches the file to ordinary buffered writes for the rest; the
bytes and the checksum are the same either way. A full disk (``ENOSPC``, ``EDQUOT``, ``EFBIG``) and
any other error propagate as before: the caller removes the partial output.

The CRC-32C of the file (the manifest's checksum) is computed from the bytes as they are handed
in, so nothing is read back. With ``segments``, so is the xxh3-128 of every run of bytes between
two :meth:`Sink.cut` calls: the runtime's DCP stream cuts where DCP asks for its offset, at the
start and end of every item, so each chunk's record hash is computed as its bytes pass
(:mod:`gtp_runtime.checkpoint.direct_fs`) and the save reads nothing back.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

from gtp_format.hashing import CRCS, KNOWN_MIN, Crc, recall
from gtp_format.integrity.hash import chunk_hasher
from gtp_format.integrity.stats import BLOCK_BYTES
from gtp_format.manifest import HASH_ALGORITHM, FileEntry

ALIGN = 4096
STAGE = 16 << 20  # staging per file: 16 MiB direct writes run at the disk's speed
# a copy's staging per buffer (reshard, export, import: :func:`stage_bytes`), where its chunks allow: the lent
# 16-core host's disk (ext4 on one virtual disk) took 2.16 GB/s from 8 streams of 16 MiB O_DIRECT writes and
# 2.35 from 8 of 64 MiB, 2.30 already from 2 of 64 MiB (benchmarks/disk_ceiling.py): the bytes in flight, not
# the streams, set its rate, and a reshard's 8 sinks of 16 MiB wrote 2.11 GB/s, the 16 MiB figure
COPY_STAGE = 32 << 20
DIRECT_MIN = 4 << 20  # smaller stages (budgets under 64 MiB) write through the page cache: 1 MiB
# direct writes, each waiting for the disk, made a 2.25 GB reshard at a 16 MiB budget 7.6-8.1 s
# where buffered writes took 6.4-7.2 s
_IOV_MAX = 1024
# bytes hashed and copied together: a core's L2 here (1 MiB; 2 MiB on the H200 host); the statistics' block,
# so that a chunk's pieces are its statistics' blocks (StatsStream never copies a piece to complete one)
PIECE = BLOCK_BYTES


def new_file(path: Path) -> int:
    """A new file for writing (``O_EXCL``: never an existing one)."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)


def _write_all(fd: int, parts: list[Any]) -> None:
    """``writev`` until every byte of ``parts`` is written (a regular file may take fewer)."""
    views = [memoryview(b).cast("B") for b in parts]
    while views:
        n = os.writev(fd, views[:_IOV_MAX])
        while views and n >= views[0].nbytes:
            n -= views[0].nbytes
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    """``pwrite`` every byte of ``view`` at ``offset`` (a regular file may take fewer at a time)."""
    done = 0
    while done < view.nbytes:
        done += os.pwrite(fd, view[done:], offset + done)


def _try_direct(fd: int) -> bool:
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return False
    import fcntl

    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | flag)
    except OSError:
        return False
    return True


# file systems whose files live in memory (``statfs`` magic numbers): tmpfs (``/dev/shm``) and ramfs
_MEMORY_FS = frozenset({0x01021994, 0x858458F6})


@cache
def _fstatfs() -> Any:
    import ctypes

    try:
        return ctypes.CDLL(None, use_errno=True).fstatfs
    except (OSError, AttributeError):
        return None


def memory_backed(fd: int) -> bool:
    """Whether ``fd``'s file lives in memory (tmpfs, ramfs), where ``O_DIRECT`` gains nothing: no disk to reach,
    no dirty pages to write back, while the staging copy it needs is a pass over every byte.

    Why: tmpfs takes ``O_DIRECT`` (Linux 6.6 on) and does a buffered write under it, so a reshard into
    ``/dev/shm`` staged every byte for nothing: the staging copy was 0.16 of its 2.8 CPU s/GB, the writes
    themselves no cheaper (2-core machine, 3.05 GB, ``benchmarks/copy_cpu_stages.py``). False where it cannot
    tell (no ``fstatfs``): the default, ``O_DIRECT``, is then kept."""
    import ctypes
    import struct

    fstatfs = _fstatfs()
    if fstatfs is None:
        return False
    buf = ctypes.create_string_buffer(256)  # struct statfs is 120 bytes on 64-bit Linux; f_type comes first
    if fstatfs(fd, buf) != 0:
        return False
    return struct.unpack_from("l", buf.raw)[0] in _MEMORY_FS


def _set_buffered(fd: int) -> None:
    import fcntl

    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~getattr(os, "O_DIRECT", 0))


def stage_bytes(chunk_bytes: int) -> int:
    """Staging per buffer for a writer whose chunks are ``chunk_bytes``: at most half a chunk, so
    a worker's two staging buffers add one chunk to the two it reads into, three of the four its
    share of ``--max-memory`` allows (a full four measured 18 MiB of data at a 16 MiB budget); at most
    :data:`COPY_STAGE` (each buffer is one write in flight)."""
    return min(COPY_STAGE, chunk_bytes // 2)


@cache
def _zero_piece() -> memoryview:
    """:data:`PIECE` zero bytes, made once (read-only: shared by every sink's thread)."""
    return memoryview(bytes(PIECE))


@cache
def _zero_stage(size: int) -> np.ndarray:
    """``size`` aligned zero bytes, made once per size and never written to: a staged sink's whole buffers of
    zeros are written from it (:meth:`Sink.write_zeros`), not set in its own staging buffer first (a pass over
    each byte of an import's fresh Adam moments, half of what it writes)."""
    raw = np.zeros(size + ALIGN, dtype=np.uint8)
    skip = -raw.ctypes.data % ALIGN
    return raw[skip:skip + size]


def _aligned(size: int) -> np.ndarray:
    raw = np.empty(size + ALIGN, dtype=np.uint8)
    skip = -raw.ctypes.data % ALIGN
    return raw[skip:skip + size]


class Sink:
    """A new file (``O_EXCL``): :meth:`write` bytes in order, :meth:`close` for its manifest entry.

    ``stage``: bytes per staging buffer (rounded to :data:`ALIGN`); there are two, so one is
    written by this file's writer thread while the caller fills the other (the disk never waits
    for the CPU work between two writes); the caller counts ``2 * stage`` in its memory budget.
    ``direct``: ``O_DIRECT`` if the file system takes it (default: for stages of at least
    :data:`DIRECT_MIN` on a file system that is not in memory, :func:`memory_backed`), else through the page
    cache from the start, with no staging copy: the caller's bytes are written as they are handed in;
    ``checksum=False`` skips the CRC-32C (a file no manifest lists: the entry's checksums are then empty).
    ``segments``: also hash each run of bytes between two :meth:`cut` calls into :attr:`segments`
    (``(start, stop) -> xxh3-128 hex``, the chunk hash of :mod:`gtp_format.integrity.hash`).
    """

    def __init__(self, path: Path, stage: int, direct: bool | None = None, checksum: bool = True,
                 segments: bool = False, fd: int | None = None, start: int = 0) -> None:
        self.path = path
        self._owns_fd = fd is None  # ``fd``, ``start``: a run of a shared file (:class:`RunSink`)
        self.fd = new_file(path) if fd is None else fd
        self.start = start
        self.pos = start  # file offset of the next byte handed in
        self._crc, self._value = (CRCS[HASH_ALGORITHM] if checksum else None), 0
        self.segments: dict[tuple[int, int], str] = {}
        self._seg, self._seg_start = (chunk_hasher() if segments else None), start
        in_memory = direct is None and stage >= DIRECT_MIN and memory_backed(self.fd)
        if direct is None:
            direct = stage >= DIRECT_MIN and not in_memory
        self.direct = direct and _try_direct(self.fd)
        self._staged = self.direct  # False: plain writes, no staging copy
        self._pending: Future[None] | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._fill = start % ALIGN  # bytes in the current buffer, which starts at file offset ``_base`` (aligned)
        self._base = start - self._fill
        # in memory: each piece is written from the caller's bytes by the writer thread, at its offset, while the
        # caller hashes the next one; :meth:`write` returns once all are written (the caller may then reuse them)
        self._behind: list[Future[None]] | None = [] if in_memory else None
        if self._staged:
            size = max(ALIGN, stage - stage % ALIGN)
            self._bufs, self._cur = [_aligned(size), _aligned(size)], 0
        if self._staged or self._behind is not None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sink")

    def write(self, parts: list[Any], on_piece: Callable[[memoryview], None] | None = None) -> None:
        """Append ``parts`` (bytes-like, each C-contiguous) in order.

        With ``segments`` (or ``on_piece``), each part is walked :data:`PIECE` bytes at a time, and each
        piece gets its CRC-32C, its segment hash, ``on_piece`` (the save's chunk statistics:
        :class:`gtp_format.integrity.stats.StatsStream`) and its copy (or write) before the next, so the
        later passes read it from the CPU cache rather than from memory. Measured with
        ``benchmarks/bench_sink.py`` (one thread, 2.15 GB in 64 MiB parts into tmpfs, best of 5, on the
        16-core H200 host): the chunk records' cost went from +38 % to +15 % of the sink's time. Without
        them each pass takes the whole part (small writes made that case 10 % slower there).

        Why 1 MiB pieces (a core's L2 on this 2-core machine): 256 KiB pieces cost 0.02 CPU s more per
        512 MB in Python calls (the same benchmark, ``--direct``, here, 9 rounds twice), about a fifth
        of what the records added to a CPU save."""
        try:
            for p in parts:
                v = memoryview(p).cast("B")
                known = recall(self._crc.name, v) if self._crc is not None and v.nbytes >= KNOWN_MIN else None
                if self._seg is None and on_piece is None:
                    if self._crc is not None and known is None:
                        self._value = self._crc.update(v, self._value)
                    self._put_bytes(v)
                else:
                    self._pieces(v, on_piece, self._crc if known is None else None)
                if known is not None and self._crc is not None:  # hashed as it was read: combined, not hashed again
                    self._value = self._crc.combine(self._value, known, v.nbytes)
        except BaseException:
            self._drain(raise_errors=False)  # the caller's error is the one to report
            raise
        self._drain()

    def _pieces(self, v: memoryview, on_piece: Callable[[memoryview], None] | None, crc: Crc | None) -> None:
        """One part, :data:`PIECE` bytes at a time: each piece's CRC-32C (``crc``; None where the part's is
        known), segment hash, ``on_piece`` and copy, one piece after another (see :meth:`write`)."""
        for at in range(0, v.nbytes, PIECE):
            piece = v[at:at + PIECE]
            if crc is not None:
                self._value = crc.update(piece, self._value)
            if self._seg is not None:
                self._seg.update(piece)
            if on_piece is not None:
                on_piece(piece)
            self._put_bytes(piece)

    def write_zeros(self, nbytes: int) -> None:
        """Append ``nbytes`` zero bytes, the same file and hashes as ``write([bytes(nbytes)])`` for less work: the
        CRC-32C is combined from its zero-byte operator (no pass over the bytes), the segment hash takes them
        from one cached zero piece, and the staging buffer is set, not copied into; whole staging buffers of them
        are written from one shared zero buffer (:func:`_zero_stage`), not set. What an import's fresh Adam
        moments are (half of a 4 GB import's bytes): measured in docs/performance.md."""
        if self._crc is not None:
            self._value = self._crc.zeros(self._value, nbytes)
        if self._seg is not None:
            zero = _zero_piece()
            for at in range(0, nbytes, PIECE):
                self._seg.update(zero[:min(PIECE, nbytes - at)])
        self.pos += nbytes
        if not self._staged:
            zero = _zero_piece()
            for at in range(0, nbytes, PIECE):
                piece = zero[:min(PIECE, nbytes - at)]
                if self._behind is None:
                    _write_all(self.fd, [piece])
                else:
                    _pwrite_all(self.fd, piece, self.pos - nbytes + at)
            return
        while nbytes:
            buf = self._bufs[self._cur]
            if self._fill == 0 and nbytes >= buf.size:  # a whole buffer of zeros: written from the shared one
                zeros = _zero_stage(buf.size)
                self._wait()
                assert self._pool is not None
                self._pending = self._pool.submit(self._put, zeros, buf.size, self._base)
                self._base += buf.size
                nbytes -= buf.size
                continue
            n = min(nbytes, buf.size - self._fill)
            buf[self._fill:self._fill + n] = 0
            self._fill += n
            nbytes -= n
            if self._fill == buf.size:
                self._flip(final=False)

    def _put_bytes(self, v: memoryview) -> None:
        at = self.pos
        self.pos += v.nbytes
        if self._staged:
            self._stage(v)
        elif self._behind is not None and self._pool is not None:
            self._behind.append(self._pool.submit(_pwrite_all, self.fd, v, at))
        else:
            _write_all(self.fd, [v])

    def _drain(self, raise_errors: bool = True) -> None:
        """Wait for the pieces handed to the writer thread (in memory); the first error is raised."""
        if not self._behind:
            return
        behind, self._behind = self._behind, []
        errors = [e for e in (fut.exception() for fut in behind) if e is not None]
        if errors and raise_errors:
            raise errors[0]

    def _stage(self, v: memoryview) -> None:
        src = np.frombuffer(v, dtype=np.uint8)
        at = 0
        while at < src.size:
            buf = self._bufs[self._cur]
            n = min(src.size - at, buf.size - self._fill)
            buf[self._fill:self._fill + n] = src[at:at + n]
            self._fill += n
            at += n
            if self._fill == buf.size:
                self._flip(final=False)

    def cut(self) -> int:
        """End the current segment here (recorded if it holds bytes) and start the next; the position."""
        if self._seg is not None and self.pos > self._seg_start:
            self.segments[(self._seg_start, self.pos)] = self._seg.hexdigest()
            self._seg.reset()
        self._seg_start = self.pos
        return self.pos

    def _flip(self, final: bool) -> None:
        """Hand the current buffer's whole blocks (everything, if ``final``) to the writer thread and
        go on in the other buffer, starting with the remainder (under one block)."""
        buf, fill = self._bufs[self._cur], self._fill
        n = fill if final else fill - fill % ALIGN
        self._wait()  # the other buffer is free once its write is done
        rest = fill - n
        self._bufs[1 - self._cur][:rest] = buf[n:fill]
        assert self._pool is not None
        self._pending = self._pool.submit(self._put, buf, n, self._base)
        self._cur, self._base, self._fill = 1 - self._cur, self._base + n, rest

    def _put(self, buf: np.ndarray, n: int, offset: int) -> None:
        """``pwrite`` ``buf[:n]`` at ``offset``; while direct, padded with zeros to a whole block
        (only the file's last write is not whole blocks; :meth:`close` cuts the padding)."""
        done = 0
        while done < n:
            if self.direct:
                end = n + (-n % ALIGN)
                buf[n:end] = 0
                try:
                    done += os.pwrite(self.fd, memoryview(buf[done:end]), offset + done)
                    continue
                except OSError as e:
                    if e.errno != errno.EINVAL:
                        raise
                    # O_DIRECT refused (an unaligned offset after a short write, a file system that
                    # takes the flag but not the write): the rest of the file goes through the page cache
                    self.direct = False
                    _set_buffered(self.fd)
            done += os.pwrite(self.fd, memoryview(buf[done:n]), offset + done)

    def _wait(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def close(self) -> FileEntry:
        """Write what is staged, cut the padding, ``fsync``; the file's size and CRC-32C."""
        try:
            if self._staged:
                if self._fill:
                    self._flip(final=True)
                self._wait()
            if os.fstat(self.fd).st_size != self.pos:  # the last block went out padded
                os.ftruncate(self.fd, self.pos)
            os.fsync(self.fd)
            self.cut()
            size = os.fstat(self.fd).st_size
            if size != self.pos:  # what the read-back once caught, for the price of one fstat (see direct_fs)
                raise OSError(errno.EIO, f"{size} bytes on disk after fsync, {self.pos} written", str(self.path))
        finally:
            self.abort()
        sums = {HASH_ALGORITHM: f"{self._value:08x}"} if self._crc is not None else {}
        return FileEntry(size=self.pos, checksums=sums)

    def abort(self) -> None:
        """Close the file (after the write in flight, whose error the caller's own supersedes)."""
        if self._pool is not None:
            pool, self._pool = self._pool, None
            try:
                self._wait()
            except OSError:
                pass
            finally:
                pool.shutdown(wait=True)
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            if self._owns_fd:
                os.close(fd)

    def __enter__(self) -> Sink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.abort()


class RunSink(Sink):
    """Bytes ``[start, ...)`` of a file that other runs write beside it on their own threads (:class:`SharedFile`):
    a large file written by several threads at once, each with its own staging buffers and writer thread.

    What :class:`Sink` writes from ``start`` on, with these differences: the file is the shared one's (opened
    there, ``O_DIRECT`` decided there); nothing is cut back or fsynced here (:meth:`SharedFile.finish` does it
    once); the CRC-32C is this run's bytes' alone (``close().checksums``, combined in file order by ``finish``);
    and a block this run shares with a neighbour (the one ``start`` falls in, unless aligned, and the one its last
    byte falls in, unless it ends on a block boundary) is not written but kept in :attr:`edges` as ``(file offset,
    bytes)``: ``finish`` writes each such block whole once every run is done, so no two threads write one block
    (``O_DIRECT`` writes whole blocks). Without ``O_DIRECT`` (a file system in memory, small stages) every byte is
    written at its own offset (``pwrite``), and there are no edges.

    Why: megatron-core's ``torch_dist`` layout has one file per rank and those files are unequal (a
    ``dp_reshardable`` checkpoint's DP rank 0 holds the model weights besides its optimizer shard: twice the bytes
    of the others), so one thread per file left a 16-core machine's disk waiting on the two largest files' threads.
    """

    def __init__(self, shared: SharedFile, start: int, stage: int, checksum: bool = True,
                 segments: bool = False) -> None:
        super().__init__(shared.path, stage, direct=shared.direct, checksum=checksum, segments=segments,
                         fd=shared.fd, start=start)
        self.edges: list[tuple[int, bytes]] = []
        self._head = start % ALIGN if self._staged else 0  # bytes of the first block that belong to earlier runs
        if not self._staged and self._behind is None:  # plain writes go to their offsets, never the file position
            self._behind = []
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sink")

    def _flip(self, final: bool) -> None:
        """As :meth:`Sink._flip`, whole blocks only: a first block that begins before ``start`` and a last one
        left partial at the end are kept in :attr:`edges`."""
        buf, fill, base = self._bufs[self._cur], self._fill, self._base
        n = fill - fill % ALIGN
        self._wait()
        skip = 0
        if self._head:
            skip = min(ALIGN, fill)
            if skip > self._head:
                self.edges.append((base + self._head, bytes(buf[self._head:skip])))
            self._head = 0
        if final and fill > max(n, skip):
            self.edges.append((base + max(n, skip), bytes(buf[max(n, skip):fill])))
        rest = fill - n
        if not final:
            self._bufs[1 - self._cur][:rest] = buf[n:fill]
        if n > skip:
            assert self._pool is not None
            self._pending = self._pool.submit(self._put, buf[skip:], n - skip, base + skip)
        self._cur, self._base, self._fill = 1 - self._cur, base + n, rest

    def close(self) -> FileEntry:
        """Everything of this run written (but its :attr:`edges`); its length and CRC-32C."""
        try:
            if self._staged:
                if self._fill > self._head:
                    self._flip(final=True)
                self._wait()
            else:
                self._drain()
            self.cut()
        finally:
            self.abort()
        sums = {HASH_ALGORITHM: f"{self._value:08x}"} if self._crc is not None else {}
        return FileEntry(size=self.pos - self.start, checksums=sums)


class SharedFile:
    """A new file of ``size`` bytes written as runs (:class:`RunSink`) by several threads at once, then
    :meth:`finish` ed once: the same file, size and CRC-32C as one :class:`Sink` writing every byte in order."""

    def __init__(self, path: Path, stage: int, size: int, direct: bool | None = None) -> None:
        self.path, self.size = path, size
        self.fd = new_file(path)
        try:
            if direct is None:  # as a Sink of this stage decides
                direct = stage >= DIRECT_MIN and not memory_backed(self.fd)
            self.direct = direct and _try_direct(self.fd)
        except BaseException:
            self.abort()
            raise

    def run(self, start: int, stage: int, checksum: bool = True, segments: bool = False) -> RunSink:
        return RunSink(self, start, stage, checksum, segments)

    def finish(self, runs: list[tuple[int, FileEntry, list[tuple[int, bytes]]]]) -> FileEntry:
        """The file from its runs (``(start, run's entry, run's edges)``, every run closed): the shared blocks
        written, the padding cut, ``fsync``; its size and CRC-32C (the runs' combined in order). Runs that do not
        tile ``[0, size)`` exactly, or edges that do not fill their blocks, are an ``AssertionError`` (a planning
        bug: nothing is written then)."""
        try:
            pos, value, checksum = 0, 0, bool(runs) and all(r[1].checksums for r in runs)
            crc = CRCS[HASH_ALGORITHM]
            blocks: dict[int, bytearray] = {}
            filled: dict[int, int] = {}
            for start, entry, edges in sorted(runs, key=lambda r: r[0]):
                if start != pos:
                    raise AssertionError(f"{self.path}: a run starts at {start}, the one before ended at {pos}")
                pos += entry.size
                if checksum:
                    value = crc.combine(value, int(entry.checksums[HASH_ALGORITHM], 16), entry.size)
                for at, data in edges:
                    block = at - at % ALIGN
                    if at % ALIGN + len(data) > ALIGN:
                        raise AssertionError(f"{self.path}: an edge of {len(data)} bytes at {at} crosses a block")
                    blocks.setdefault(block, bytearray(ALIGN))[at - block:at - block + len(data)] = data
                    filled[block] = filled.get(block, 0) + len(data)
            if pos != self.size:
                raise AssertionError(f"{self.path}: runs of {pos} bytes for a {self.size}-byte file")
            for block, got in filled.items():
                if got != min(ALIGN, self.size - block):
                    raise AssertionError(f"{self.path}: {got} bytes of edges for the block at {block}")
            buf = _aligned(ALIGN)
            for block, data in sorted(blocks.items()):
                n = min(ALIGN, self.size - block)
                buf[:] = np.frombuffer(data, dtype=np.uint8)
                if self.direct:
                    try:
                        _pwrite_all(self.fd, memoryview(buf), block)  # a whole block: past the end, cut below
                        continue
                    except OSError as e:
                        if e.errno != errno.EINVAL:
                            raise
                        self.direct = False
                        _set_buffered(self.fd)
                _pwrite_all(self.fd, memoryview(buf[:n]), block)
            if os.fstat(self.fd).st_size != self.size:
                os.ftruncate(self.fd, self.size)
            os.fsync(self.fd)
            size = os.fstat(self.fd).st_size
            if size != self.size:
                raise OSError(errno.EIO, f"{size} bytes on disk after fsync, {self.size} written", str(self.path))
        finally:
            self.abort()
        return FileEntry(size=self.size, checksums={HASH_ALGORITHM: f"{value:08x}"} if checksum else {})

    def abort(self) -> None:
        """Close the file (each run's writes are done once its sink is closed or aborted)."""
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)
