"""``ckpt migrate-aliased`` as one call: plan, refuse or report, write, and a document of what happened.

The command module only turns options into :func:`migrate_aliased`'s arguments and prints the
:class:`Report`. The order of the checks is part of the contract (tests/cli/test_migrate.py): bad
options, then the plan's refusals, then DST, then nothing-to-do, then lost moments, then
``--dry-run``; only a real run imports the torch-backed writer modules.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckpt_tool.migrate.plan import (
    REBUILD,
    RESET,
    Plan,
    fail_if_moments_lost,
    lost_dict,
    plan_migration,
)
from gtp_format.errors import EXIT_BAD_INPUT, FormatError
from gtp_format.names import DCP_METADATA_FILE, MANIFEST_FILE
from gtp_format.reader.storage import list_dir
from gtp_format.session import Session
from gtp_format.storage.base import storage_for
from gtp_format.storage.location import ObjectURL

if TYPE_CHECKING:
    from ckpt_tool.migrate.write import Outcome

# progress(steps) opens a progress display for that many steps and yields its advance(n) callback
ProgressFactory = Callable[[int], AbstractContextManager[Callable[[int], None]]]


@dataclass
class Report:
    """The report document (``--format json`` prints it as is), the verdict line, and the error to exit with."""

    doc: dict[str, Any]
    verdict: str
    error: FormatError | None = None


def plan_doc(plan: Plan) -> dict[str, Any]:
    return {
        "source": str(plan.ckpt.root),
        "topology": plan.par.describe() if plan.par else None,
        "status": plan.status,
        "message": plan.message,
        "counts": plan.counts(),
        "param_rebuild": "exact" if not plan.lossy else "lossy",
        "lossy_weights": {n: plan.weight_dtypes[n] for n in plan.lossy},
        "aliased_keys": [{
            "key": k.source_key, "new_keys": k.new_keys,
            "kept": [{"offsets": list(c.offsets), "sizes": list(c.sizes), "file": c.file, "rank": c.rank,
                      "cp_rank": c.cp_rank, "new_key": c.new_key} for c in k.kept],
        } for k in plan.keys],
        "lost": [lost_dict(c) for c in plan.lost],
    }


def migrate_aliased(src: Path | ObjectURL, dst: Path | ObjectURL | None, *, cp_size: int | None, in_place: bool,
                    dry_run: bool, reset_lost_moments: bool, progress: ProgressFactory,
                    session: Session | None = None) -> Report:
    """Migrate SRC to DST (or in place); raises :class:`FormatError` for bad input (exit 2). ``session``: the
    command's (:class:`gtp_format.session.Session`), which the writer's storage and work folder belong to."""
    if in_place and dst is not None:
        raise FormatError(f"--in-place replaces SRC and takes no DST (got {dst}); drop one of them")
    if not in_place and dst is None:
        raise FormatError("missing DST: pass where the migrated checkpoint should appear, or --in-place")
    if in_place and not storage_for(src).in_place:
        raise FormatError(f"{src}: --in-place cannot replace a checkpoint in a bucket: an object store has no atomic "
                          "rename, so readers would see a mix of the old and the new objects; pass a new DST instead "
                          "(a folder or s3://BUCKET/NEW_PREFIX) and point the run at it")
    plan = plan_migration(src, cp_size, reset_lost_moments, session)
    doc = plan_doc(plan)
    doc.update(mode="dry_run" if dry_run else ("in_place" if in_place else "copy"), written=False,
               destination=None if dst is None else str(dst), backup=None, files=None, notes=[])
    if dst is not None:
        plan.source.refuse_destination(dst)
    if plan.status != "aliased":
        return Report(doc, f"nothing to migrate: {plan.message}; nothing written")
    try:
        fail_if_moments_lost(plan)
    except FormatError as e:
        error = FormatError(e.message + " (dry run)", e.exit_code) if dry_run else e
        return Report(doc, "REFUSED: Adam moments were lost; nothing written", error)
    if dry_run:
        return Report(doc, "dry run: nothing written")
    outcome = _write(plan, dst, in_place, progress, session)
    doc.update(written=True, destination=str(outcome.destination),
               backup=None if outcome.backup is None else str(outcome.backup), notes=outcome.notes,
               files={"linked": outcome.linked, "copied": outcome.copied, "new_data_file": outcome.new_data_file,
                      "new_bytes": outcome.new_bytes})
    where = f"; SRC's old folder kept at {outcome.backup}" if outcome.backup else ""
    return Report(doc, f"MIGRATED: {outcome.destination}{where}")


def _write(plan: Plan, dst: Path | ObjectURL | None, in_place: bool, progress: ProgressFactory,
           session: Session | None = None) -> Outcome:
    from ckpt_tool.migrate.commit import migrate_in_place, migrate_to  # torch: a real run only

    carried = [n for n in list_dir(plan.ckpt.store) if n not in (DCP_METADATA_FILE, MANIFEST_FILE)]
    steps = len(carried) + sum(c.action in (REBUILD, RESET) for c in plan.lost)
    with progress(steps) as advance:
        try:
            if in_place:
                return migrate_in_place(plan, advance, session)
            assert dst is not None
            return migrate_to(plan, dst, advance, session)
        except OSError as e:
            where = f" {e.filename}" if e.filename else ""
            raise FormatError(f"cannot write{where}: {e.strerror or e}; nothing was committed, SRC is untouched",
                              EXIT_BAD_INPUT) from None
