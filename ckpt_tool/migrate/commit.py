"""Committing a migration: build beside the target, check, then one rename (or an atomic swap).

The migrated folder is built in a hidden sibling of where it will appear (same filesystem, so
the last step is a rename), checked with ``ckpt verify``'s structural checks (the writer's) and
``verify --data``'s pass over the file it wrote, and only then made
visible. A failure anywhere (SIGTERM included) leaves no trace but SRC, untouched. The layout and
commit are the one checkpoint writer's (:class:`gtp_format.writer.checkpoint.CheckpointWriter`):
a DST that appeared meanwhile is refused and left alone; ``--in-place`` exchanges the folders.
"""

from __future__ import annotations

import datetime
import os
import time
import uuid
from pathlib import Path
from typing import Any

from ckpt_tool.migrate.plan import Plan
from ckpt_tool.migrate.write import Outcome, build_migrated
from gtp_format.errors import EXIT_CHECK_FAILED, FormatError
from gtp_format.progress import Progress
from gtp_format.reader.checkpoint import open_checkpoint
from gtp_format.session import Session
from gtp_format.storage.base import storage_for
from gtp_format.storage.location import ObjectURL
from gtp_format.writer.checkpoint import CheckpointWriter

TAG = "migrate"  # the hidden build folder is .migrate.<name>.<nonce>


def self_check(folder: Path, written: str | None = None, opened: Any = None) -> None:
    """``verify --data``'s own pass over the data file the migration wrote (rebuilt masters, zeroed
    moments: long zero runs left as holes), so the migration never commits what ``verify --data``
    refuses. The structural checks (verify's, aliased keys included) already ran in the writer's
    ``finish`` (:meth:`gtp_format.writer.checkpoint.CheckpointWriter.check_output`)."""
    from gtp_format.check.verify_data import verify_written

    if written is None:
        return
    errors = verify_written(opened if opened is not None else open_checkpoint(folder), frozenset({written}))
    if errors:
        p = errors[0]
        raise FormatError(f"the migrated copy fails verify ({len(errors)} errors, first: {p.key or p.file}: "
                          f"{p.message}); nothing was committed, please report this", EXIT_CHECK_FAILED)


def _build_and_check(plan: Plan, writer: CheckpointWriter, final: Path | ObjectURL, progress: Progress) -> Outcome:
    # DCP records where the folder will be (a bucket's URL as text: no local path names it)
    where = str(final) if storage_for(final).remote else Path(os.path.abspath(final))
    outcome = build_migrated(plan, writer, where, progress)
    t = time.perf_counter()
    self_check(writer.folder, outcome.new_data_file, writer.checked)  # the checkpoint the writer's read-back opened
    outcome.timings["self_check"] = time.perf_counter() - t
    return outcome


def migrate_to(plan: Plan, dst: Path | ObjectURL, progress: Progress, session: Session | None = None) -> Outcome:
    """Build the migrated checkpoint in a hidden sibling of ``dst`` and rename it to ``dst`` (a bucket:
    built and self-checked in local staging, then the writer's ordered upload).

    SRC an iteration folder: ``dst`` is the migrated iteration folder. SRC a parent with
    ``latest_checkpointed_iteration.txt``: ``dst`` becomes a parent holding the migrated iteration
    (same folder name) and its own ``latest_checkpointed_iteration.txt``.
    """
    src = plan.source
    src.refuse_destination(dst)
    nested = src.parent is not None
    final_iter = dst / src.folder.name if nested else dst
    with CheckpointWriter(dst, inner=src.folder.name if nested else None,
                          latest=src.latest_text if nested else None, tag=TAG, session=session) as writer:
        outcome = _build_and_check(plan, writer, final_iter, progress)
        writer.commit()
    outcome.destination = final_iter
    return outcome


def migrate_in_place(plan: Plan, progress: Progress, session: Session | None = None) -> Outcome:
    """Build the migrated iteration next to SRC's, then swap; SRC's old folder is kept as a backup.

    Where the kernel can exchange two paths atomically (Linux ``renameat2``), readers of SRC see
    the old or the new folder, never none; elsewhere there is a moment between two renames.
    """
    folder = plan.source.folder
    stamp = datetime.datetime.now().strftime("%Y%m%dT%H%M%S")
    backup = folder.parent / f"{folder.name}.pre-migrate-{stamp}"
    while os.path.lexists(backup):
        backup = folder.parent / f"{folder.name}.pre-migrate-{stamp}-{uuid.uuid4().hex[:4]}"
    with CheckpointWriter(folder, replace=True, backup=backup, tag=TAG, session=session) as writer:
        outcome = _build_and_check(plan, writer, folder, progress)
        writer.commit()
    outcome.destination, outcome.backup = folder, backup
    return outcome
