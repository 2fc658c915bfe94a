"""The one checkpoint writer: every writer of a checkpoint (or an export) lays its output out and commits it here.

Why one: before, the runtime's save, ``reshard``, ``export`` and ``migrate-aliased`` each wrote the file
names, ``metadata.json``, the manifest's file section, the fsyncs, the commit and the latest marker
by hand; one copy checked DST once and then committed with a rename that moved aside and deleted a
DST that appeared meanwhile. Now they all call :class:`CheckpointWriter`:

* ``begin()``: removes stale work folders of dead processes beside the target
  (:mod:`gtp_format.work`; only finished copies of the iteration the latest marker names stay while that
  folder is missing, for the reader to recover), creates this writer's hidden work folder (its
  owner is in its name), and, in the main thread, makes SIGTERM raise, so a terminated writer
  removes its work as on an error;
* the caller writes its data files into ``folder`` (names from :func:`data_file_name`), each one
  fsynced by whoever wrote it, and hands their entries in: ``add_files(entries)`` (size and
  CRC-32C, e.g. gathered from all ranks) or ``add_file(name)`` (computed here, for rank 0's own
  ``.metadata``);
* ``finish(manifest)``: the manifest with every file's entry, then Megatron's ``metadata.json``
  (always the last file: its presence says the folder is finished), the latest marker for a
  nested output, and an fsync of the folders;
* ``commit()``: one rename into place that never replaces anything (``renameat2(RENAME_NOREPLACE)``,
  or an exclusive ``mkdir`` first): if the target appeared meanwhile it refuses with
  :class:`DestinationTaken` and leaves what is there alone. ``replace=True`` (the runtime, which
  re-saves the iteration its ``latest`` names) exchanges the folders atomically (``RENAME_EXCHANGE``)
  and removes the old copy only after;
* ``set_latest()``: the run directory's latest marker, replaced atomically, after the commit;
* ``abort()``: removes the work folder (never anything else); leaving the ``with`` block without a
  commit does it.

A runtime save (many ranks): rank 0 calls ``begin()`` and broadcasts ``work``; the other ranks
``adopt(work)`` and every rank writes its own ``__{rank}_{k}`` files there (DCP fsyncs them); the
entries are all-gathered, and rank 0 calls ``add_files``, ``add_file(".metadata")``, ``finish``,
``commit``, ``set_latest`` (``abort`` on any error). A background
(async) save is the same calls from the thread that does the writing, after the staging copy;
``set_latest`` only once every rank's files are durable.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

from gtp_format.commit import (
    commit_new_folder,
    fsync_dir,
    fsync_file,
    swap_in_folder,
    write_durable,
)
from gtp_format.errors import EXIT_BAD_INPUT, FormatError
from gtp_format.hashing import file_digests
from gtp_format.integrity.records import ChunkRecord, section, write_records
from gtp_format.lineage import ATTESTATION_FILE, LINEAGE_KEY, complete_lineage
from gtp_format.manifest import HASH_ALGORITHM, FileEntry, Manifest, write_manifest
from gtp_format.names import (
    CHUNK_RECORDS_FILE,
    CHUNK_RECORDS_SECTION,
    LATEST_FILE,
    LATEST_RE,
    MEGATRON_METADATA_FILE,
    iter_dir_name,
)
from gtp_format.storage.base import storage_for
from gtp_format.storage.location import ObjectURL, within
from gtp_format.work import (
    WorkFolder,
    clean_stale,
    drop_token,
    own_before_removal,
    remove_owned,
    sigterm_raises,
    token_of,
)

# Megatron's metadata.json: the torch_dist backend (its fields and values, as megatron-core writes
# them), and this project's safetensors layout.
TORCH_DIST_METADATA: dict[str, Any] = {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                                       "common_backend": "torch", "common_backend_version": 1}
SAFETENSORS_METADATA: dict[str, Any] = {"sharded_backend": "gtp_safetensors"}
Fault = Callable[[str], None]


def megatron_metadata(layout: str) -> dict[str, Any]:
    """``metadata.json`` of a checkpoint in ``layout`` (``torch_dist`` or ``safetensors``)."""
    return dict(TORCH_DIST_METADATA if layout == "torch_dist" else SAFETENSORS_METADATA)


def data_file_name(rank: int, index: int, layout: str) -> str:
    """``__{rank}_{index}.distcp`` (DCP's own naming) or ``__{rank}_{index}.safetensors``."""
    return f"__{rank}_{index}.{'distcp' if layout == 'torch_dist' else 'safetensors'}"


def file_entry(path: Path) -> FileEntry:
    """Size and CRC-32C of a finished file (read once, front to back)."""
    with open(path, "rb") as f:
        sums = file_digests(f, [HASH_ALGORITHM])
        return FileEntry(size=os.fstat(f.fileno()).st_size, checksums=sums)


_WRITE_SIDE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS)


def link_or_copy(src: Path, dst: Path) -> bool:
    """Hard-link ``src`` to the new name ``dst``; copy (and fsync) where a link is impossible. True when linked.

    A full disk during the copy is DST's, but ``shutil.copyfile`` (``sendfile``) names the source in
    the error; such errors are given DST's name, so the message says which disk is full.
    """
    try:
        os.link(src, dst, follow_symlinks=False)
        return True
    except OSError as e:
        if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EACCES):
            raise
    try:
        shutil.copyfile(src, dst, follow_symlinks=False)
        fsync_file(dst)
    except OSError as e:
        if e.errno in _WRITE_SIDE:
            raise OSError(e.errno, e.strerror, str(dst)) from None
        raise
    return False


def needed_for_recovery(parent: Path) -> Callable[[WorkFolder], bool]:
    """Which stale copies in ``parent`` the reader may still need: the finished copies of the iteration
    the latest marker names, while that folder is missing (a crash between the two renames of a
    portable replace leaves it so). Everything else a dead writer left is removed."""
    named = None
    try:
        with open(parent / LATEST_FILE, "rb") as f:
            text = f.read(64).decode("ascii", errors="replace").strip()
        if LATEST_RE.fullmatch(text):
            named = iter_dir_name(int(text))
    except OSError:
        pass

    def keep(w: WorkFolder) -> bool:
        return (named is not None and w.target == named and not os.path.lexists(parent / named)
                and os.path.isfile(w.path / MEGATRON_METADATA_FILE))

    return keep


def check_latest(text: str, target: Path) -> None:
    """Refuse (before anything is written) a latest marker the reader would refuse: an iteration of
    more than 12 digits (a manifest may declare up to 2**62), or anything else but ``release``."""
    if text != "release" and not LATEST_RE.fullmatch(text):
        raise FormatError(f"{target}: iteration {text[:40]!r} cannot be named by {LATEST_FILE} (at most 12 "
                          "digits); nothing was written; fix the source's iteration")


def check_destination(dst: Path | ObjectURL, sources: tuple[Path | ObjectURL, ...], tool: str,
                      fix: str = "pick a new folder") -> None:
    """Refuse, before anything is built, a DST that nests with a source, exists, or has no parent folder.

    The one check of every command that writes a new folder (reshard, export, import,
    migrate-aliased); the writer itself refuses a DST that appears later (:class:`DestinationTaken`).
    ``sources``: every name the source was given by (the run folder or prefix the user named, and
    the iteration folder it resolved to). Nesting is refused first, either way round and for folders
    and buckets alike (:func:`~gtp_format.storage.location.within`): a DST below SRC would be written
    into what is only read (``ckpt reshard s3://b/run s3://b/run/iter_x`` put a second checkpoint into
    the run it read), and a SRC below DST would be inside the output. A bucket DST: refused if any
    object is under its prefix (the upload refuses one that appears later, ``storage/upload.py``).
    """
    for root in sources:
        if within(dst, root):
            raise FormatError(f"DST {dst} is inside SRC {root}, which is only read, never written into; "
                              "pick a DST outside SRC")
        if within(root, dst):
            raise FormatError(f"SRC {root} is inside DST {dst}: the output would hold its own source; pick a "
                              "DST outside SRC")
    storage_for(dst).check_free(tool, fix)


class DestinationTaken(FormatError):
    """The target appeared while the output was being built: nothing was replaced or deleted."""

    def __init__(self, target: Path) -> None:
        super().__init__(f"{target}: appeared while this was being written (another writer?); nothing there was "
                         "replaced or deleted and nothing was written; pick a new folder", EXIT_BAD_INPUT)


class CheckpointWriter:
    """Builds ``target`` in a hidden work folder beside it and commits it there; see the module docstring.

    ``inner``: the output is a run directory holding the checkpoint folder ``inner`` and a latest
    marker naming ``latest`` (``reshard``, ``export --to fully_reshardable``, a nested
    ``migrate-aliased``); None: the output is the checkpoint folder itself (the runtime, ``export --to
    hf``). ``replace``: an existing ``target`` is exchanged for the new one (the runtime only).
    ``backup``: with ``replace``, keep the old folder there instead of removing it. ``fault``: the
    runtime's fault-injection hook, called at ``mid_replace`` and ``mid_exchange``. ``tag``: the work folder's
    prefix.
    ``aliased``: the output holds aliased keys on purpose (the pre-fix writer, for fixtures and
    benchmarks of ``migrate-aliased``); its read-back lets them through instead of refusing them.
    """

    def __init__(self, target: Path | ObjectURL, *, inner: str | None = None, latest: str | None = None,
                 replace: bool = False, backup: Path | None = None, tag: str = "tmp",
                 fault: Fault | None = None, aliased: bool = False, session: Any = None) -> None:
        # an s3:// target is built in local staging and committed by an ordered upload (storage/upload.py)
        self.storage = storage_for(target, session)
        self.session = session
        self.target: Any = self.storage.location
        if replace and not self.storage.in_place:
            raise FormatError(f"{target}: re-saving an iteration in a bucket is not supported; save under a new "
                              "prefix", EXIT_BAD_INPUT)
        if latest is not None:
            check_latest(latest, self.target)
        self.inner, self.latest, self.replace, self.backup = inner, latest, replace, backup
        self.tag, self.fault, self.aliased = tag, fault, aliased
        self.checked: Any = None  # the output as its reader opened it (check_output), for a caller's own checks
        self.files: dict[str, FileEntry] = {}
        self.records: list[ChunkRecord] | None = None  # chunk records handed in (None: this output has none)
        self.work: Path | None = None
        # a bucket's commit object for an output without metadata.json (a Hugging Face folder sets its
        # config.json): uploaded last, as a conditional create (storage/upload.py); None: metadata.json
        self.commit_object: str | None = None
        self.committed = False
        # the gate's read-back (check_output) is left to the caller: a bucket output built on several nodes,
        # whose other data files are not in this folder until their stand-ins are (ckpt_tool/copying/nodes.py)
        self.defer_gate = False
        self.gate_pending = False  # finish() would have run the gate: the caller must, before the commit
        # relative names (in the work folder) already uploaded by other processes: the commit leaves them
        self.uploaded: frozenset[str] = frozenset()
        self._signals: Any = None
        # a conversion's attestation (reshard, export, import): written by finish() beside the output,
        # with the target's root hash filled in there (gtp_format.lineage)
        self.attestation: dict[str, Any] | None = None

    @property
    def folder(self) -> Path:
        """Where the checkpoint's files go."""
        if self.work is None:
            raise RuntimeError("CheckpointWriter.begin() was not called")
        return self.work / self.inner if self.inner else self.work

    # -- the steps --------------------------------------------------------------------------------

    def begin(self, clean: bool = True) -> Path:
        """Create the hidden work folder (``clean``: first remove dead writers' stale ones); return it."""
        parent = self.storage.work_parent()
        if clean:  # a staging folder holds no hidden copies a recovery needs (a bucket's writer commits last)
            clean_stale(parent, keep=needed_for_recovery(parent) if self.storage.in_place else None)
        self._signals = sigterm_raises()
        self._signals.__enter__()
        try:
            self.work = self.storage.new_work(self.storage.work_target(parent), self.tag)
            if self.inner:
                (self.work / self.inner).mkdir()
        except BaseException:
            self.abort()
            raise
        return self.work

    def adopt(self, work: Path) -> None:
        """Use a work folder another process created with :meth:`begin` (rank 0 finishing what all ranks wrote)."""
        self.work = Path(work)

    def add_files(self, entries: Mapping[str, FileEntry]) -> None:
        """Entries of data files already written (and fsynced) into :attr:`folder`."""
        self.files.update(entries)

    def add_records(self, records: list[ChunkRecord]) -> None:
        """Chunk records (hash and statistics per chunk) of data files in :attr:`folder`; :meth:`finish`
        writes them to ``gtp_chunks.json``, lists it in the manifest and announces it there. The one place
        every writer's records go through, so every output records them alike (writers hash the bytes
        they hand their sink: :func:`gtp_format.integrity.record_file.record_parts`, or the sink's own
        segments). An output without a manifest (Megatron's layout: ``export --to fully_reshardable``)
        gets the side file alone, found by its fixed name (:func:`gtp_format.integrity.records.read_records`)."""
        self.records = (self.records or []) + list(records)

    def attest(self, record: dict[str, Any]) -> None:
        """Write ``record`` (:func:`gtp_format.lineage.attestation`) as ``gtp_attestation.json`` beside the
        output at :meth:`finish`, with the target's root hash, iteration and run id filled in there."""
        self.attestation = dict(record)

    def attestation_json(self, manifest: Manifest | None) -> dict[str, Any]:
        from gtp_format.lineage import target_of

        assert self.attestation is not None
        return {**self.attestation, "target": target_of(manifest, self.records)}

    def add_file(self, name: str) -> FileEntry:
        """Fsync the file ``name`` of :attr:`folder` and record its entry (computed here)."""
        path = self.folder / name
        fsync_file(path)
        self.files[name] = entry = file_entry(path)
        return entry

    def finish(self, manifest: Manifest | None, metadata: Mapping[str, Any] | bytes | Path | None = None) -> None:
        """Write the manifest (with :attr:`files`), then ``metadata.json`` (``metadata``: its content;
        bytes as they are; a path: another checkpoint's own file, hard-linked where possible; None:
        none, for exports that are not checkpoints), then the latest marker of a nested output, and
        fsync the folders."""
        folder = self.folder
        if manifest is not None and LINEAGE_KEY in manifest.extra:
            # the root hash from the records handed in (no read); iteration, topology and data position
            # from the manifest itself, so no writer can record a lineage that disagrees with them
            manifest = dataclasses.replace(manifest, extra={**manifest.extra, LINEAGE_KEY: complete_lineage(
                manifest.extra[LINEAGE_KEY], manifest, self.records)})
        if self.attestation is not None:
            write_durable(folder / ATTESTATION_FILE, json.dumps(self.attestation_json(manifest), indent=1))
            if manifest is not None:
                self.add_file(ATTESTATION_FILE)
        if self.records is not None and manifest is None:
            write_records(folder, self.records)  # fsynced; no manifest to list it in
        elif manifest is not None and self.records is not None:
            write_records(folder, self.records)
            self.add_file(CHUNK_RECORDS_FILE)
            manifest = dataclasses.replace(manifest, extra={**manifest.extra, CHUNK_RECORDS_SECTION:
                                                            section(len(self.records))})
        elif manifest is not None and CHUNK_RECORDS_SECTION in manifest.extra:
            # a manifest carried over from a source (migrate) announces the source's records, which name
            # the source's chunks: an output without records of its own must not claim any
            extra = {k: v for k, v in manifest.extra.items() if k != CHUNK_RECORDS_SECTION}
            manifest = dataclasses.replace(manifest, extra=extra)
        if manifest is not None:
            write_manifest(folder, dataclasses.replace(manifest, files=dict(self.files)))
        if isinstance(metadata, Path):
            link_or_copy(metadata, folder / MEGATRON_METADATA_FILE)
        elif metadata is not None:
            raw = metadata if isinstance(metadata, bytes) else json.dumps(dict(metadata)).encode()
            write_durable(folder / MEGATRON_METADATA_FILE, raw)
        fsync_dir(folder)
        if self.inner:
            assert self.work is not None
            if self.latest is not None:
                write_durable(self.work / LATEST_FILE, f"{self.latest}\n")
            fsync_dir(self.work)
        if metadata is not None:  # a checkpoint (an export that is none, e.g. --to hf, has no metadata.json)
            if self.defer_gate:
                self.gate_pending = True
            else:
                self.check_output()

    def check_output(self) -> None:
        """Read the finished work folder as every reader will, and refuse to commit what it refuses.

        The gate of ``--load``, ``verify-roundtrip`` and the copies (:func:`gtp_format.check.gate.open_gated`):
        the strict manifest parse of the file as written, then ``ckpt verify``'s structural checks
        (metadata and ``stat`` only). Why here: ``import`` wrote ``model.seq_length`` 2**63 from a
        ``config.json`` and exited 0 with a checkpoint that ``--load`` refused; a writer's values come
        from untrusted sources too, and one check in the one writer covers every writer. The line
        names ``target`` (not the hidden folder); the caller's ``abort`` removes the work.
        """
        from gtp_format.check.gate import JUDGE, REPAIR, open_gated

        assert self.work is not None
        try:  # aliased keys are judged as --load judges them, unless the caller writes them on purpose
            self.checked = open_gated(self.folder, checks=True, aliased=REPAIR if self.aliased else JUDGE,
                                      judge_values=False, session=self.session).ckpt
        except FormatError as e:
            shown = self.target / self.inner if self.inner and self.storage.in_place else self.target
            line = e.message.replace(str(self.folder), str(shown))
            raise FormatError(f"{shown}: nothing was committed: the checkpoint built from the source and flags "
                              f"would be refused by its own reader, which says: {line}", e.exit_code) from None
        self.gate_pending = False

    def commit(self) -> Path:
        """Rename the work folder to ``target``; refuse (:class:`DestinationTaken`) if it appeared meanwhile."""
        assert self.work is not None and not self.committed
        if self.gate_pending:
            raise RuntimeError("CheckpointWriter.check_output() was deferred and not run")
        if self.replace:
            self._replace()
        else:
            try:
                self.storage.commit(self.work, self.fault, self.commit_object, self.uploaded)
            except FileExistsError:
                raise DestinationTaken(self.target) from None
        self.storage.committed(self.work)
        self.committed = True
        self._release()
        return self.target

    def _replace(self) -> None:
        assert self.work is not None
        try:
            commit_new_folder(self.work, self.target)
            return
        except FileExistsError:
            pass
        # the replaced iteration is proven this writer's before it is moved aside (work.own_before_removal), by
        # the work folder's own token: the exchange puts it under the work folder's name before the rename to old
        old = self.backup or own_before_removal(self.target, "old", token_of(self.work))
        try:
            swap_in_folder(self.work, self.target, old,
                           between=(lambda: self.fault("mid_replace")) if self.fault else None,
                           exchanged=(lambda: self.fault("mid_exchange")) if self.fault else None)
        except OSError:
            if self.backup is None and not old.exists():  # put back where it was: no token stays in it
                drop_token(self.target)
            raise
        fsync_dir(self.target.parent)
        if self.fault is not None:
            self.fault("after_exchange")
        if self.backup is None:
            remove_owned(old)  # the iteration this writer replaces: the caller asked for exactly that

    def set_latest(self, iteration: int | str) -> None:
        """Point the run directory's latest marker at the committed iteration (atomically, durably)."""
        assert self.committed, "the latest marker moves only after the commit"
        check_latest(str(iteration), self.target)
        self.storage.set_latest(f"{iteration}\n")

    def abort(self) -> None:
        """Remove the work folder unless it was committed; never anything else."""
        if self.work is not None and not self.committed and os.path.lexists(self.work):
            remove_owned(self.work)
        self._release()

    def hand_off(self) -> None:
        """Before another thread commits (an async save's background upload): give SIGTERM back its
        previous action here, since only the main thread may set a handler. A writer terminated during
        such an upload leaves objects without their commit object, which no reader takes."""
        self._release()

    def _release(self) -> None:
        if self._signals is not None:
            signals, self._signals = self._signals, None
            signals.__exit__(None, None, None)

    def __enter__(self) -> CheckpointWriter:
        self.begin()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.abort()
