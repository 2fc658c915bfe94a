"""SRC and DST of every ``ckpt`` command, parsed from the raw text before it becomes a ``Path``.

Why a parser on the argument: Typer turns ``s3://bucket/run`` into ``Path("s3:/bucket/run")`` before
the command runs, and that is a local folder; the scheme is only visible in the text. Each command's
location arguments are declared with :func:`local_arg`, which calls the format's one parser
(:func:`gtp_format.storage.location.parse_location`) on the text: an unsupported scheme, a malformed
URL, or an object store where the command takes local folders only is a usage error, so one
``ckpt: error: Invalid value for 'SRC': ...`` line and exit 2, before the command runs.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import typer

from gtp_format.storage.location import Location, LocationError, local_path, parse_location

NOT_YET = "object stores are not supported by ckpt yet; copy the checkpoint to a local folder first"


def local_arg(what: str, why: str = NOT_YET) -> Callable[[str], Path]:
    """A Typer ``parser`` for the argument ``what`` (SRC, DST, PATH...): a local ``Path``, never a URL."""

    def parse(value: str) -> Path:
        try:
            return local_path(value, "", why)
        except LocationError as e:
            raise typer.BadParameter(e.message) from None

    parse.__name__ = f"parse_{what.lower()}"
    return parse


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
