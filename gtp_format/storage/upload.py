"""The bucket side of the one writer: a finished local work folder uploaded in commit order.

:class:`gtp_format.writer.checkpoint.CheckpointWriter` builds every output in a hidden work folder
and commits it with one no-replace rename. A bucket has no rename, so for an ``s3://`` target the
work folder is local staging (``CKPT_S3_STAGING``, default the temp directory) and the commit is the
upload, in an order that makes every interrupted state invisible:

1. refuse if anything already lies below the target prefix (no-replace: never mix files with an
   existing checkpoint);
2. the data objects (two at a time), each a multipart upload: an upload that is not completed is invisible to every
   listing and read; each is created only where no object is (``If-None-Match: *``, as the commit
   object): step 1 is a check, not a lock, and a second writer that started on the same prefix
   meanwhile had its objects overwritten by ours (then, when its commit object failed, it deleted what
   it had "created": ours), so the first object it finds taken makes this upload :class:`Taken`;
3. ``.metadata`` (or the index), the chunk records and the manifest;
4. ``metadata.json`` last, as a conditional create (``If-None-Match: *``): the *commit object*. The
   reader takes a bucket prefix for a checkpoint only once it exists
   (:func:`gtp_format.reader.locate.locate`), and a writer that finds it taken refuses, leaving it;
5. a nested output's latest marker after the commit, and the run's latest marker (``set_latest``)
   after that.

On a failure the objects this upload created are deleted (never others); a writer killed
mid-way leaves data objects without a commit object, which no reader takes for a checkpoint.

Every object carries its writer's random token as user metadata (:data:`OWNER_ATTRIBUTE`: S3's
``x-amz-meta-ckpt-writer``). The ranks of a torchrun job that upload one output share one token, so a survivor can
prove which objects a killed rank had created (no other writer knows the token) and remove them (:func:`sweep`).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from gtp_format.errors import FormatError
from gtp_format.names import (
    ATTESTATION_FILE,
    CHUNK_RECORDS_FILE,
    DCP_METADATA_FILE,
    GTP_INDEX_FILE,
    LATEST_FILE,
    MANIFEST_FILE,
    WORK_TOKEN_FILE,
)
from gtp_format.names import MEGATRON_METADATA_FILE as COMMIT_OBJECT
from gtp_format.storage import objects
from gtp_format.storage.limits import STAGING_ENV as STAGING_ENV  # the setting its refusals name
from gtp_format.storage.location import ObjectURL
from gtp_format.work import signals_deferred

PART = 16 << 20  # multipart part size; obstore uploads parts of one object concurrently
CONCURRENCY = 8
# data objects uploaded at once, each with CONCURRENCY parts of PART in flight (256 MiB of buffers at most):
# against boto3's upload_file of the same files on moto (best of 2-3 interleaved rounds, 2 cores), one at a
# time 0.92x / 0.88x at 304.8 MB / 1.2 GB, two 1.51x / 1.22x, four 1.47x / 0.79x
FILES_AT_ONCE = 2
_SIDE = (DCP_METADATA_FILE, GTP_INDEX_FILE, CHUNK_RECORDS_FILE, MANIFEST_FILE, ATTESTATION_FILE)  # after the data


DATA, SIDE, COMMIT, LATEST = range(4)  # the upload's steps 2-5, in order (module docstring)


def step_of(rel: str, commit: str | None = None) -> int:
    """Which step uploads ``rel``: :data:`DATA`, :data:`SIDE`, :data:`COMMIT` or :data:`LATEST`
    (``commit``: see :func:`commit_order`)."""
    base = rel.rsplit("/", 1)[-1]
    last = rel == commit if commit is not None else base == COMMIT_OBJECT
    return COMMIT if last else LATEST if base == LATEST_FILE else SIDE if base in _SIDE else DATA


def commit_order(folder: Path, commit: str | None = None) -> list[str]:
    """Relative names of ``folder``'s files: data first, then the side files, the commit object, the
    latest marker last. ``commit``: the commit object's relative name for an output without
    ``metadata.json`` (a Hugging Face folder: its ``config.json``); default every ``metadata.json``."""
    names = sorted(str(p.relative_to(folder)) for p in folder.rglob("*")
                   if p.is_file() and p.relative_to(folder) != Path(WORK_TOKEN_FILE))  # the writer's, not the output's
    return sorted(names, key=lambda n: (step_of(n, commit), n))


class Upload:
    """One output's upload to ``target``; :meth:`run` does steps 1-5, :meth:`undo` removes what it created.

    ``commit``: see :func:`commit_order`; ``fault``: the runtime's fault hook (``before_commit_object``)."""

    def __init__(self, target: ObjectURL, fault: Callable[[str], None] | None = None,
                 commit: str | None = None, owner: str | None = None) -> None:
        # every put of one upload through one client: a target bound to no session gets a state of its own
        bound = isinstance(target.state, objects.BucketState)
        self.target = target if bound else target.bound(objects.BucketState(scoped=False))
        self.fault, self.commit = fault, commit
        self.owner = owner or new_owner()  # the token every object of this upload carries (module docstring)
        self.created: list[str] = []

    def _put(self, local: Path, rel: str, create: bool = False) -> None:
        """Create the object ``rel`` from ``local`` where none is; ``create``: it is the commit object (the
        point fault hooks and tests key on; every object is put with ``If-None-Match: *``, see step 2)."""
        import obstore

        key = self.target.key(rel)
        # the object created and noted as created with no signal handler between: :meth:`undo` must know of
        # every object this upload made (a SIGTERM handled right after the put once left one behind)
        with signals_deferred():
            try:
                obstore.put(objects.store(self.target), key, local, mode="create", chunk_size=PART,
                            max_concurrency=CONCURRENCY, attributes={OWNER_ATTRIBUTE: self.owner})
            except Exception as e:  # noqa: BLE001 - one line naming the object
                from obstore import exceptions as ox

                if isinstance(e, ox.AlreadyExistsError):
                    raise Taken(self.target) from None
                raise objects.describe_error(e, str(self.target / rel)) from None
            finally:
                objects.forget_listings(self.target)  # the prefix holds another object now (or may: a failed part)
            self.created.append(key)

    def run(self, work: Path, uploaded: frozenset[str] = frozenset()) -> None:
        """Steps 1-5 for ``work``'s files but ``uploaded`` (relative names other uploads of this output created
        already, create-only: a torchrun job's ranks on several nodes, :meth:`put_files`); with such names,
        step 1 was the caller's, before any of them (the prefix now holds them)."""
        if not uploaded and objects.is_prefix(self.target):
            raise Taken(self.target)
        names = [n for n in commit_order(work, self.commit) if n not in uploaded]
        steps = [step_of(n, self.commit) for n in names]
        self._put_all(work, [n for n, st in zip(names, steps) if st == DATA])  # FILES_AT_ONCE at a time
        for rel, st in zip(names, steps):
            if st == DATA:
                continue
            if st == COMMIT and self.fault is not None:
                self.fault("before_commit_object")
            self._put(work / rel, rel, create=st == COMMIT)

    def put_files(self, work: Path, rels: list[str]) -> None:
        """Create the data objects ``rels`` (relative to ``work``) now, ahead of the commit (step 2 for some of
        the files: a node's share of a torchrun job's output, uploaded from that node); :meth:`undo` removes
        them. Never the commit object, nor a side file."""
        if any(step_of(r, self.commit) != DATA for r in rels):
            raise ValueError(f"not data files: {[r for r in rels if step_of(r, self.commit) != DATA][:3]}")
        self._put_all(work, rels)

    def _put_all(self, work: Path, rels: list[str]) -> None:
        """Upload ``rels`` (data objects: none is a commit point) :data:`FILES_AT_ONCE` at a time. After a
        failure no further upload starts; the first error is raised once the uploads in flight have ended (so
        :meth:`undo` sees every object created)."""
        if FILES_AT_ONCE <= 1 or len(rels) <= 1:
            for rel in rels:
                self._put(work / rel, rel)
            return
        import threading
        from concurrent.futures import ThreadPoolExecutor

        failed = threading.Event()

        def one(rel: str) -> None:
            if failed.is_set():
                return
            try:
                self._put(work / rel, rel)
            except BaseException:
                failed.set()
                raise

        with ThreadPoolExecutor(FILES_AT_ONCE, thread_name_prefix="s3-upload") as pool:
            futures = [pool.submit(one, rel) for rel in rels]
            errors = [f.exception() for f in futures]
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise first

    def run_file(self, local: Path) -> None:
        """One file as the one object ``target`` (``export --to torch``), created only where nothing is
        (``If-None-Match: *``); its upload is its commit: a multipart upload that was not completed is
        invisible, so a killed one leaves nothing."""
        if objects.is_prefix(self.target) or (self.target.prefix and
                                              objects.head_size(self.target.parent, self.target.name) is not None):
            raise Taken(self.target)
        if self.fault is not None:
            self.fault("before_commit_object")
        self._put(local, "", create=True)

    def undo(self) -> None:
        """Delete the objects this upload created (best effort: a store that stopped answering keeps them,
        and without their commit object no reader takes them for a checkpoint)."""
        import obstore

        if not self.created:
            return
        created, self.created = self.created, []
        try:
            obstore.delete(objects.store(self.target), created)
        except Exception:  # noqa: BLE001, S110 - best effort, see the docstring
            pass
        objects.forget_listings(self.target)


OWNER_ATTRIBUTE = "ckpt-writer"  # user metadata: the writer's token
SWEEP_DEPTH = 2  # an output's objects lie at most one folder down (a nested output's iteration folder)
SWEEP_AT_ONCE = 8  # metadata requests in flight


def new_owner() -> str:
    """A writer's token: 128 random bits, which no other writer can guess."""
    return secrets.token_hex(16)


def sweep(target: ObjectURL, owner: str) -> list[str]:
    """Delete every object below ``target`` (at most :data:`SWEEP_DEPTH` levels) that carries ``owner`` as its
    :data:`OWNER_ATTRIBUTE`: the objects a writer that holds the token created, a killed one's too; an object without
    the token (another writer's) is never touched. Only for a point where no commit of ``target`` can happen: the
    caller knows no rank committed or will. Best effort as :meth:`Upload.undo`: returns the keys deleted."""
    import obstore

    store = objects.store(target)
    keys: list[str] = []
    folders = [(target, 1)]
    while folders:
        root, depth = folders.pop()
        for name, size in objects.list_names(root).items():
            if size is not None:
                keys.append(root.key(name))
            elif depth < SWEEP_DEPTH:
                folders.append((root / name, depth + 1))

    def carries(key: str) -> bool:
        try:
            got = obstore.get(store, key, options={"head": True})
        except Exception:  # noqa: BLE001 - gone, or unreadable: not proven this writer's
            return False
        return got.attributes.get(OWNER_ATTRIBUTE) == owner

    with ThreadPoolExecutor(SWEEP_AT_ONCE, thread_name_prefix="s3-sweep") as pool:
        mine = [k for k, ok in zip(keys, pool.map(carries, keys)) if ok]
    if mine:
        try:
            obstore.delete(store, mine)
        except Exception:  # noqa: BLE001 - best effort, as undo
            pass
    objects.forget_listings(target)
    return mine


class Taken(FormatError):
    """The target prefix holds objects already (or its commit object appeared meanwhile)."""

    def __init__(self, target: ObjectURL) -> None:
        super().__init__(f"{target}: objects already exist under this prefix (or appeared while this was written); "
                         "nothing there was replaced or deleted; pick a new prefix")


def put_marker(url: ObjectURL, text: str) -> None:
    """The run's latest marker below ``url``'s parent, replaced (a single PUT is atomic on S3)."""
    import obstore

    marker = url.parent / LATEST_FILE
    try:
        obstore.put(objects.store(url), marker.key(), text.encode(), mode="overwrite")
    except Exception as e:  # noqa: BLE001
        raise objects.describe_error(e, str(marker)) from None
    finally:
        objects.forget_listings(url)


def is_bucket(target: Any) -> bool:
    return isinstance(target, ObjectURL)
