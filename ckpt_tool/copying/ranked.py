"""A new checkpoint folder built by every rank of a torchrun job and committed by rank 0.

The ranks' sequence (:func:`build_ranked`; the engines' part is
:func:`ckpt_tool.copying.engine.share_files`):

1. rank 0 creates the one writer's hidden work folder beside DST
   (:class:`gtp_format.writer.checkpoint.CheckpointWriter`) and broadcasts its path; every other rank
   adopts it (writes there, never removes it);
2. every rank writes its share of the data files there, each fsynced by the rank that wrote it, and the
   files' entries (size, CRC-32C), placements and chunk records are all-gathered: that gather is the
   barrier that says every rank's files are durable and their records made;
3. rank 0 writes ``.metadata``/``index.json``, the manifest and ``metadata.json`` (``finish``); every rank
   checks its own source reads (``Source.verify_reads``) and the outcomes are exchanged again;
4. rank 0 commits (one rename that never replaces anything), and tells every rank how it went.

Any rank's error, at any step, is every rank's one line naming that rank, and no commit: rank 0's writer
removes the work folder. A rank killed meanwhile is found by its peers' broken connection, and torchrun's
agent then sends every other rank SIGTERM (SIGKILL 30 s later). Rank 0 removes its work folder on that
SIGTERM from a thread of its own (:class:`TermGuard`), at once: the signal's Python handler runs only in the
main thread, between bytecodes, so it waited while the main thread was inside a gloo collective, and the
exception it raised could cut short the writer's own removal (a work folder was left in 1 of 3 runs of the
random-kill test). A killed rank 0 leaves its work folder to the surviving ranks of its host, which remove it
once rank 0's process is gone: every work folder beside DST whose name records rank 0's process and whose
token proves it (:func:`gtp_format.work.proven`; a zombie not yet reaped by torchrun counts as gone), so
also one rank 0 made before it could tell the others its path.

A bucket DST: the work folder is local staging. On one node every rank writes into rank 0's, reads its share
of the staged files in full against their entries (:func:`check_staged`), and rank 0 uploads and commits. On
several nodes (torchrun's ``GROUP_RANK``, :func:`gtp_format.ranks.node_of`) each node's lowest rank makes its
node's staging folder, with a writer of its own that never commits (it removes that folder at the end, or
on SIGTERM as rank 0 does), and every node checks and uploads its own files: :mod:`ckpt_tool.copying.nodes`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import TracebackType

from ckpt_tool.copying.nodes import across_nodes, damage, leader, refused_commit
from gtp_format.check.gate import check_written
from gtp_format.errors import FormatError
from gtp_format.manifest import FileEntry
from gtp_format.ranks import COMMITTING, Group, RankFailed, assign, fault
from gtp_format.session import Session
from gtp_format.storage.base import storage_for
from gtp_format.storage.location import ObjectURL
from gtp_format.work import leftovers, proven, remove_owned, remove_proven
from gtp_format.writer.checkpoint import CheckpointWriter


def build_ranked(group: Group, dst: Path | ObjectURL, body: Callable[[CheckpointWriter], None],
                 inner: str | None, latest: str | None, session: Session | None = None) -> None:
    """:func:`ckpt_tool.copying.engine.build_atomically` for the ranks of ``group`` (see the module docstring)."""
    # a bucket output across nodes: each node's lowest rank stages its node's files (ckpt_tool/copying/nodes.py)
    staged_per_node = not storage_for(dst).in_place and len(group.nodes) > 1
    owner = leader(group.peers, group.rank) if staged_per_node else 0
    # Every rank is inside its clean-up's reach (its ``try`` below) before a work folder exists: a rank still
    # planning when the folder's maker died was stopped by torchrun's SIGTERM before it could remove that folder.
    if owner == group.rank:  # rank 0, or the lowest rank of another node
        group.barrier("before the work folder")
        with TermGuard() as guard, CheckpointWriter(dst, inner=inner, latest=latest, session=session) as writer:
            guard.writer = writer
            try:
                fault("created")
                group.exchange(lambda: writer.work, "while creating the work folder")
                _steps(group, writer, body, guard)
            except BaseException:
                with sigterm_held():
                    writer.abort()
                raise
        return
    writer = CheckpointWriter(dst, inner=inner, latest=latest, session=session)  # not entered: no folder of its own
    try:
        group.barrier("before the work folder")
        writer.adopt(group.exchange(lambda: None, "while creating the work folder")[owner])
        _steps(group, writer, body, TermGuard())  # not entered: only the folder's maker removes on SIGTERM
    except BaseException:
        with sigterm_held():
            if owner in group.dead(wait=2.0):  # its maker can no longer remove the work folder (nor commit it)
                remove_dead_owners(writer, group.peers[owner].pid)
        raise


@contextlib.contextmanager
def sigterm_held() -> Iterator[None]:
    """torchrun's SIGTERM (it follows a rank's death) must not cut a clean-up short: it does nothing meanwhile
    (the rank is on its way out anyway). Main thread only (``signal``'s rule)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def remove_dead_owners(writer: CheckpointWriter, pid: int) -> None:
    """Remove the work folders beside the output that the dead process ``pid`` (rank 0) made: those whose name
    records that process, of this host, gone, and whose token proves the name (:mod:`gtp_format.work`)."""
    try:
        parent = writer.storage.work_parent()
    except FormatError:  # a bucket's staging setting this rank cannot use: it wrote nothing there either
        return
    for w in leftovers(parent):  # sorted: a folder before its proof file, which goes with it
        if w.pid == pid and w.stale and proven(w):
            remove_proven(w)


class TermGuard:
    """Rank 0's removal of its work folder on SIGTERM, from a thread, before the main thread can react.

    ``signal.set_wakeup_fd`` makes the interpreter's C-level handler write the signal's number to a pipe the
    moment it arrives; a thread waiting on the pipe removes the work folder (unless the commit happened: the
    commit runs under :attr:`lock`). The removal repeats while the other ranks of this host, stopped by the
    same SIGTERM, may still be finishing a chunk into it, and takes the ownership token last; if new entries
    still appear, the token goes back, so what stays is a proven dead writer's, removed by the next writer
    there. Only in the main thread (``set_wakeup_fd``'s rule); elsewhere it does nothing.
    """

    def __init__(self) -> None:
        self.writer: CheckpointWriter | None = None  # set once the writer made its work folder
        self.lock = threading.Lock()
        self.committing = False  # every rank's files are confirmed: rank 0 commits, even on SIGTERM
        self._pipe: tuple[int, int] | None = None
        self._previous = -1
        self._thread: threading.Thread | None = None

    def __enter__(self) -> TermGuard:
        if threading.current_thread() is not threading.main_thread():
            return self
        r, w = os.pipe()
        os.set_blocking(w, False)
        try:
            self._previous = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        except (ValueError, OSError):
            os.close(r)
            os.close(w)
            return self
        self._pipe = (r, w)
        self._thread = threading.Thread(target=self._watch, args=(r,), name="ckpt-sigterm", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._pipe is None:
            return
        r, w = self._pipe
        self._pipe = None
        signal.set_wakeup_fd(self._previous)
        os.close(w)  # the watcher reads end-of-file and returns
        if self._thread is not None:
            self._thread.join(timeout=30)
        os.close(r)

    def _watch(self, r: int) -> None:
        while True:
            try:
                got = os.read(r, 64)
            except OSError:
                return
            if not got:
                return
            if signal.SIGTERM in got:
                with self.lock:
                    writer = self.writer
                    if writer is not None and writer.work is not None and not (writer.committed or self.committing):
                        remove_owned_work(writer.work)
                return


def remove_owned_work(work: Path, tries: int = 20) -> None:
    """Remove this process's work folder while other processes may still be adding to it (see
    :class:`TermGuard`): :func:`gtp_format.work.remove_owned` over ``tries`` rounds; where an entry still
    appears after the last, the folder stays with its token (proven)."""
    remove_owned(work, tries)


def _steps(group: Group, writer: CheckpointWriter, body: Callable[[CheckpointWriter], None],
           guard: TermGuard) -> None:
    per_node = not writer.storage.in_place and len(group.nodes) > 1
    writer.defer_gate = per_node  # rank 0's gate waits for the other nodes' verdicts (nodes.across_nodes)
    try:
        body(writer)  # its one collective is the gather of the files (engine.share_files)
        failed: BaseException | None = None
    except RankFailed:
        raise  # every rank raised the same line at the same collective
    except Exception as e:  # noqa: BLE001 - this rank's error after the gather: the next exchange names it
        failed = e

    shared = None if writer.storage.in_place else group.broadcast(
        (dict(writer.files), writer.commit_object) if group.root and failed is None else None,
        "while sharing the staged files' entries")
    staged, writer.commit_object = shared if shared is not None else (None, writer.commit_object)

    def ready() -> None:
        if failed is not None:
            raise failed
        if staged is not None:
            check_staged(group, writer, staged)

    up = across_nodes(group, writer, staged, failed) if per_node else None
    if up is None:
        group.exchange(ready, "before the commit")
    # Every rank's files are durable and recorded: rank 0 commits now even if torchrun's SIGTERM comes (a rank
    # that died after this point cannot change the output; its peers say DST is whole or absent). Without
    # this, a SIGTERM a few milliseconds early removed the work folder of a finished output. (Another node's
    # staging folder is uploaded by now: its maker still removes it on SIGTERM.)
    guard.committing = group.root
    fault("commit")

    def commit() -> tuple[str, int] | None:
        if group.root:
            with guard.lock, sigterm_held():  # not while the SIGTERM guard removes the work folder
                try:
                    writer.commit()
                except Exception as e:  # noqa: BLE001 - below: one line on every rank
                    if up is None:
                        raise
                    # refused, and rank 0's own objects removed (the upload's undo): the ranks remove theirs
                    return (e.message, e.exit_code) if isinstance(e, FormatError) else (
                        f"{writer.target}: {type(e).__name__}: {str(e)[:300]}", 2)
            fault("renamed")
        return None

    got = group.exchange(commit, COMMITTING)[0]
    if up is not None:
        refused_commit(group, got, up)


def check_staged(group: Group, writer: CheckpointWriter, entries: dict[str, FileEntry]) -> None:
    """This rank's share (by bytes, :func:`gtp_format.ranks.assign`) of a bucket output's staged files, each read
    in full against the entry it was written with (:func:`gtp_format.check.gate.check_written`), just before
    rank 0 uploads them: the upload sends the staged bytes as they are, and the writer's gate reads only their
    sizes and headers. The verdicts meet in the exchange before the commit; a refusal names the file and this
    rank. (Every rank shares rank 0's node here: across nodes, :func:`ckpt_tool.copying.nodes.verdict`.)"""
    names = sorted(entries)
    owners = assign([entries[n].size for n in names], group.world)
    mine = {n: entries[n] for n, r in zip(names, owners) if r == group.rank}
    damage(writer.folder, mine)  # the tests' hook: this node's disk changed a staged file after its write
    line = check_written(writer.folder, mine)
    if line is not None:
        raise FormatError(f"{writer.target}: staged file {line} (changed on this node's disk after it was "
                          "written); nothing was committed: run the command again", 1)
