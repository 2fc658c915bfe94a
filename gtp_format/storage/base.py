"""The one storage interface: where a checkpoint's bytes live, a local folder or an S3-API bucket.

Every reader, the writer, the gate, the copies and the runtime reach a checkpoint's files through a
:class:`Storage` chosen once from the location (:func:`storage_for`), never by testing the location's type
themselves: a second object store is one more implementation here, not a branch in each of them. The
operations are the ones a checkpoint needs, in the spirit of fsspec's filesystem and torchtitan's checkpoint
storage, with this project's bounds:

* **open** a file for ranged reads (``pread``), confined to the checkpoint: a folder walks each component
  with ``O_NOFOLLOW`` from the folder's descriptor (:mod:`gtp_format.storage.local`), a bucket asks only for
  keys below its prefix (:mod:`gtp_format.storage.objects`);
* **list** a folder's entries, bounded (a bucket's listing is streamed, at most ``MAX_LISTED`` keys and
  ``LIST_SECONDS``);
* **stat** a file: its size and the bytes it really *stores* (a sparse local file stores fewer; the hole rule
  of :mod:`gtp_format.reader.storage` budgets from those, never from the size); an object stores every byte;
* **put** a file where none is (create-only), **commit** a finished work folder atomically (a folder: one
  no-replace rename; a bucket: the ordered upload whose last object is the commit object,
  :mod:`gtp_format.storage.upload`), and **remove** only what this writer made.

A bucket's requests go through the bucket state of the command's session
(:class:`gtp_format.session.Session`, :class:`gtp_format.storage.objects.BucketState`): its clients,
listings, caches and threads.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

from gtp_format.errors import FormatError
from gtp_format.storage import local, objects, upload
from gtp_format.storage.limits import Limits
from gtp_format.storage.location import Location, ObjectURL, parse_location
from gtp_format.storage.paths import unsafe_reason
from gtp_format.work import WorkFolders, new_work

T = TypeVar("T")


@dataclass(frozen=True)
class Stat:
    """A regular file's ``size`` and the bytes it really ``stored`` (at most its size)."""

    size: int
    stored: int


class Storage(ABC):
    """A checkpoint location's files (``rel``: a plain relative name below :attr:`location`)."""

    location: Location
    limits: Limits  # the session's (gtp_format.storage.limits), read once; a storage without one has its own
    made: WorkFolders | None = None  # the session's record of the work folders it created (gtp_format.work)
    in_place: bool  # the work folder lies beside the target and its commit is a rename (else: staged, uploaded)
    has_holes: bool  # a file may store fewer bytes than its size (a sparse local file); an object never does
    # every request is a network round trip: reads are worth planning, coalescing and fetching ahead (a
    # folder's page cache and read-ahead do that already)
    remote: bool

    # -- reading ------------------------------------------------------------------------------------------

    @abstractmethod
    def open(self, rel: str, what: str = "data file") -> BinaryIO:
        """A regular file below the location, opened for ranged reads; one line naming it if it is not one."""

    @abstractmethod
    def stat(self, rel: str) -> Stat | None:
        """The file's size and stored bytes, or None when ``rel`` is no regular file reachable below the
        location (never an error; nothing is opened)."""

    @abstractmethod
    def size(self, rel: str, what: str = "data file") -> int:
        """The size of a regular file below the location; one line naming it if it is not one."""

    @abstractmethod
    def is_folder(self, rel: str = "") -> bool:
        """Whether ``rel`` is a folder below the location (a bucket: a prefix that holds objects)."""

    @abstractmethod
    def list(self) -> list[str]:
        """The location's entry names, sorted; one line if it cannot be listed or holds nothing."""

    @abstractmethod
    def entries(self) -> dict[str, int | None]:
        """The location's entries, files with their sizes and folders with None; empty if there is none."""

    @abstractmethod
    def read_range(self, rel: str, offset: int, length: int,
                   into: Callable[[int], memoryview] | None = None, cached: bool = False) -> bytearray | memoryview:
        """Exactly ``length`` bytes at ``offset`` of ``rel`` (see :func:`gtp_format.reader.storage.read_range`)."""

    @abstractmethod
    def read_small(self, limit: int, what: str, fix: str) -> bytes:
        """The whole file at :attr:`location`, refused over ``limit`` bytes."""

    def reads_everything(self, budget: int) -> None:  # noqa: B027 - a folder has nothing to fetch ahead
        """The command reads every byte it opens: a bucket fetches its small data objects whole at its listings,
        up to ``budget`` bytes (:meth:`gtp_format.storage.objects.BucketState.reads_everything`)."""

    def exists(self) -> bool:
        """Whether anything is at the location: a folder, a file, or objects under the prefix."""
        return self.is_folder()

    def settings_problem(self, writing: bool = False) -> str | None:
        """Why no request could be made here (a bucket without credentials), or None; a setting that does not
        parse raises its one line. ``writing``: the place an output is built first is checked too. Asked
        before a job starts, so that no rank trains for nothing."""
        return None

    # -- writing ------------------------------------------------------------------------------------------

    @abstractmethod
    def check_free(self, tool: str, fix: str) -> None:
        """Refuse, in one line, a target that exists already (or has no parent folder to be created in)."""

    @abstractmethod
    def work_parent(self) -> Path:
        """The local folder a writer builds its hidden work folder in (a bucket's: its session's staging folder,
        :attr:`gtp_format.storage.limits.Limits.staging`)."""

    @abstractmethod
    def work_target(self, parent: Path) -> Path:
        """The name the work folder in ``parent`` is derived from (:func:`gtp_format.work.new_work`)."""

    def new_work(self, target: Path, tag: str) -> Path:
        """A new work folder of this writer's for ``target`` (:func:`gtp_format.work.new_work`), recorded by the
        session that chose this storage (:attr:`made`)."""
        return new_work(target, tag, self.made)

    @abstractmethod
    def commit(self, work: Path, fault: Callable[[str], None] | None = None, commit_object: str | None = None,
               uploaded: frozenset[str] = frozenset()) -> None:
        """Publish the finished local ``work`` folder at the location, atomically and never over anything:
        ``FileExistsError`` (a folder) or :class:`gtp_format.storage.upload.Taken` (a bucket) when the target
        appeared meanwhile; what this commit made is removed on a failure. ``uploaded``: relative names of
        ``work`` already created at a bucket location by other uploads of this output (each node of a torchrun
        job uploads its own files); never sent again (a folder has none)."""

    @abstractmethod
    def committed(self, work: Path) -> None:
        """After :meth:`commit`: what is left of the work (a folder: the ownership token in the committed folder,
        which is no checkpoint file, :mod:`gtp_format.work`; a bucket: the uploaded local copy) removed, and
        the commit made durable."""

    @abstractmethod
    def put(self, local_file: Path) -> None:
        """The one complete file ``local_file`` (built in :meth:`work_parent`) as the location itself, created only
        where nothing is (``FileExistsError`` or :class:`gtp_format.storage.upload.Taken`); its put is its
        commit."""

    @abstractmethod
    def set_latest(self, text: str) -> None:
        """Replace the latest marker beside the location (in its parent) with ``text``, atomically."""


class LocalStorage(Storage):
    """A checkpoint in a local folder (:mod:`gtp_format.storage.local`)."""

    in_place = True
    has_holes = True
    remote = False

    def __init__(self, location: Path, limits: Limits | None = None, made: WorkFolders | None = None) -> None:
        self.location = location
        self.limits = limits or Limits()
        self.made = made

    def open(self, rel: str, what: str = "data file") -> BinaryIO:
        return local.open_file(self.location, rel, what, self.limits)

    def stat(self, rel: str) -> Stat | None:
        if unsafe_reason(rel) is not None:
            return None
        st = local.regular_stat(self.location, rel)
        return None if st is None else Stat(st.st_size, local.stored_bytes(st))

    def size(self, rel: str, what: str = "data file") -> int:
        return local.file_size(self.location, rel, what)

    def is_folder(self, rel: str = "") -> bool:
        return local.is_folder(self.location, rel) if rel else self.location.is_dir()

    def list(self) -> list[str]:
        return local.list_names(self.location)

    def entries(self) -> dict[str, int | None]:
        out: dict[str, int | None] = {}
        for name in self.list():
            st = self.stat(name)
            out[name] = None if st is None else st.size
        return out

    def read_range(self, rel: str, offset: int, length: int,
                   into: Callable[[int], memoryview] | None = None, cached: bool = False) -> bytearray | memoryview:
        return local.read_range(self.location, rel, offset, length, into, self.limits, cached)

    def read_small(self, limit: int, what: str, fix: str) -> bytes:
        return local.read_small(self.location, limit, what, fix)

    def exists(self) -> bool:
        return self.location.exists()

    def check_free(self, tool: str, fix: str) -> None:
        dst = self.location
        if os.path.lexists(dst):
            raise FormatError(f"{dst} already exists; {tool} never overwrites: {fix}")
        if not dst.parent.is_dir():
            raise FormatError(f"{dst.parent} (the parent of DST) does not exist: no such folder to create "
                              f"{dst.name} in; create it first")

    def work_parent(self) -> Path:
        return self.location.parent

    def work_target(self, parent: Path) -> Path:
        return self.location

    def commit(self, work: Path, fault: Callable[[str], None] | None = None, commit_object: str | None = None,
               uploaded: frozenset[str] = frozenset()) -> None:
        from gtp_format.commit import commit_new_folder

        commit_new_folder(work, self.location)

    def committed(self, work: Path) -> None:
        from gtp_format.commit import fsync_dir
        from gtp_format.work import drop_token

        drop_token(self.location)
        fsync_dir(self.location)

    def put(self, local_file: Path) -> None:
        from gtp_format.commit import commit_file

        commit_file(local_file, self.location)  # renamed, no-replace

    def set_latest(self, text: str) -> None:
        from gtp_format.commit import write_atomic
        from gtp_format.names import LATEST_FILE

        write_atomic(self.location.parent / LATEST_FILE, text)


class BucketStorage(Storage):
    """A checkpoint under a key prefix of an S3-API bucket (:mod:`gtp_format.storage.objects`,
    :mod:`gtp_format.storage.upload`), read and written through ``state``, its session's bucket state."""

    in_place = False
    has_holes = False
    remote = True

    def __init__(self, location: ObjectURL, state: objects.BucketState | None = None) -> None:
        # a location bound to no session gets a state of its own here (unscoped: no listing is reused), so that
        # everything read or written through this storage and the locations it hands out shares one client
        state = state or (location.state if isinstance(location.state, objects.BucketState) else None)
        self.location = location.bound(state or objects.BucketState(scoped=False))
        self.limits = objects.state_of(self.location).limits
        self.made = objects.state_of(self.location).made

    def open(self, rel: str, what: str = "data file") -> BinaryIO:
        return objects.ObjectFile(self.location, rel, what)  # type: ignore[return-value]

    def stat(self, rel: str) -> Stat | None:
        if unsafe_reason(rel) is not None:
            return None
        size = objects.head_size(self.location, rel)
        return None if size is None else Stat(size, size)  # an object stores every byte the store reports

    def size(self, rel: str, what: str = "data file") -> int:
        return objects.object_size(self.location, rel, what)

    def is_folder(self, rel: str = "") -> bool:
        return unsafe_reason(rel) is None and objects.is_prefix(self.location, rel) if rel else \
            objects.is_prefix(self.location)

    def list(self) -> list[str]:
        names = objects.list_names(self.location)
        if not names:
            raise FormatError(f"{self.location} does not exist (no object below it); pass a checkpoint prefix "
                              "(iter_XXXXXXX) or its parent")
        return sorted(names)

    def entries(self) -> dict[str, int | None]:
        return objects.list_names(self.location)

    def read_range(self, rel: str, offset: int, length: int,
                   into: Callable[[int], memoryview] | None = None, cached: bool = False) -> bytearray | memoryview:
        got = objects.read_range(self.location, rel, offset, length)
        if into is None:
            return got
        view = into(length)[:length]
        view[:] = got
        return view

    def read_small(self, limit: int, what: str, fix: str) -> bytes:
        return objects.read_small(self.location, limit, what, fix)

    def reads_everything(self, budget: int) -> None:
        objects.reads_everything(self.location, budget)

    def settings_problem(self, writing: bool = False) -> str | None:
        problem = objects.credentials_problem(self.location.bucket)
        if problem is None:
            objects.store(self.location)  # the client as the ranks will build it: the timeout setting too
        if writing:
            self.limits.staging  # noqa: B018 - where each rank builds its files before the upload: it must exist
        return problem

    def exists(self) -> bool:
        return True  # a prefix is named, not made: whether it holds a checkpoint is the listing's to say

    def check_free(self, tool: str, fix: str) -> None:
        dst = self.location
        if objects.is_prefix(dst) or (dst.prefix and objects.head_size(dst.parent, dst.name) is not None):
            raise upload.Taken(dst)

    def work_parent(self) -> Path:
        return self.limits.staging

    def work_target(self, parent: Path) -> Path:
        # a bucket's top level (an empty prefix) has no name: the work folder is named after the bucket
        return parent / (self.location.name or self.location.bucket)

    def commit(self, work: Path, fault: Callable[[str], None] | None = None, commit_object: str | None = None,
               uploaded: frozenset[str] = frozenset()) -> None:
        up = upload.Upload(self.location, fault, commit_object)
        try:
            up.run(work, uploaded)
        except BaseException:
            up.undo()
            raise

    def committed(self, work: Path) -> None:
        from gtp_format.work import remove_owned

        remove_owned(work)  # its token last, beside it: a kill here leaves it proven (gtp_format/work.py)

    def put(self, local_file: Path) -> None:
        upload.Upload(self.location).run_file(local_file)

    def set_latest(self, text: str) -> None:
        upload.put_marker(self.location, text)


def storage_for(location: Location | str | os.PathLike[str] | Storage, session: Any = None) -> Storage:
    """The storage of ``location`` (parsed if text: :func:`gtp_format.storage.location.parse_location`), read
    and written through ``session`` (:class:`gtp_format.session.Session`); without one, a bucket location
    uses the session it was bound to, else a state of its own. A :class:`Storage` is returned as it is."""
    if isinstance(location, Storage):
        return location
    loc = parse_location(location) if isinstance(location, str | ObjectURL) else Path(location)
    if isinstance(loc, ObjectURL):
        return BucketStorage(loc, session.buckets if session is not None else None)
    if session is None:
        return LocalStorage(loc)
    return LocalStorage(loc, session.limits, session.work)


def bind(value: T, state: objects.BucketState) -> T:
    """``value`` with every bucket location in it bound to ``state`` (lists and tuples element by element);
    anything else as it is."""
    if isinstance(value, ObjectURL):
        return value.bound(state)  # type: ignore[return-value]
    if isinstance(value, list | tuple) and any(isinstance(v, ObjectURL) for v in value):
        return type(value)(bind(v, state) for v in value)  # type: ignore[return-value]
    return value
