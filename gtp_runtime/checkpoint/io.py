"""Save and load ``dp_reshardable`` checkpoints through DCP, with an atomic commit.

Save: through the one checkpoint writer (:class:`gtp_format.writer.checkpoint.CheckpointWriter`):
rank 0 creates the hidden work folder ``.tmp.iter_{N}.w{owner}/``, every rank writes its chunks
there (fsynced), rank 0 adds the manifest and Megatron's ``metadata.json``, fsyncs the folder,
renames it to ``iter_{N:07d}`` (exchanged atomically with an existing one when an iteration is
re-saved), and only then replaces ``latest_checkpointed_iteration.txt`` (temporary file, fsync,
``os.replace``). A crash before the rename leaves only a ``.tmp.*`` folder that no reader treats
as a checkpoint (the next save removes it once its owner is dead); a crash after it leaves a
complete new checkpoint and, at worst, ``latest`` still naming the previous one. Nothing ever
looks complete without being complete.

Load: the checkpoint is opened and verified the way ``ckpt verify`` does it, and its manifest is
checked against the running topology (DP may differ; TP, CP, GTP_remat, fold_cp, expert sizes and
the model may not), see :mod:`gtp_runtime.checkpoint.verified`; then the keys and shapes this rank
needs, then DCP reads exactly the boxes this rank needs, through the verified model.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.storage import StorageWriter

from gtp_format import __version__
from gtp_format import names as fmt
from gtp_format.errors import FormatError
from gtp_format.integrity.records import ChunkRecord
from gtp_format.layout.config import ConfigError
from gtp_format.lineage import LINEAGE_KEY, Parent, lineage_section, new_run_id, source_identity
from gtp_format.manifest import FileEntry, Manifest
from gtp_format.reader.storage import read_small_file
from gtp_format.session import Session
from gtp_format.storage.base import storage_for
from gtp_format.storage.location import ObjectURL
from gtp_format.writer.checkpoint import CheckpointWriter, file_entry, megatron_metadata
from gtp_runtime.checkpoint.chunk_records import (
    SinkStats,
    Stats,
    record_own_files,
    records_from_segments,
    start_state_stats,
)
from gtp_runtime.checkpoint.dcp_chunks import ChunkLoadPlanner, ChunkSavePlanner
from gtp_runtime.checkpoint.direct_fs import direct_writer
from gtp_runtime.checkpoint.errors import CheckpointError, CheckpointSaveError, sharding_refusal
from gtp_runtime.checkpoint.manifest import buffer_layout, build_manifest, optimizer_info
from gtp_runtime.checkpoint.pinned import POOL
from gtp_runtime.checkpoint.replicas import check_replicas
from gtp_runtime.checkpoint.run_state import load_run_state, save_run_state
from gtp_runtime.checkpoint.safetensors_storage import INDEX_FILE, SafetensorsWriter
from gtp_runtime.checkpoint.state import (
    bucket_numel_state,
    expected_bucket_numels,
    model_state,
    optimizer_state,
)
from gtp_runtime.checkpoint.verified import VerifiedReader, check_compatible, open_verified
from gtp_runtime.last_resort import describe, root_cause
from gtp_runtime.training import Trainer


def _fault(point: str, folder: Path | None = None) -> None:
    """Fault injection for crash tests: ``GTP_FAULT_INJECT=point:rank`` kills that rank there
    (exit 17, no report); ``point:rank:raise`` makes it raise instead (a crash with a traceback);
    ``point:rank:enospc`` raises the ``OSError`` a full disk gives, and ``point:rank:rmtree`` removes
    ``folder`` (the save's work folder) as an operator's ``rm -r`` would, so the next write fails.
    Signals, as an operator or the OOM killer sends them: ``point:rank:sigkill`` (that rank alone),
    ``point:rank:killpg`` (SIGKILL to the whole process group: launcher, fork server and every rank),
    ``point:rank:launcher`` and ``point:rank:sigterm`` (SIGKILL or SIGTERM to the process group's
    leader: the launcher, when it was started in a session of its own, as the tests start it)."""
    spec = os.environ.get("GTP_FAULT_INJECT", "").split(":")
    if len(spec) >= 2 and spec[0] == point and int(spec[1]) == dist.get_rank():
        signals = {"sigkill": (os.getpid(), signal.SIGKILL), "killpg": (-os.getpgrp(), signal.SIGKILL),
                   "launcher": (os.getpgrp(), signal.SIGKILL), "sigterm": (os.getpgrp(), signal.SIGTERM)}
        if len(spec) == 3 and spec[2] in signals:
            pid, sig = signals[spec[2]]
            os.kill(pid, sig)
            if spec[2] == "sigterm":
                return  # the launcher stops this rank (its lifeline), wherever the rank has got to
            time.sleep(60)  # SIGKILL is delivered before this ends
        if spec[2:] == ["raise"]:
            raise RuntimeError(f"injected fault at {point}")
        if spec[2:] == ["enospc"]:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(folder))
        if spec[2:] == ["rmtree"] and folder is not None:
            # renamed first, so that no peer creates a file in it between rmtree's listing and its rmdir
            gone = folder.with_name(folder.name + ".removed")
            os.rename(folder, gone)
            shutil.rmtree(gone)
            return
        os._exit(17)


def fault_point(point: str) -> None:
    """:func:`_fault` for the async save's own points (``staging``: the work folder made, the copy to
    host memory not begun; ``staged``: the copy done, the background write not started)."""
    _fault(point)


def fault_mode(point: str) -> bool:
    """A fault that every rank plays alike, to reproduce a known bug for real in a test:
    ``GTP_FAULT_INJECT=drop_optimizer_load`` (a resume that loads the weights and starts fresh optimizer
    state, as NeMo-RL's did) and ``stale_staging`` (an async save that writes the staged state of its
    first save again, as Megatron's async save did). ``ckpt log`` must catch what they leave."""
    return os.environ.get("GTP_FAULT_INJECT", "") == point


def _hooked(writer: StorageWriter, folder: Path) -> StorageWriter:
    """``during_write`` fault point inside DCP's write step, where a real write error is raised, so
    that an injected fault travels the same path (DCP gathers it to every rank) as a full disk."""
    if os.environ.get("GTP_FAULT_INJECT", "").startswith("during_write:"):
        write = writer.write_data

        def write_data(plan: Any, planner: Any) -> Any:
            _fault("during_write", folder)
            return write(plan, planner)

        writer.write_data = write_data  # type: ignore[method-assign]
    return writer


def _own_results(writer: StorageWriter, into: dict[Any, Any]) -> StorageWriter:
    """Collect this rank's own write results (where each chunk went: file, offset, length) into
    ``into``. The chunk records need only this rank's chunks, and the metadata ``dcp.save`` returns
    does not carry them on every torch release: torch 2.11's came back with ``storage_data`` None
    (found on the lent H200, whose image has 2.11), where 2.13's has every rank's."""
    write = writer.write_data

    def write_data(plan: Any, planner: Any) -> Any:
        fut = write(plan, planner)
        fut.add_done_callback(lambda f: into.update({r.index: r.storage_data for r in f.value()}))
        return fut

    writer.write_data = write_data  # type: ignore[method-assign]
    return writer


def check_sharding(trainer: Trainer, sharding: str, action: str) -> None:
    """Refuse what would write (or read) a wrong checkpoint."""
    sharding_refusal(sharding, any(buf.key.excludes_cp for buf in trainer.optimizer.buffers), action)


def _own_files(folder: Path, layout: str, rank: int) -> list[Path]:
    suffix = ".distcp" if layout == "torch_dist" else ".safetensors"
    return sorted(folder.glob(f"__{rank}_*{suffix}"))


def prepare_folder(trainer: Trainer, root: Path | ObjectURL, layout: str, sharding: str,
                   aliased: bool = False, session: Session | None = None) -> CheckpointWriter:
    """Refuse a bad request, then start the one checkpoint writer (collective): rank 0 creates the
    hidden work folder and every rank adopts it. A folder that cannot be created (a full disk, no
    permission) is one :class:`CheckpointSaveError` on every rank. A bucket (``s3://``): the work folder
    is local staging that the ranks of this host share, and rank 0's commit is the ordered upload
    (:mod:`gtp_format.storage.upload`); an iteration already in the bucket is not replaced. ``session``: the
    save's (:class:`gtp_format.session.Session`)."""
    check_sharding(trainer, sharding, "save")
    if layout not in fmt.LAYOUTS:
        raise CheckpointError(f"unknown --ckpt-layout {layout!r}; use one of {fmt.LAYOUTS}")
    final = root / fmt.iter_dir_name(trainer.iteration)
    in_place = storage_for(root).in_place  # a folder's iteration is replaced; a bucket's never is
    writer = CheckpointWriter(final, replace=in_place, fault=_fault, aliased=aliased, session=session)
    name: list[str | None] = [None, None]  # the work folder's path, or why it could not be made
    if dist.get_rank() == 0:
        try:
            if in_place:
                root.mkdir(parents=True, exist_ok=True)
            name[0] = str(writer.begin())
        except (OSError, FormatError) as e:
            name[1] = e.message if isinstance(e, FormatError) else _cause(e)
    dist.broadcast_object_list(name, src=0)
    if name[0] is None:
        raise CheckpointSaveError(f"cannot save {final}: {name[1]}; {_latest_text(root)}")
    if dist.get_rank() != 0:
        writer.adopt(Path(name[0]))
    return writer


def rank_state(trainer: Trainer, aliased: bool = False, integrity: bool = True) -> dict[str, Any]:
    """This rank's sharded state dict: views of the live tensors (stage them before training on).

    With ``integrity`` (collective, on the training thread): every copy of replicated state must agree
    before one of them is written (:func:`replicas.check_replicas`, all ranks' copies). Not for the
    pre-fix writer: its folded keys collide across CP peers on purpose (fixtures of the bug).
    """
    sd: dict[str, Any] = {}
    sd.update(model_state(trainer.model, trainer.groups, for_load=False))
    sd.update(optimizer_state(trainer.optimizer, trainer.groups, aliased=aliased))
    sd.update(bucket_numel_state(trainer.optimizer, trainer.groups, for_load=False))
    if integrity and not aliased:
        check_replicas(trainer, [model_state(trainer.model, trainer.groups, for_load=True), sd])
    return sd


def manifest_now(trainer: Trainer, layout: str, sharding: str, aliased: bool) -> Manifest:
    """The manifest as of this moment (iteration, step, schedule and data position), files still empty:
    an async save takes it when it stages, not when the files are done and training has moved on."""
    cfg = trainer.cfg
    manifest = build_manifest(
        layout=layout, sharding=sharding, iteration=trainer.iteration, par=cfg.par, model=cfg.model,
        optimizer=optimizer_info(trainer.optimizer, cfg.adam, cfg.muon, trainer.optimizer.step_count),
        buffers=buffer_layout(trainer.optimizer, trainer.groups),
        files={}, param_dtype=str(cfg.param_dtype), bucket_size=cfg.bucket_size)
    manifest.extra.update(save_run_state(trainer))
    if trainer.run_id is None:  # the run's first save names the run; a load carried its id over
        trainer.run_id = new_run_id()
    manifest.extra[LINEAGE_KEY] = lineage_section(trainer.run_id, trainer.lineage_parent, f"gtp_runtime {__version__}")
    if aliased:
        manifest.notes.append("written by the pre-fix (aliased) writer: folded keys lack .cp_rank_{i}")
    return manifest


RankFiles = tuple[dict[str, FileEntry], list[ChunkRecord] | None]


def write_rank_files(sd: dict[str, Any], tmp: Path, layout: str, threads: int | None,
                     group: dist.ProcessGroup | None = None, integrity: bool = True,
                     stats_of: Stats | None = None) -> RankFiles:
    """Write this rank's chunks into ``tmp`` (DCP, over ``group``); return its files' entries and,
    with ``integrity``, the chunk records (hash and statistics of every chunk) of those files.

    ``torch_dist`` data files go through the ``O_DIRECT`` sink (:mod:`direct_fs`), which fsyncs each and
    computes its CRC-32C and every chunk's xxh3-128 as it writes, so nothing is read back
    (:func:`chunk_records.records_from_segments`; why no read-back is needed: :mod:`direct_fs`).
    Safetensors files are read back once for both (:func:`chunk_records.record_own_files`). The
    statistics run during the write (on the GPU for CUDA chunks, in the sink's pieces for CPU chunks of
    a ``torch_dist`` save, else on a thread), unless ``stats_of`` brings them: an async save of CUDA
    state takes them from the live chunks on the device while it stages
    (:meth:`async_save.AsyncCheckpointer.save`), not from the host copy. An async save runs this on its
    background thread, over its own process group, never the training one.
    """
    # Several writer threads per rank (files __{rank}_0.., __{rank}_1..): torch.save releases the
    # GIL while it copies and writes, and measured on 2 cores this doubles DCP's save rate.
    threads = threads or max(1, min(4, os.cpu_count() or 1))
    sink = SinkStats(sd) if integrity and stats_of is None and layout == "torch_dist" else None
    if stats_of is None:
        stats_of = start_state_stats(sd, sink) if integrity else dict
    written: dict[str, FileEntry] | None = None
    storage: dict[Any, Any] = {}
    try:
        with POOL.lease():  # given back once DCP's writer threads have ended: none still reads a buffer
            if layout == "torch_dist":
                writer, fs = direct_writer(tmp, threads, segments=integrity, watch=sink)
                dcp.save(sd, storage_writer=_own_results(_hooked(writer, tmp), storage),
                         planner=ChunkSavePlanner(), process_group=group)
                written = dict(fs.entries)
            else:
                dcp.save(sd, storage_writer=_hooked(SafetensorsWriter(tmp), tmp), planner=ChunkSavePlanner(),
                         process_group=group)
    finally:
        stats = stats_of()  # joined even when the write fails: no thread outlives the save
    _fault("after_write")
    own = _own_files(tmp, layout, dist.get_rank())
    if written is not None and {p.name for p in own} != set(written):
        raise CheckpointError(f"{tmp}: this rank wrote {sorted(written)} but {sorted(p.name for p in own)} are there")
    if not integrity:
        return (written if written is not None else {p.name: file_entry(p) for p in own}), None
    if written is not None:
        return written, records_from_segments(tmp, storage, sorted(written), fs.segments, stats)
    return record_own_files(tmp, layout, storage, own, stats)


def try_write_rank_files(sd: dict[str, Any], tmp: Path, layout: str, threads: int | None,
                         group: dist.ProcessGroup | None = None, integrity: bool = True,
                         stats_of: Stats | None = None) -> RankFiles | str:
    """:func:`write_rank_files`, a failure returned as ``rank R: cause`` (for :func:`finish_save`);
    DCP hands every rank the failures of all, so R is the first rank that raised, not this one."""
    try:
        return write_rank_files(sd, tmp, layout, threads, group, integrity, stats_of)
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        if isinstance(e, KeyboardInterrupt | SystemExit):
            raise
        failures = getattr(e, "failures", None)
        origin = min(failures) if isinstance(failures, dict) and failures else dist.get_rank()
        return f"rank {origin}: {_cause(e)}"


def _latest_text(root: Path | ObjectURL) -> str:
    """What a failed save leaves as the latest checkpoint, for its one-line error."""
    try:
        if storage_for(root).remote:
            it = read_small_file(root / fmt.LATEST_FILE, 64, "the latest marker", "").decode(errors="replace").strip()
        else:
            with open(root / fmt.LATEST_FILE, "rb") as f:
                it = f.read(64).decode(errors="replace").strip()
    except (OSError, FormatError):
        return "no checkpoint is marked latest"
    return f"the latest checkpoint is still iteration {describe(RuntimeError(it), 40)}"


def _cause(e: BaseException) -> str:
    """One short cause: DCP's wrapper unwrapped, an ``OSError`` as its strerror and file."""
    e = root_cause(e)
    if isinstance(e, OSError) and e.strerror:
        return f"{e.strerror}" + (f" ({e.filename})" if e.filename else "")
    return describe(e, 300) or type(e).__name__


Publish = Callable[[CheckpointWriter, Manifest], None]


def finish_save(writer: CheckpointWriter, manifest: Manifest | None, result: RankFiles | str,
                publish: Publish | None = None) -> Path:
    """Collective end of a save: every rank's outcome (its file entries, or why it failed) is
    gathered; only if all wrote, rank 0 adds the manifest and Megatron's ``metadata.json``, commits
    and moves the latest marker. Otherwise the work folder is removed (a rerun must not fail on a
    disk this save filled) and every rank raises :class:`CheckpointSaveError` with the first cause.

    ``publish``: rank 0 hands the finished folder to it instead of committing here (an async save to
    a bucket runs the upload, then the latest marker, on its background thread: :func:`upload_outcome`)."""
    rank = dist.get_rank()
    everything: list[RankFiles | str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everything, result)
    failed = next(((r, x) for r, x in enumerate(everything) if not isinstance(x, tuple)), None)
    err: list[str | None] = [None]
    if failed is not None:
        err[0] = str(failed[1])
    elif rank == 0:
        assert manifest is not None
        try:
            _assemble(writer, manifest, everything)
            (publish or _publish)(writer, manifest)
        except OSError as e:
            err[0] = f"rank 0: {_cause(e)}"
        except FormatError as e:  # a bucket's upload: the store's one line (storage/objects.py)
            err[0] = f"rank 0: {e.message}"
    if failed is None:
        dist.broadcast_object_list(err, src=0)
    if err[0] is not None:
        raise_save_failed(writer, err[0])
    return writer.target


def raise_save_failed(writer: CheckpointWriter, cause: str) -> None:
    """Every rank: the one line of a failed save (rank 0 first removes its work folder)."""
    if dist.get_rank() == 0:
        writer.abort()
    raise CheckpointSaveError(f"saving {writer.target} failed on {cause}; {_latest_text(writer.target.parent)}")


def _assemble(writer: CheckpointWriter, manifest: Manifest, everything: list[Any]) -> None:
    """Rank 0: the manifest (with every rank's file entries and chunk records) and ``metadata.json``."""
    for entries, records in everything:
        writer.add_files(entries)
        if records is not None:
            writer.add_records(records)
    writer.add_file(fmt.DCP_METADATA_FILE if manifest.layout == "torch_dist" else INDEX_FILE)
    writer.finish(manifest, megatron_metadata(manifest.layout))


def _publish(writer: CheckpointWriter, manifest: Manifest) -> None:
    """Rank 0: the commit (a rename, or a bucket's ordered upload), then the latest marker."""
    _fault("before_rename")
    writer.commit()
    _fault("before_latest")
    writer.set_latest(manifest.iteration)


def upload_outcome(writer: CheckpointWriter, manifest: Manifest) -> str | None:
    """Rank 0's background thread (async save to a bucket): :func:`_publish`, a failure as ``rank 0:
    cause`` (the upload removed what it created; the latest marker did not move), None when committed."""
    try:
        _publish(writer, manifest)
    except OSError as e:
        return f"rank 0: {_cause(e)}"
    except FormatError as e:
        return f"rank 0: {e.message}"
    except BaseException as e:  # noqa: BLE001 - one line on every rank, whatever the upload raised
        if isinstance(e, KeyboardInterrupt | SystemExit):
            raise
        return f"rank 0: {_cause(e)}"
    return None


def save_checkpoint(trainer: Trainer, root: str | os.PathLike | ObjectURL, layout: str = "torch_dist",
                    sharding: str = fmt.FORMAT_NAME, aliased: bool = False, writer_threads: int | None = None,
                    integrity: bool = True) -> Path:
    """Save ``trainer`` at its current iteration under ``root``; return the committed folder.

    ``aliased=True`` is the pre-fix writer (see :func:`state.optimizer_state`), for fixtures only.
    ``writer_threads`` (torch_dist): files per rank, written in parallel; by default one per core, at
    most 4. Fixtures pin it so that their file list does not depend on the machine. A write that
    fails on any rank (a full disk, a removed folder) raises :class:`CheckpointSaveError` on every
    rank, naming the folder and the cause, and leaves no work folder behind. For a save that
    returns before the files are written see :class:`gtp_runtime.checkpoint.async_save.AsyncCheckpointer`.
    ``integrity=False`` leaves out the replica cross-check and the chunk records: only
    ``benchmarks/bench_save_integrity.py`` uses it, to measure what they cost against the same run's
    save without them.
    """
    # this save's clients and threads (it asks the store afresh, as always); its end sees the outcome
    with Session(scoped=False) as session:
        where = session.bind(storage_for(root).location)
        writer = prepare_folder(trainer, where, layout, sharding, aliased, session)
        try:
            sd = rank_state(trainer, aliased, integrity)
            manifest = manifest_now(trainer, layout, sharding, aliased) if dist.get_rank() == 0 else None
            _fault("before_write")
            return finish_save(writer, manifest, try_write_rank_files(sd, writer.folder, layout, writer_threads,
                                                                      integrity=integrity))
        except BaseException:
            if dist.get_rank() == 0:
                writer.abort()
            raise


def _check_keys(sd: dict[str, Any], stored: dict[str, Any], folder: Path) -> None:
    missing = sorted(k for k in sd if k not in stored)
    if missing:
        # A folded key whose unsuffixed twin is stored: the pre-fix writer's aliased checkpoint.
        aliased = [k for k in missing if ".cp_rank_" in k and k.rsplit(".cp_rank_", 1)[0] in stored]
        if aliased:
            raise CheckpointError(f"{folder}: {len(aliased)} folded optimizer key(s) lack .cp_rank_{{i}}, e.g. "
                                  f"{aliased[0].rsplit('.cp_rank_', 1)[0]!r}: the checkpoint is aliased (saved "
                                  "before the fix); run `ckpt migrate-aliased` on it first")
        raise CheckpointError(f"{folder}: {len(missing)} key(s) missing, e.g. {missing[0]!r}; "
                              "was it saved by another model, bucket size or topology?")
    for k, v in sd.items():
        size = getattr(stored[k], "size", None)
        if size is not None and tuple(size) != tuple(v.global_shape):
            raise CheckpointError(f"{folder}: key {k!r} has shape {tuple(size)} in the checkpoint, "
                                  f"expected {tuple(v.global_shape)}")


def load_checkpoint(trainer: Trainer, path: str | os.PathLike, sharding: str = fmt.FORMAT_NAME) -> Path:
    """Load into ``trainer`` (same topology: bit-exact; other DP size: resharded).

    ``path`` is a checkpoint folder or its parent (the latest marker is followed). Nothing is
    allocated or read from the data files before the checkpoint passed ``ckpt verify``'s checks.
    """
    check_sharding(trainer, sharding, "load")
    with Session(scoped=False) as session:  # this load's clients and threads (a bucket's): they end with it
        return _load(trainer, session, path)


def _load(trainer: Trainer, session: Session, path: str | os.PathLike) -> Path:
    try:
        where = session.bind(storage_for(path).location)
    except FormatError as e:  # an unsupported URL: the gate's words, as open_verified would give them
        raise CheckpointError(e.message) from None
    ckpt, manifest = open_verified(where, session)
    folder = ckpt.root
    check_compatible(trainer.cfg, manifest, folder)
    reader = VerifiedReader(ckpt)
    metadata = reader.read_metadata()
    sd: dict[str, Any] = {}
    sd.update(model_state(trainer.model, trainer.groups, for_load=True))
    drop = fault_mode("drop_optimizer_load")
    if not drop:
        sd.update(optimizer_state(trainer.optimizer, trainer.groups))
    numels = bucket_numel_state(trainer.optimizer, trainer.groups, for_load=True)
    sd.update(numels)
    _check_keys(sd, metadata.state_dict_metadata, folder)
    try:
        with torch.no_grad():
            dcp.load(sd, storage_reader=reader, planner=ChunkLoadPlanner())
    except CheckpointException as e:
        # DCP gathers every rank's exception; a bad chunk is one line, not a traceback per rank.
        for exc, _ in e.failures.values():
            if isinstance(exc, FormatError):
                raise CheckpointError(f"{folder}: {exc.message}") from None
            if isinstance(exc, CheckpointError):
                raise CheckpointError(str(exc)) from None
        raise
    expected = expected_bucket_numels(trainer.optimizer, trainer.groups)
    for key, ch in numels.items():
        got, want = next(iter(ch.chunks.values())).tolist(), expected[key]
        if got != want:
            raise CheckpointError(f"{folder}: {key} is {got}, the running model's buckets are {want}; "
                                  "bucket layout differs (same --bucket-size and model?)")
    assert manifest.optimizer is not None
    if not drop:
        trainer.optimizer.step_count = manifest.optimizer.step
    trainer.iteration = manifest.iteration
    try:
        load_run_state(trainer, manifest, folder)
    except ConfigError as e:
        raise CheckpointError(str(e)) from e
    trainer.optimizer.zero_grad()
    try:
        lin, root = source_identity(ckpt)
    except FormatError:  # a lineage section that fails its checks: --no-check-lineage let it through
        lin, root = None, None
    # the run goes on under the loaded run's id (a checkpoint from before lineage: a new id at the first save)
    trainer.run_id = None if lin is None else lin.run_id
    trainer.lineage_parent = Parent(run_id=trainer.run_id, root_hash=root, iteration=manifest.iteration, via="load")
    return folder
