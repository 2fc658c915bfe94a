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
removes the work folder. A rank killed meanwhile is found by its peers' broken connection (or torchrun's
SIGTERM, which makes rank 0's writer remove the work folder as on an error); a killed rank 0 leaves its work
folder to the surviving ranks of its host, which remove it once rank 0's process is gone (a dead owner's
work only, as :func:`gtp_format.work.clean_stale`; a zombie not yet reaped by torchrun counts as gone).

A bucket DST: the work folder is rank 0's local staging, so every rank must share rank 0's host; a job over
several hosts is refused before anything is written.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path

from gtp_format.errors import FormatError
from gtp_format.ranks import COMMITTING, Group, RankFailed, fault
from gtp_format.storage.base import storage_for
from gtp_format.storage.location import ObjectURL
from gtp_format.work import remove_entry
from gtp_format.writer.checkpoint import CheckpointWriter


def build_ranked(group: Group, dst: Path | ObjectURL, body: Callable[[CheckpointWriter], None],
                 inner: str | None, latest: str | None) -> None:
    """:func:`ckpt_tool.copying.engine.build_atomically` for the ranks of ``group`` (see the module docstring)."""
    if not storage_for(dst).in_place and len({p.host for p in group.peers}) > 1:
        raise FormatError(f"{dst}: a bucket output is staged on rank 0's host, and this job spans "
                          f"{len({p.host for p in group.peers})} hosts; run it on one node (--nnodes 1)")
    if group.root:
        with CheckpointWriter(dst, inner=inner, latest=latest) as writer:
            group.exchange(lambda: writer.work, "while creating the work folder")
            _steps(group, writer, body)
        return
    work = group.exchange(lambda: None, "while creating the work folder")[0]
    writer = CheckpointWriter(dst, inner=inner, latest=latest)
    writer.adopt(work)
    try:
        _steps(group, writer, body)
    except BaseException:
        # torchrun's SIGTERM (it follows a rank's death) must not cut the clean-up short: it is held meanwhile
        # (we are on our way out anyway)
        previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)
        try:
            if 0 in group.dead(wait=2.0):  # rank 0 can no longer remove its work folder (nor commit it): we do
                remove_entry(Path(work))
        finally:
            signal.signal(signal.SIGTERM, previous)
        raise


def _steps(group: Group, writer: CheckpointWriter, body: Callable[[CheckpointWriter], None]) -> None:
    try:
        body(writer)  # its one collective is the gather of the files (engine.share_files)
        failed: BaseException | None = None
    except RankFailed:
        raise  # every rank raised the same line at the same collective
    except Exception as e:  # noqa: BLE001 - this rank's error after the gather: the next exchange names it
        failed = e

    def ready() -> None:
        if failed is not None:
            raise failed

    group.exchange(ready, "before the commit")
    fault("commit")

    def commit() -> None:
        if group.root:
            writer.commit()
            fault("renamed")

    group.exchange(commit, COMMITTING)
