"""Before ``--load`` hands a folder to DCP: the format's confined reader and structural checks.

DCP's own reader opens files by name (following symlinks, blocking on a FIFO, trusting every
storage path and byte range in the metadata). So ``--load`` first resolves the folder with
:func:`gtp_format.reader.locate.locate` (the latest marker read confined and bounded: a FIFO or a
link out is an error, not a hang or a read outside) and runs what ``ckpt verify`` checks without
``--data`` (:func:`gtp_format.check.verify.verify`: chunk geometry, storage inside the folder in
regular files and within their sizes, every pickle through the allow-list with its depth and
count limits). Any error there stops the load with one line naming it.

What remains after this is the window between these checks and DCP's own opens (a file swapped
for a link in between); closing it needs DCP to read through the confined opener, which is the
job of the reader that replaces DCP's in ``--load``.
"""

from __future__ import annotations

import os
from pathlib import Path

from gtp_format.errors import FormatError


class PreflightError(Exception):
    """The checkpoint fails the format's checks; the message is one line naming the problem."""


def resolve(path: str | os.PathLike) -> Path:
    """The checkpoint folder ``path`` names (itself, or the one its latest marker names), confined."""
    from gtp_format.reader.locate import locate

    try:
        return locate(path).folder
    except FormatError as e:
        raise PreflightError(e.message) from None


def check(folder: Path) -> None:
    """Open the folder with the format's reader and run the structural checks; raise on the first error."""
    from gtp_format.check.verify import verify
    from gtp_format.reader.checkpoint import open_checkpoint

    try:
        ckpt = open_checkpoint(folder)
        result = verify(ckpt)
    except FormatError as e:
        raise PreflightError(e.message) from None
    errors = [p for p in result.problems if p.severity == "error"]
    if errors:
        first = errors[0]
        where = first.key or first.file or str(folder)
        raise PreflightError(f"{folder} fails {len(errors)} checkpoint check(s); first: {where!r}: {first.message} "
                             "(run 'ckpt verify' on it for the full list)")
