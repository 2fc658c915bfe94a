"""``ckpt verify``'s verdict as a gate: open a checkpoint and refuse it exactly as verify would.

Anything that is about to hand a checkpoint to code that trusts it (DCP's loader unpickles
``.metadata`` and opens whatever storage paths it names) must first pass the same reader and the
same structural checks as ``ckpt verify``, and be refused with the same one line and exit code.
Measured on 101e36d: a ``.metadata`` storage path with ``..`` was refused by ``ckpt verify`` while
``ckpt verify-roundtrip PATH`` started ranks that opened the file outside the folder. The line is
built here once, so the two can never word it differently.
"""

from __future__ import annotations

import os

from gtp_format.check.verify import VerifyResult, verify
from gtp_format.errors import EXIT_CHECK_FAILED, FormatError
from gtp_format.model import Checkpoint


def refusal(result: VerifyResult, root: os.PathLike[str] | str) -> str | None:
    """The one-line reason ``ckpt verify`` fails with, or ``None`` when it finds no error."""
    errors = [p for p in result.problems if p.severity == "error"]
    if not errors:
        return None
    first = errors[0]
    where = first.key or first.file or str(root)
    return f"verify failed: {len(errors)} errors in {root}; first: {where}: {first.message}"


def open_verified(path: os.PathLike[str] | str, cp_size: int | None = None) -> tuple[Checkpoint, VerifyResult]:
    """Open ``path`` with the ``ckpt`` reader and run ``ckpt verify``'s structural checks.

    Raises :class:`FormatError`: exit 2 when the reader cannot open it, exit 1 with verify's own
    line when a check finds an error. Reads metadata and ``stat`` results only (no data file).
    """
    from gtp_format.reader.checkpoint import open_checkpoint

    ckpt = open_checkpoint(path)
    result = verify(ckpt, cp_size=cp_size)
    line = refusal(result, ckpt.root)
    if line is not None:
        raise FormatError(line, EXIT_CHECK_FAILED)
    return ckpt, result
