"""The limits a command obeys that a user may change through the environment, read once per session.

Each has one parser here (typed, validated, bounded, ASCII digits only; a bad value is one line naming the
variable and the fix) and :class:`Limits` reads each at its first use and keeps it: the session
(:class:`gtp_format.session.Session`) owns one and hands it to its storages (:mod:`gtp_format.storage.base`),
its bucket state (:class:`gtp_format.storage.objects.BucketState`) and its writer, so that a command sees one
value of each from start to end. At first use, not at the session's start: a local command never fails on a
bucket's setting it does not use, as before.

* ``CKPT_S3_TIMEOUT_S``: one request to the store (:func:`s3_timeout`);
* ``CKPT_MAX_HOLE_RATIO``: bytes a reader goes through per byte a file stores (:func:`hole_factor`;
  :mod:`gtp_format.storage.local` says why);
* ``CKPT_MAX_METADATA_BYTES``: the largest metadata file parsed (:func:`metadata_override`;
  :func:`gtp_format.reader.storage.metadata_limit`);
* ``CKPT_S3_STAGING``: where an ``s3://`` output is built before its upload (:func:`staging_dir`).
"""

from __future__ import annotations

import os
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from gtp_format.errors import FormatError
from gtp_format.numbers import NumberError, parse_float, parse_int

T = TypeVar("T")

TIMEOUT_ENV = "CKPT_S3_TIMEOUT_S"  # per-request timeout, seconds
DEFAULT_TIMEOUT_S = 60.0
MAX_TIMEOUT_S = 86400.0
# Bytes of a file's size a reader goes through per byte it stores. A migration's reset moments leave
# two thirds of a data file as holes (it stores 34% of its size: the smallest seen from our writers);
# 16x leaves a compressing filesystem five times that margin, while a reader still spends at most
# 16 zeroed pages per page the file really holds.
HOLE_FACTOR = 16
HOLE_FACTOR_ENV = "CKPT_MAX_HOLE_RATIO"
METADATA_LIMIT_ENV = "CKPT_MAX_METADATA_BYTES"
METADATA_FLOOR = 1 << 20  # genuine fixtures' .metadata are 13-106 KB; the env variable covers the rest
METADATA_CEILING = 4 << 30
STAGING_ENV = "CKPT_S3_STAGING"


def s3_timeout() -> float:
    """``CKPT_S3_TIMEOUT_S`` in seconds, (0, :data:`MAX_TIMEOUT_S`]; :data:`DEFAULT_TIMEOUT_S` when unset."""
    raw = os.environ.get(TIMEOUT_ENV)
    if raw is None:
        return DEFAULT_TIMEOUT_S
    try:  # ASCII digits only: float() read "\u0666\u0660" (Arabic-Indic) as 60
        value = parse_float(raw, TIMEOUT_ENV, 0.0, MAX_TIMEOUT_S)
    except NumberError:
        value = -1.0
    if not 0 < value <= MAX_TIMEOUT_S:  # "inf" made timedelta() raise an unexpected OverflowError
        raise FormatError(f"{TIMEOUT_ENV}={raw[:40]!r} is not a number of seconds in (0, {MAX_TIMEOUT_S:.0f}] written "
                          "in ASCII digits; set it to e.g. 60")
    return value


def hole_factor() -> int:
    """:data:`HOLE_FACTOR`, or the environment's override (ASCII digits, 1 to 2**20): the escape hatch
    the refusal names, for a genuine checkpoint on a filesystem that compresses zeros to nothing."""
    override = os.environ.get(HOLE_FACTOR_ENV)
    if override is None:
        return HOLE_FACTOR
    try:
        return parse_int(override, HOLE_FACTOR_ENV, 1, 1 << 20)
    except NumberError as e:
        raise FormatError(f"{e}; set it to an integer from 1 to {1 << 20}") from None


def metadata_override() -> int | None:
    """``CKPT_MAX_METADATA_BYTES`` (a byte count in ASCII digits), or None when unset."""
    override = os.environ.get(METADATA_LIMIT_ENV)
    if override is None:
        return None
    try:
        return parse_int(override, METADATA_LIMIT_ENV, 0)
    except NumberError:
        raise FormatError(f"{METADATA_LIMIT_ENV}={override[:40]!r} is not a byte count; set it to an integer "
                          "in ASCII digits") from None


def staging_dir() -> Path:
    """Where an ``s3://`` output is built before its upload: an existing folder, else one line naming
    :data:`STAGING_ENV` (a missing one, a file or a path below a file was "cannot write (Not a
    directory)" about the bucket URL, which named neither the folder nor the setting)."""
    raw = os.environ.get(STAGING_ENV)
    path = Path(raw or tempfile.gettempdir())
    try:
        if path.is_dir():
            return path
        why = "is not a folder" if path.exists() else "does not exist"
    except OSError as e:  # a symlink loop, a name too long
        why = f"cannot be used ({e.strerror or e})"
    where = f"{STAGING_ENV}={raw!r}" if raw else f"the temp folder {str(path)!r}"
    raise FormatError(f"{where} {why}: an s3:// output is built there before its upload; point {STAGING_ENV} at an "
                      "existing folder with room for the output")


class Limits:
    """One session's limits (see the module docstring): each read at its first use, then kept. A setting that
    does not parse raises its one line at every use, so a command that never needs it never fails on it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._read: dict[str, Any] = {}

    def _once(self, name: str, parse: Callable[[], T]) -> T:
        with self._lock:
            if name in self._read:
                return self._read[name]  # type: ignore[no-any-return]
        value = parse()
        with self._lock:
            return self._read.setdefault(name, value)  # type: ignore[no-any-return]

    @property
    def s3_timeout_s(self) -> float:
        return self._once("s3_timeout_s", s3_timeout)

    @property
    def hole_factor(self) -> int:
        return self._once("hole_factor", hole_factor)

    @property
    def metadata_override(self) -> int | None:
        return self._once("metadata_override", metadata_override)

    @property
    def staging(self) -> Path:
        return self._once("staging", staging_dir)
