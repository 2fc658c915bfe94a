"""One command's session: the state a ``ckpt`` command, or one save or load of the runtime, keeps while it runs.

What it owns: what the command keeps of the buckets it reads (the sizes and listings, the warmed side
files, the small-read blocks, the S3 clients and the fetch threads: :class:`BucketState`) and where an
``s3://`` output is staged before its upload. Nothing of it outlives the session: a later command reads
the store as it is then, and its threads end when it closes. A ``ckpt`` process runs one command, so a
client and threads of the session's own cost it nothing a process-wide cache would save.

How it reaches the code that reads: explicitly. The command (``ckpt_tool``'s error decorator; the
runtime's save and load) creates the session and binds its locations to it (:meth:`Session.bind`); a bound
bucket location carries the session's state to every location derived from it (``url / name``,
``url.parent``), and :func:`gtp_format.storage.base.storage_for` takes the session too. There is no
module-level state: two sessions in one process (a test running commands in-process, the runtime's save
beside its load) share nothing.

Why a session at all: a bucket's state used to live in module globals scoped by the CLI's error decorator,
so a save or a load of the runtime ran outside any scope and library callers shared one set of caches.
"""

from __future__ import annotations

from typing import Any, TypeVar

from gtp_format.storage import base
from gtp_format.storage.limits import Limits
from gtp_format.storage.objects import BucketState
from gtp_format.work import WorkFolders

T = TypeVar("T")


class Session:
    """The state of one command (see the module docstring); a context manager that closes it.

    ``scoped``: sizes and listings are reused within the session (a ``ckpt`` command); the runtime's saves
    and loads ask the store each time (``scoped=False``), as they always did.
    """

    def __init__(self, scoped: bool = True) -> None:
        self.limits = Limits()  # each read once, at its first use (gtp_format.storage.limits)
        self.work = WorkFolders()  # the work folders its writers created (gtp_format.work)
        self.buckets = BucketState(scoped=scoped, limits=self.limits, made=self.work)

    def bind(self, value: T) -> T:
        """``value`` (a location, or a list or tuple of them; anything else as it is) read and written
        through this session."""
        return base.bind(value, self.buckets)

    def bind_all(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """A command's keyword arguments with every location among them bound (:meth:`bind`)."""
        return {k: self.bind(v) for k, v in kwargs.items()}

    def storage(self, location: Any) -> base.Storage:
        """:func:`gtp_format.storage.base.storage_for` the location, in this session."""
        return base.storage_for(location, self)

    def close(self) -> None:
        self.buckets.close()

    def end(self, failed: bool) -> None:
        """The session's end, knowing its outcome: after a failure, the work folders it made and left are
        removed (token-proven only: :meth:`gtp_format.work.WorkFolders.remove_left`); then it is closed. A
        success keeps them (each was committed, or handed on)."""
        try:
            if failed:
                self.work.remove_left()
        finally:
            self.close()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        self.end(kind is not None)
