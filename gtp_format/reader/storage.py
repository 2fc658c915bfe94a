"""Confined, bounded file access for everything the readers open.

A checkpoint's metadata names its data files and byte ranges, and a checkpoint may come from
anywhere. So every path recorded in metadata is checked to stay inside the checkpoint folder (no
``..``, no absolute path, no symlink that leads out), only regular files are opened (a FIFO or a
device would hang or never end), and a byte range is checked against the file's real size before
a single byte is read.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path, PurePosixPath
from typing import BinaryIO

from gtp_format.errors import ChunkError, FormatError


def _open_readonly(path: Path) -> int:
    """``os.open`` for reading; non-blocking so a FIFO swapped in after the stat cannot hang us."""
    return os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))


def unsafe_reason(rel: object) -> str | None:
    """Why a recorded storage path is not a plain relative path, or ``None`` if it is one."""
    if not isinstance(rel, str) or not rel:
        return f"storage path {rel!r} is not a non-empty string"
    if "\x00" in rel or "\\" in rel:
        return f"storage path {rel!r} contains a NUL or backslash"
    p = PurePosixPath(rel)
    if p.is_absolute() or (len(rel) > 1 and rel[1] == ":"):
        return f"storage path {rel!r} is absolute"
    if ".." in p.parts:
        return f"storage path {rel!r} contains '..'"
    return None


def resolve_inside(root: Path, rel: str) -> Path:
    """The real path of ``rel`` under ``root``; raises when it would leave ``root``."""
    reason = unsafe_reason(rel)
    if reason is not None:
        raise ChunkError(f"{reason}: refusing to read outside {root}", file=str(rel))
    root_real = os.path.realpath(root)
    real = os.path.realpath(os.path.join(root_real, rel))
    if os.path.commonpath([real, root_real]) != root_real:
        raise ChunkError(f"storage path {rel!r} resolves to {real}, a symlink out of {root}; refusing to "
                         "read it", file=rel)
    return Path(real)


def file_size(root: Path, rel: str) -> int:
    """Size of a data file inside ``root``; raises a one-line :class:`ChunkError` when unusable."""
    path = resolve_inside(root, rel)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise ChunkError(f"data file {rel} is missing from {root}", file=rel) from None
    except OSError as e:
        raise ChunkError(f"cannot stat data file {rel} in {root}: {e.strerror}", file=rel) from None
    if not stat.S_ISREG(st.st_mode):
        raise ChunkError(f"data file {rel} in {root} is not a regular file", file=rel)
    return st.st_size


def open_regular(root: Path, rel: str) -> BinaryIO:
    """Open a data file inside ``root`` for reading; only regular files are accepted."""
    path = resolve_inside(root, rel)
    try:
        fd = _open_readonly(path)
    except FileNotFoundError:
        raise ChunkError(f"data file {rel} is missing from {root}", file=rel) from None
    except OSError as e:
        raise ChunkError(f"cannot open data file {rel} in {root}: {e.strerror}", file=rel) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ChunkError(f"data file {rel} in {root} is not a regular file", file=rel)
    return os.fdopen(fd, "rb")


def read_range(root: Path, rel: str, offset: int, length: int) -> bytearray:
    """Exactly ``length`` bytes at ``offset`` of a data file, after checking the range fits.

    A ``bytearray``: writable, so tensors can be viewed over it without a copy.
    """
    if not (isinstance(offset, int) and isinstance(length, int)) or offset < 0 or length < 0:
        raise ChunkError(f"byte range offset={offset!r} length={length!r} in {rel} is invalid", file=rel)
    with open_regular(root, rel) as f:
        size = os.fstat(f.fileno()).st_size
        if offset + length > size:
            raise ChunkError(past_end_message(rel, offset, length, size), file=rel)
        f.seek(offset)
        buf = bytearray(length)
        got = f.readinto(buf)
    if got != length:
        raise ChunkError(f"data file {rel} shrank while reading [{offset}, {offset + length})", file=rel)
    return buf


def past_end_message(rel: str, offset: int, length: int, size: int) -> str:
    return (f"byte range [{offset}, {offset + length}) of {rel} runs past its end ({size} bytes): "
            "the file is truncated or the metadata is wrong")


def read_small_file(path: Path, limit: int, what: str, fix: str) -> bytes:
    """A whole metadata-like file, refusing non-regular files and anything over ``limit`` bytes."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise FormatError(f"{path} is missing; {fix}") from None
    except OSError as e:
        raise FormatError(f"cannot stat {path}: {e.strerror}; {fix}") from None
    if not stat.S_ISREG(st.st_mode):
        raise FormatError(f"{path} is not a regular file; {fix}")
    if st.st_size > limit:
        raise FormatError(f"{path} is {st.st_size} bytes, over the {limit}-byte limit for {what}; {fix}")
    try:
        fd = _open_readonly(path)
    except OSError as e:
        raise FormatError(f"cannot open {path}: {e.strerror}; {fix}") from None
    parts: list[bytes] = []
    total = 0
    try:
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


def list_dir(path: Path) -> list[str]:
    """Sorted entry names of a folder, as a one-line error when it cannot be listed."""
    try:
        return sorted(os.listdir(path))
    except NotADirectoryError:
        raise FormatError(f"{path} is a file, expected a checkpoint folder; pass the iter_XXXXXXX folder "
                        "or its parent") from None
    except OSError as e:
        raise FormatError(f"cannot list {path}: {e.strerror}") from None
