"""Durable writes and atomic commits: the one implementation every writer of a checkpoint uses.

A checkpoint is hundreds of GB written by many processes; a crash or a full disk can stop it at
any byte. The rule everywhere: build the new thing under a hidden temporary name, ``fsync`` each
file and then its folder (POSIX makes a new directory entry durable only when the directory is
synced), and make it visible with one ``rename``. A reader then sees the old state or the complete
new one, never a part. ``save_checkpoint``, the safetensors writer, the manifest, the latest marker,
``ckpt migrate-aliased``/``reshard``/``export`` and the launcher's rank reports all go through here.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make a rename or a new entry in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: str | os.PathLike[str]) -> None:
    """Flush a file some library wrote (safetensors, DCP) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durable(path: str | os.PathLike[str], data: bytes | str) -> None:
    """Write a new file and ``fsync`` it (its folder is synced by whoever commits the folder)."""
    raw = data.encode() if isinstance(data, str) else data
    try:
        with open(path, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:  # write() and fsync() name no file: a full disk must say which one it could not write
        if e.filename is None:
            e.filename = os.fspath(path)
        raise


def hidden_sibling(path: Path, tag: str) -> Path:
    """A unique dot-name next to ``path`` that no reader takes for a checkpoint or a marker."""
    return path.with_name(f".{tag}.{path.name}.{uuid.uuid4().hex[:8]}")


def write_atomic(path: str | os.PathLike[str], data: bytes | str, durable: bool = True) -> None:
    """Replace ``path`` with ``data`` in one step: temp file, fsync, ``os.replace``, fsync the folder.

    ``durable=False`` skips the fsyncs, for files only this run reads back (rank reports).
    """
    path = Path(path)
    tmp = hidden_sibling(path, "tmp")
    try:
        if durable:
            write_durable(tmp, data)
        else:
            tmp.write_bytes(data.encode() if isinstance(data, str) else data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(path.parent)


def commit_folder(tmp: Path, final: Path) -> None:
    """Rename a complete, fsynced folder ``tmp`` to ``final``, replacing an existing one.

    An existing ``final`` is first moved aside to a hidden name and removed only after the new
    folder is in place, so a crash between the two renames leaves the old copy recoverable, never
    a mix.
    """
    fsync_dir(tmp)
    old = None
    if final.exists():
        old = hidden_sibling(final, "old")
        os.rename(final, old)
    os.rename(tmp, final)
    fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
