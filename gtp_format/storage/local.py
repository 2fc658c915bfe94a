"""A checkpoint in a local folder: confined, bounded access to every file a reader opens in it.

The local side of :class:`gtp_format.storage.base.LocalStorage`. A checkpoint's metadata names its data
files and byte ranges, and a checkpoint may come from anywhere. The rules, enforced here and nowhere else:

* A recorded path must be a plain relative path (no ``..``, no absolute path, no NUL).
* It is opened *relative to the folder's descriptor*, one component at a time, each with
  ``O_NOFOLLOW``. A symlink is never followed by the kernel: it is read with ``readlink`` and its
  target resolved here, and only a target that stays inside the folder is walked (at most
  :data:`MAX_LINKS` links per path). So a link that leads out, or a folder swapped for a link
  after a check, cannot make us read outside: there is no name-based check followed by a second
  open of the same name.
* What was opened is what is checked: ``fstat`` on the open descriptor must say regular file.
  FIFOs, devices and directories are refused (a FIFO would block a reader forever; the open is
  non-blocking so that even the open cannot hang).
* A byte range is checked against the open file's real size before one byte is read, and a whole
  small file is read only up to its limit, so no size written in a file can make us allocate.
* What may be *allocated* or *read* is bounded by what a file really stores, not by its size: a
  sparse file (``truncate -s 16T``) has any size for free, and budgets taken from ``st_size`` let
  every memory class come back behind one. :func:`stored_bytes` is ``st_blocks * 512`` capped by
  ``st_size``; :func:`read_budget` is the hole factor (:data:`gtp_format.storage.limits.HOLE_FACTOR`) times
  that (plus :data:`SPARSE_SLACK`).
  A read, an allocation or a whole-file pass larger than the budget is refused.
* Holes are *not* evidence of damage. Writers leave long zero runs as holes (``migrate-aliased``'s
  reset moments), ``cp`` keeps them, and compressing or deduplicating filesystems (ZFS, btrfs, some
  network filesystems) report fewer blocks for good data; holes read back as zeros. Whether data is
  right is decided by checksums and chunk hashes alone. The budget only stops a reader from
  spending time and memory on far more bytes than the file stores: a legitimate file with zeroed
  Adam moments stores about a third of its size, a 16 TiB bomb a few kilobytes.
"""

from __future__ import annotations

import errno
import io
import os
import posixpath
import stat
from pathlib import Path
from typing import BinaryIO

from gtp_format.errors import ChunkError, FormatError
from gtp_format.reader.preads import Into, read_direct, read_fully
from gtp_format.storage.limits import HOLE_FACTOR_ENV, Limits, hole_factor
from gtp_format.storage.paths import past_end_message, unsafe_reason

MAX_LINKS = 8  # symlink hops one path may take inside the folder
SPARSE_SLACK = 1 << 20  # reads this small are never refused as sparse (tiny files may store inline, in 0 blocks)
_O_FILE = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)
_O_DIR = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)


def _open_at(name: str, flags: int, dir_fd: int) -> int:
    """The one ``open`` every read goes through (tests simulate OS refusals here)."""
    return os.open(name, flags, dir_fd=dir_fd)


class _Outside(Exception):
    """A symlink on the way leads out of the folder (or loops)."""


def _open_root(root: Path) -> int:
    try:
        return os.open(root, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise FormatError(f"{root} does not exist; pass a checkpoint folder (iter_XXXXXXX) or its parent") from None
    except NotADirectoryError:
        raise FormatError(f"{root} is not a folder; pass the iter_XXXXXXX folder or its parent") from None
    except OSError as e:
        raise FormatError(f"cannot open folder {root}: {e.strerror}") from None


def _walk(root_fd: int, rel: str, want_dir: bool, stat_only: bool = False) -> int | os.stat_result:
    """Open ``rel`` below the folder ``root_fd`` without letting the kernel follow any symlink.

    Returns a descriptor (the caller closes it), or with ``stat_only`` the final component's
    ``lstat`` after resolving links inside the folder, without opening it (``inspect`` promises
    never to open a data file). Raises ``_Outside`` for a link that leaves the folder, ``OSError``
    for anything else (missing, permission...).
    """
    parts = [p for p in rel.split("/") if p not in ("", ".")]
    hops = 0
    while True:
        done: list[str] = []  # components walked so far, relative to the root
        fd = os.dup(root_fd)
        try:
            for i, part in enumerate(parts):
                last = i == len(parts) - 1
                try:
                    if last and stat_only:
                        st = os.stat(part, dir_fd=fd, follow_symlinks=False)
                        if not stat.S_ISLNK(st.st_mode):
                            return st
                        raise OSError(errno.ELOOP, "symbolic link")
                    nfd = _open_at(part, _O_DIR if (want_dir or not last) else _O_FILE, fd)
                except OSError as e:
                    if e.errno not in (errno.ELOOP, errno.EMLINK, errno.ENOTDIR):
                        raise
                    try:
                        target = os.readlink(part, dir_fd=fd)
                    except OSError:
                        raise e from None  # not a link: a real ENOTDIR
                    hops += 1
                    if hops > MAX_LINKS or target.startswith("/"):
                        raise _Outside(target) from None
                    joined = posixpath.normpath(posixpath.join(*done, target) if done else target)
                    if joined == ".." or joined.startswith("../"):
                        raise _Outside(target) from None
                    parts = [p for p in joined.split("/") if p not in ("", ".")] + parts[i + 1:]
                    break
                os.close(fd)
                fd = nfd
                done.append(part)
            else:
                out, fd = fd, -1
                return out
        finally:
            if fd >= 0:
                os.close(fd)


def _open_in(root: Path, rel: str, what: str, want_dir: bool = False) -> int:
    """A descriptor for ``rel`` inside ``root``, regular file (or folder) checked on the descriptor."""
    reason = unsafe_reason(rel)
    if reason is not None:
        raise ChunkError(f"{reason}: refusing to read outside {root}", file=str(rel))
    root_fd = _open_root(root)
    try:
        fd = _walk(root_fd, rel, want_dir)
        assert isinstance(fd, int)
    except _Outside as e:
        raise ChunkError(f"{what} {root / rel} is a symlink to {e.args[0]!r}, outside the checkpoint folder; "
                         "refusing to read it (copy the real file into the folder)", file=rel) from None
    except FileNotFoundError:
        raise ChunkError(f"{what} {rel} is missing from {root}", file=rel) from None
    except OSError as e:
        raise ChunkError(f"cannot open {what} {rel} in {root}: {e.strerror}", file=rel) from None
    finally:
        os.close(root_fd)
    mode = os.fstat(fd).st_mode
    if not (stat.S_ISDIR(mode) if want_dir else stat.S_ISREG(mode)):
        os.close(fd)
        kind = "a folder" if want_dir else "a regular file"
        raise ChunkError(f"{what} {root / rel} is not {kind}", file=rel)
    return fd


def stored_bytes(st: os.stat_result) -> int:
    """Bytes a file really stores: its allocated blocks (``st_blocks`` counts 512-byte units on
    Linux and the BSDs), capped by its size. A hole costs the attacker nothing and the reader a
    zeroed page per 4 KiB, so every budget taken from a file is taken from this, never ``st_size``.

    Filesystems that compress (btrfs, ZFS) or report blocks late (ZFS until its transaction
    commits) can under-report; the refusals built on this say so and name the fix.
    """
    blocks = getattr(st, "st_blocks", None)
    return st.st_size if blocks is None else min(st.st_size, blocks * 512)


# ``factor`` below: the session's hole factor (:attr:`gtp_format.storage.limits.Limits.hole_factor`); None reads
# the environment's now (:func:`gtp_format.storage.limits.hole_factor`), for a caller without a session


def budget_of(stored: int, factor: int | None = None) -> int:
    """Bytes a reader may go through (read, hash or allocate) behind ``stored`` bytes on disk."""
    return stored * (hole_factor() if factor is None else factor) + SPARSE_SLACK


def read_budget(st: os.stat_result, factor: int | None = None) -> int:
    """:func:`budget_of` a file's :func:`stored_bytes`."""
    return budget_of(stored_bytes(st), factor)


def readable_bytes(st: os.stat_result, factor: int | None = None) -> int:
    """The part of a file a reader may go through: its size, capped by its :func:`read_budget`."""
    return min(st.st_size, read_budget(st, factor))


def is_sparse(st: os.stat_result, factor: int | None = None) -> bool:
    """A file whose size exceeds its :func:`read_budget`: going through it would spend time (and,
    sized by it, memory) on many times more holes than it stores. Fewer holes than that are read
    as the zeros they are, and the checksums judge them."""
    return st.st_size > read_budget(st, factor)


def sparse_file_message(rel: str, st: os.stat_result, factor: int | None = None) -> str:
    factor = hole_factor() if factor is None else factor
    return (f"{rel} stores only {stored_bytes(st)} of its {st.st_size} bytes (a sparse file: over {factor}x "
            "more holes than data, a bound on the time spent reading them, not a verdict on the data); restore it "
            f"from a good copy, or, if it is genuine and its filesystem compresses, copy it with `cp --sparse=never` "
            f"to one that does not or raise {HOLE_FACTOR_ENV}")


def sparse_message(rel: str, length: int, st: os.stat_result, factor: int | None = None) -> str:
    factor = hole_factor() if factor is None else factor
    return (f"{rel}: a {length}-byte read, but the file stores only {stored_bytes(st)} of its {st.st_size} bytes "
            f"(a sparse file: a read over {factor}x what it stores is refused); the metadata declares more "
            "than was written: restore the file from a good copy (on a compressing filesystem, copy the checkpoint "
            f"to one that does not, or raise {HOLE_FACTOR_ENV})")


def regular_stat(root: Path, rel: str) -> os.stat_result | None:
    """The confined ``stat`` of a regular file inside ``root`` (``None`` when it is not one)."""
    try:
        root_fd = _open_root(root)
    except FormatError:
        return None
    try:
        st = _walk(root_fd, rel, want_dir=False, stat_only=True)
    except (OSError, _Outside):
        return None
    finally:
        os.close(root_fd)
    assert isinstance(st, os.stat_result)
    return st if stat.S_ISREG(st.st_mode) else None


class LocalFile(io.BufferedReader):
    """A regular file opened inside a folder (what ``os.fdopen(fd, "rb")`` gives), with the methods every
    opened checkpoint file has (:class:`gtp_format.storage.objects.ObjectFile` has them too), so that no reader
    asks which kind of store a file came from."""

    remote = False  # a read is no round trip: nothing to plan or fetch ahead (the page cache reads ahead)
    limits: Limits | None = None  # its storage's (the session's): the hole factor; None: the environment's

    @property
    def size(self) -> int:
        """The size of the file as it is now (``fstat`` of the open descriptor)."""
        return os.fstat(self.fileno()).st_size

    def stream_small_reads(self) -> None:
        """Nothing to do: the page cache serves small reads already."""

    def pread(self, n: int, offset: int) -> bytes:
        """``os.pread`` of the open descriptor."""
        return os.pread(self.fileno(), n, offset)

    def read_into(self, rel: str, size: int, offset: int, out: memoryview) -> None:
        """Fill ``out`` from ``offset`` (``size``: the file's size when opened), the range checked first; a file
        that shrank since is a :class:`ChunkError`, never a short read."""
        length = out.nbytes
        if type(offset) is not int or offset < 0 or offset + length > size:
            raise ChunkError(past_end_message(rel, offset, length, size), file=rel)
        fd, done = self.fileno(), 0
        while done < length:
            got = os.preadv(fd, [out[done:]], offset + done)
            if got <= 0:
                raise ChunkError(f"data file {rel} shrank while reading [{offset}, {offset + length})", file=rel)
            done += got

    def sparse_message(self, rel: str) -> str | None:
        """Why going through this file is refused (:func:`is_sparse`: many more holes than data), or None."""
        st = os.fstat(self.fileno())
        factor = self._factor()
        return sparse_file_message(rel, st, factor) if is_sparse(st, factor) else None

    def readable_bytes(self) -> int:
        """The part of the file a reader may go through (:func:`readable_bytes`)."""
        return readable_bytes(os.fstat(self.fileno()), self._factor())

    def _factor(self) -> int | None:
        return None if self.limits is None else self.limits.hole_factor


def open_path(path: Path) -> BinaryIO:
    """``open(path, "rb")`` (its errors too) as a :class:`LocalFile`: for a file a caller has checked itself."""
    raw = open(path, "rb", buffering=0)  # noqa: SIM115 - the LocalFile owns it
    return LocalFile(raw, _buffer_size(raw))  # type: ignore[return-value]


def _buffer_size(raw: io.FileIO) -> int:
    try:
        block = os.fstat(raw.fileno()).st_blksize  # the buffer os.fdopen and open would give it
    except OSError:
        block = 0
    return block if block > 1 else io.DEFAULT_BUFFER_SIZE


def open_file(root: Path, rel: str, what: str = "data file", limits: Limits | None = None) -> BinaryIO:
    """Open a regular file inside ``root`` for reading (see the module docstring for the rules); ``limits``: its
    storage's."""
    raw = os.fdopen(_open_in(root, rel, what), "rb", buffering=0)
    f = LocalFile(raw, _buffer_size(raw))
    f.limits = limits
    return f  # type: ignore[return-value]


def file_size(root: Path, rel: str, what: str = "data file") -> int:
    """Size of a regular file inside ``root``, from the descriptor that was opened."""
    fd = _open_in(root, rel, what)
    try:
        return os.fstat(fd).st_size
    finally:
        os.close(fd)


def is_folder(root: Path, rel: str) -> bool:
    """Whether ``rel`` is a folder reachable inside ``root`` (symlinks resolved inside only)."""
    try:
        os.close(_open_in(root, rel, "folder", want_dir=True))
    except FormatError:
        return False
    return True


def read_range(root: Path, rel: str, offset: int, length: int, into: Into | None = None,
               limits: Limits | None = None, cached: bool = False) -> bytearray | memoryview:
    """:func:`gtp_format.reader.storage.read_range` of a file in a folder (``limits``: its storage's, for the hole
    factor; ``cached``: into ``into``'s buffer through the page cache, never ``O_DIRECT``)."""
    if not (type(offset) is int and type(length) is int) or offset < 0 or length < 0:
        raise ChunkError(f"byte range offset={offset!r} length={length!r} in {rel} is invalid", file=rel)
    with open_file(root, rel) as f:
        st = os.fstat(f.fileno())
        if offset + length > st.st_size:
            raise ChunkError(past_end_message(rel, offset, length, st.st_size), file=rel)
        factor = None if limits is None else limits.hole_factor
        if length > read_budget(st, factor):  # the allocation is sized by metadata: back it by bytes that exist
            raise ChunkError(sparse_message(rel, length, st, factor), file=rel)
        direct = read_direct(f.fileno(), offset, length, into) if into is not None and not cached else None
        if direct is not None:
            buf, got = direct
        else:
            buf = bytearray(length) if into is None else into(length)[:length]
            got = read_fully(f.fileno(), buf, offset)
    if got != length:
        raise ChunkError(f"data file {rel} shrank while reading [{offset}, {offset + length})", file=rel)
    return buf


def read_small(path: Path, limit: int, what: str, fix: str) -> bytes:
    """A whole metadata-like file ``path`` (confined to its folder), refusing anything over ``limit`` bytes."""
    try:
        fd = _open_in(path.parent, path.name, what)
    except ChunkError as e:
        raise FormatError(f"{e.message}; {fix}") from None
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise FormatError(f"{path} is {size} bytes, over the {limit}-byte limit for {what}; {fix}")
        parts: list[bytes] = []
        total = 0
        while True:
            block = os.read(fd, min(1 << 20, limit + 1 - total))
            if not block:
                break
            parts.append(block)
            total += len(block)
            if total > limit:
                raise FormatError(f"{path} grew past the {limit}-byte limit for {what} while reading; {fix}")
    finally:
        os.close(fd)
    return b"".join(parts)


def list_names(path: Path) -> list[str]:
    """Sorted entry names of a folder, as a one-line error when it cannot be listed."""
    try:
        return sorted(os.listdir(path))
    except NotADirectoryError:
        raise FormatError(f"{path} is a file, expected a checkpoint folder; pass the iter_XXXXXXX folder "
                          "or its parent") from None
    except FileNotFoundError:
        raise FormatError(f"{path} does not exist; pass a checkpoint folder (iter_XXXXXXX) or its parent") from None
    except OSError as e:
        raise FormatError(f"cannot list {path}: {e.strerror}") from None
