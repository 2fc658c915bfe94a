"""SRC and DST of every ``ckpt`` command, parsed from the raw text before it becomes a ``Path``.

Why a parser on the argument: Typer turns ``s3://bucket/run`` into ``Path("s3:/bucket/run")`` before
the command runs, and that is a local folder; the scheme is only visible in the text. Each command's
location arguments are declared with :func:`checkpoint_arg`, which calls the format's one parser
(:func:`gtp_format.storage.location.parse_location`) on the text: an unsupported scheme or a malformed
URL is a usage error, so one ``ckpt: error: Invalid value for 'SRC': ...`` line and exit 2, before the
command runs. Every command takes ``s3://`` wherever it takes a checkpoint (docs/object-stores.md).
"""

from __future__ import annotations

from collections.abc import Callable

import typer

from gtp_format.storage.location import Location, LocationError, parse_location


def checkpoint_arg(what: str) -> Callable[[str], Location]:
    """A Typer ``parser`` for a checkpoint the command reads from a folder or a bucket (``s3://``):
    a local ``Path``, or an :class:`ObjectURL` that the one reader (``open_checkpoint``) takes."""

    def parse(value: str) -> Location:
        try:
            return parse_location(value, "")
        except LocationError as e:
            raise typer.BadParameter(e.message) from None

    parse.__name__ = f"parse_{what.lower()}"
    return parse
