"""The one parser of a checkpoint location: a local path, or a ``scheme://bucket/prefix`` URL.

Why one function: ``Path("s3://bucket/run")`` is the local path ``s3:/bucket/run``, so any code that
turns the user's text into a ``Path`` before looking at its scheme writes a local folder named after
the URL. Every place a checkpoint location comes in (the launcher's ``--save`` and ``--load``, each
``ckpt`` command's SRC and DST) calls :func:`parse_location` on the raw text first, and a text with a
scheme is never handed on as a ``Path``.

Rules:

* ``NAME:/...`` (one slash or more) with ``NAME`` a URL scheme (RFC 3986: a letter, then letters,
  digits, ``+ - .``) is a URL. A local folder whose first component ends in ``:`` is still reachable
  as ``./NAME:/...``.
* Supported schemes are listed in :data:`SCHEMES`, each with the reason; any other is refused in one
  line naming it. ``file://`` is refused too: the path itself says the same.
* An object URL needs two slashes, a bucket that follows S3's naming rules, and a key prefix of
  plain components (no ``.``, ``..``, empty component, backslash or control character), so the
  prefix can never reach a key outside what the user named.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gtp_format.errors import EXIT_BAD_INPUT, FormatError

# scheme -> why it is (or is not yet) taken; only "s3" is an object store this project speaks.
SCHEMES: dict[str, str] = {
    "s3": "Amazon S3 and S3-API stores (MinIO, Ceph RGW, moto); endpoint and credentials from the AWS environment",
}

_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):(/+)(.*)$", re.DOTALL)
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")  # S3's bucket naming rules (3-63 characters)
_BAD_KEY_CHARS = re.compile(r"[\x00-\x1f\x7f\\]")


class LocationError(FormatError):
    """A location that is not a usable path or URL: a usage error (exit 2)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, EXIT_BAD_INPUT)


@dataclass(frozen=True)
class ObjectURL:
    """``scheme://bucket/prefix``: a checkpoint (or its run directory) under a key prefix of one bucket.

    ``prefix`` has no leading or trailing slash ("" is the bucket's top level). ``state``: the bucket state
    of the session the location is bound to (:meth:`bound`; :class:`gtp_format.storage.objects.BucketState`),
    handed on to every location derived from it; not part of the location's identity (equality, hash,
    ``repr``) and never pickled.
    """

    scheme: str
    bucket: str
    prefix: str
    state: Any = field(default=None, compare=False, hash=False, repr=False)

    def __str__(self) -> str:
        return f"{self.scheme}://{self.bucket}/{self.prefix}" if self.prefix else f"{self.scheme}://{self.bucket}"

    def key(self, rel: str = "") -> str:
        """The object key of ``rel`` (a plain relative name) below the prefix."""
        return "/".join(p for p in (self.prefix, rel) if p)

    # The few path operations the readers and the writer use, so that a bucket and a folder are the same
    # code above the storage functions. ``os.fspath`` raises: no local open, stat or ``Path()`` can take a
    # URL for a local path by accident (``Path("s3://b/r")`` is the local ``s3:/b/r``).

    def __truediv__(self, rel: str) -> ObjectURL:
        parts = [p for p in str(rel).split("/") if p]
        if any(p in (".", "..") for p in parts):
            raise LocationError(f"{self}: {rel!r} would leave the prefix")
        return ObjectURL(self.scheme, self.bucket, "/".join([*([self.prefix] if self.prefix else []), *parts]),
                         self.state)

    @property
    def name(self) -> str:
        return self.prefix.rsplit("/", 1)[-1] if self.prefix else ""

    @property
    def parent(self) -> ObjectURL:
        return ObjectURL(self.scheme, self.bucket, self.prefix.rsplit("/", 1)[0] if "/" in self.prefix else "",
                         self.state)

    def with_name(self, name: str) -> ObjectURL:
        return self.parent / name

    def bound(self, state: Any) -> ObjectURL:
        """This location, read and written through ``state`` (a session's bucket state)."""
        return self if self.state is state else ObjectURL(self.scheme, self.bucket, self.prefix, state)

    def __reduce__(self) -> tuple[Any, ...]:
        return ObjectURL, (self.scheme, self.bucket, self.prefix)  # a session stays in its process

    def __fspath__(self) -> str:
        raise TypeError(f"{self} is an object-store location, not a local path")


Location = Path | ObjectURL


def _shown(what: str, text: str) -> str:
    """The head of a message: the argument's name (when given) and the text as typed."""
    shown = repr(text[:200]) if len(text) <= 200 else repr(text[:200]) + "..."
    return f"{what} {shown}" if what else shown


def parse_location(text: str | os.PathLike[str], what: str = "PATH") -> Location:
    """``text`` (a CLI argument or flag value, named ``what`` in errors) as a local ``Path`` or an
    :class:`ObjectURL`; :class:`LocationError` for an unsupported scheme or a malformed URL."""
    if isinstance(text, ObjectURL):
        return text
    if not isinstance(text, str):
        return Path(text)  # already a path: no scheme to lose any more
    m = _URL.match(text)
    if m is None:
        return Path(text)
    scheme, slashes, rest = m.group(1).lower(), m.group(2), m.group(3)
    if scheme == "file":
        raise LocationError(f"{_shown(what, text)}: file:// URLs are not taken; pass the path itself")
    if scheme not in SCHEMES:
        raise LocationError(f"{_shown(what, text)}: the URL scheme {scheme}:// is not supported (supported: "
                            f"{', '.join(s + '://' for s in SCHEMES)}); for a local folder named so, write ./{text}")
    if slashes != "//":
        raise LocationError(f"{_shown(what, text)}: write {scheme}://BUCKET/PREFIX (two slashes); for a local "
                            f"folder named so, write ./{text}")
    bucket, _, prefix = rest.partition("/")
    if not _BUCKET.match(bucket) or ".." in bucket:
        raise LocationError(f"{_shown(what, text)}: {bucket!r} is not a bucket name (3-63 lowercase letters, digits, "
                            f"'.' and '-'); write {scheme}://BUCKET/PREFIX")
    prefix = prefix.rstrip("/")
    parts = prefix.split("/") if prefix else []
    for part in parts:
        if part in ("", ".", "..") or _BAD_KEY_CHARS.search(part):
            raise LocationError(f"{_shown(what, text)}: the key prefix has the component {part!r}; use plain "
                                "names separated by single slashes")
    return ObjectURL(scheme, bucket, prefix)


def local_path(text: str | os.PathLike[str], what: str = "PATH", why: str = "") -> Path:
    """``text`` as a local ``Path``: a URL (supported or not) is refused in one line, never taken for a
    folder name. ``why``: what the caller cannot do with an object store and the fix, for the message."""
    loc = parse_location(text, what)
    if isinstance(loc, ObjectURL):
        why = why or "this takes a local path only; copy the checkpoint to a local folder first"
        raise LocationError(f"{what} {loc}: {why}" if what else f"{loc}: {why}")
    return loc


def within(inner: Location, outer: Location) -> bool:
    """Whether ``inner`` is ``outer`` or lies below it: the nesting rule of SRC and DST.

    Why here, beside the parser: every command with a SRC and a DST (reshard, export, import,
    migrate-aliased) refuses a DST inside SRC or SRC inside DST through
    :func:`gtp_format.writer.checkpoint.check_destination`, and the rule has to be the same for a
    folder and a bucket. A key prefix nests component-wise (``s3://b/run2`` is not below
    ``s3://b/run``; ``s3://b`` holds every prefix of ``b``); folders compare with every symlink resolved
    (``os.path.realpath``: a SRC named through a link is still SRC; a DST that is a link exists, and is
    refused either way); a local path and a URL, or two buckets, never nest.
    """
    if isinstance(inner, ObjectURL) or isinstance(outer, ObjectURL):
        if not (isinstance(inner, ObjectURL) and isinstance(outer, ObjectURL)):
            return False
        if (inner.scheme, inner.bucket) != (outer.scheme, outer.bucket):
            return False
        return not outer.prefix or inner.prefix == outer.prefix or inner.prefix.startswith(outer.prefix + "/")
    a, b = Path(os.path.realpath(inner)), Path(os.path.realpath(outer))
    return a == b or b in a.parents
