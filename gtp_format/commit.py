"""Durable writes and atomic commits: the one implementation every writer of a checkpoint uses.

A checkpoint is hundreds of GB written by many processes; a crash or a full disk can stop it at
any byte. The rule everywhere: build the new thing under a hidden temporary name, ``fsync`` each
file and then its folder (POSIX makes a new directory entry durable only when the directory is
synced), and make it visible with one ``rename``. A reader then sees the old state or the complete
new one, never a part. ``save_checkpoint``, the safetensors writer, the manifest, the latest marker,
``ckpt migrate-aliased``/``reshard``/``export`` and the launcher's rank reports all go through here.

These are the primitives; writers use them through :class:`gtp_format.writer.checkpoint.CheckpointWriter`,
which lays out a whole checkpoint. A commit never replaces or deletes what its writer did not
create: :func:`commit_new_folder` and :func:`commit_file` refuse (``FileExistsError``) when the name
appeared meanwhile, atomically (Linux ``renameat2(RENAME_NOREPLACE)``; elsewhere an exclusive
``mkdir`` or ``link`` claims the name first). Where a replace is really wanted (the runtime re-saving
an iteration, ``migrate-aliased --in-place``), :func:`swap_in_folder` exchanges the two folders in one
step (``RENAME_EXCHANGE``), so a reader never finds the name missing.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import sys
from collections.abc import Callable
from pathlib import Path

from gtp_format.work import work_name


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
    """A unique dot-name next to ``path`` that no reader takes for a checkpoint or a marker; it records
    this process as its owner (:mod:`gtp_format.work`), so a later writer can clean it up."""
    return work_name(path, tag)


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


_RENAME_NOREPLACE, _RENAME_EXCHANGE = 1, 2


def _renameat2(a: Path, b: Path, flags: int) -> bool:
    """Linux ``renameat2(a, b, flags)``; False where the kernel, libc or filesystem lacks it.

    ``GTP_NO_RENAMEAT2=1`` takes the portable path, so that crash tests reach its two-rename moment.
    """
    if not sys.platform.startswith("linux") or os.environ.get("GTP_NO_RENAMEAT2") == "1":
        return False
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    at_fdcwd = -100
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), flags) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def commit_new_folder(tmp: Path, final: Path) -> None:
    """Rename the complete folder ``tmp`` to ``final``, which must not exist: nothing is ever replaced.

    ``rename`` alone would silently replace an empty folder that appeared at ``final`` since the
    caller checked; where Linux offers ``RENAME_NOREPLACE`` the kernel refuses it instead
    (``FileExistsError``).
    """
    fsync_dir(tmp)
    if not _renameat2(tmp, final, _RENAME_NOREPLACE):
        os.mkdir(final)  # claims the name (FileExistsError if taken); rename() may replace an empty folder
        try:
            os.rename(tmp, final)
        except BaseException:
            with contextlib.suppress(OSError):
                os.rmdir(final)  # ours, and still empty (rmdir removes nothing else)
            raise
    fsync_dir(final.parent)


def swap_in_folder(tmp: Path, final: Path, backup: Path, between: Callable[[], None] | None = None,
                   exchanged: Callable[[], None] | None = None) -> None:
    """Put the complete folder ``tmp`` at ``final``; the old ``final`` is kept at ``backup`` (must not exist).

    Where the kernel can exchange two paths atomically (Linux ``renameat2``), readers of ``final``
    see the old or the new folder, never none; elsewhere there is a moment between two renames,
    and a failed second rename puts the old folder back (a crash there leaves both complete copies
    hidden, which :func:`gtp_format.reader.locate.locate` recovers). ``between``: a fault-injection
    hook called in that moment; ``exchanged``: one called after the exchange, while ``tmp`` names the old
    folder (the caller proves that folder its own under both names: :func:`gtp_format.work.own_before_removal`).
    """
    fsync_dir(tmp)
    if _renameat2(tmp, final, _RENAME_EXCHANGE):
        if exchanged is not None:
            exchanged()
        os.rename(tmp, backup)  # tmp now names the old folder
    else:
        os.rename(final, backup)
        try:
            if between is not None:
                between()
            os.rename(tmp, final)
        except OSError:
            os.rename(backup, final)
            raise


def commit_file(tmp: Path, final: Path) -> None:
    """Make a complete file ``tmp`` (written next to ``final``) durable and visible as ``final``.

    Refuses to replace an existing ``final`` (``FileExistsError``): exports never overwrite. Without
    ``renameat2``, ``link`` is the no-replace primitive (it fails on an existing name).
    """
    fsync_file(tmp)
    if not _renameat2(tmp, final, _RENAME_NOREPLACE):
        os.link(tmp, final)
        os.unlink(tmp)
    fsync_dir(final.parent)
