"""``--async-save``: the step blocks only while this rank's state is copied to host memory.

Megatron's ``--async-save`` and torchtitan's async mode do the same; the rules here:

* :meth:`AsyncCheckpointer.save` copies the rank's chunks into staging buffers allocated once
  (:mod:`staging`; pinned when the state is on a GPU) and returns; a background thread writes the
  files into the hidden work folder with the sync save's own writer (:func:`io.write_rank_files`),
  so an async checkpoint is byte-for-byte the format of a sync one.
* At most one save is in flight: the next save and the end of training (:meth:`finalize`) wait.
* The background thread never runs a collective on the training process group: DCP's planning
  gathers go over a gloo group of its own, made once. The completion check across ranks is done
  from the training thread: :meth:`poll` after every step (one all-reduce of a done flag, only
  while a save is in flight), then :func:`io.finish_save` gathers every rank's outcome, and only if
  every rank's files are durable (fsynced) does rank 0 write the manifest, commit the folder and
  move the latest marker, as Megatron's async finalize does.
* A rank whose background write failed makes every rank raise ``CheckpointSaveError`` at that
  check: one line naming the folder and the cause; the work folder is removed and the previous
  checkpoint stays the latest. A rank killed meanwhile leaves only the hidden work folder, which no
  reader takes for a checkpoint.
* A bucket (``s3://``): the ranks write into local staging as for a folder; once every rank's files
  are durable, rank 0 adds the manifest and ``metadata.json`` there (on the training thread, a few
  small files) and hands the ordered upload (:mod:`gtp_format.storage.upload`: data objects, side
  files, the commit object, then the latest marker) to the same background thread. The save stays
  in flight until the upload is done: :meth:`poll` checks rank 0's upload as it checked the writes,
  the next save and :meth:`finalize` wait for it. A failed upload removes the objects it created,
  the latest marker does not move, and every rank raises ``CheckpointSaveError`` (one line).
  Why the upload is not left to the training thread: it is the slow part (the whole checkpoint over
  the network), and a sync bucket save blocks the step for all of it.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gtp_format import names as fmt
from gtp_format.integrity.stats import ChunkStats
from gtp_format.manifest import FileEntry, Manifest
from gtp_format.session import Session
from gtp_format.storage.base import storage_for
from gtp_format.storage.location import ObjectURL
from gtp_format.writer.checkpoint import CheckpointWriter
from gtp_runtime.checkpoint.chunk_records import ChunkId, Stats, start_state_stats
from gtp_runtime.checkpoint.io import (
    fault_point,
    finish_save,
    manifest_now,
    prepare_folder,
    raise_save_failed,
    rank_state,
    try_write_rank_files,
    upload_outcome,
)
from gtp_runtime.checkpoint.staging import Staging
from gtp_runtime.training import Trainer


def _known(stats: dict[ChunkId, ChunkStats | None]) -> Stats:
    return lambda: stats


@dataclass
class _InFlight:
    future: Future[dict[str, FileEntry] | str]
    writer: CheckpointWriter
    manifest: Manifest | None  # rank 0's, taken when the state was staged
    device: torch.device
    upload: Future[str | None] | None = None  # rank 0's upload of a bucket save (None elsewhere)
    uploading: bool = False  # the write phase is over: what is in flight is the upload


class AsyncCheckpointer:
    """One per training run (it owns the staging buffers and the writer thread).

    ``staging_bytes``: ``--async-save-staging`` (``None``: the rank's checkpoint bytes).
    ``writer_threads``: as :func:`io.save_checkpoint`'s. ``blocking_s`` is the last save's
    blocked time: from the call until the staging copy was complete.
    """

    def __init__(self, staging_bytes: int | None = None, writer_threads: int | None = None) -> None:
        self.staging = Staging(staging_bytes)
        self.writer_threads = writer_threads
        self.blocking_s = 0.0
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-async")
        self._group: Any = None
        self._pending: _InFlight | None = None

    def prepare(self, trainer: Trainer) -> None:
        """Allocate the staging buffers for ``trainer``'s state now (collective; see
        :meth:`Staging.reserve`), so that no save pays for pinning. Optional: without it the first
        save allocates them."""
        if self._group is None:
            self._group = dist.new_group(backend="gloo")
        self.staging.reserve(rank_state(trainer, integrity=False), self._group)

    @property
    def in_flight(self) -> Path | ObjectURL | None:
        """The folder the save in flight will commit to, if any."""
        return self._pending.writer.target if self._pending else None

    def save(self, trainer: Trainer, root: str | Path | ObjectURL, layout: str = "torch_dist",
             sharding: str = fmt.FORMAT_NAME) -> tuple[Path | ObjectURL, Path | ObjectURL | None]:
        """Stage ``trainer``'s state and start writing it; ``(folder it will commit to, folder the
        previous save committed now or None)``. Collective: every rank calls it at the same step."""
        committed = self.finalize()
        start = time.perf_counter()
        if self._group is None:
            self._group = dist.new_group(backend="gloo")
        session = Session(scoped=False)  # this save's clients and threads, kept by its writer until its upload ends
        where = session.bind(storage_for(root).location)
        writer = prepare_folder(trainer, where, layout, sharding, session=session)
        try:
            live = rank_state(trainer)
            # CUDA state: its statistics are reduced on the GPU from the live chunks, beside the staging
            # copy, and taken before the step may go on; on the host they would cost the background
            # write a pass over every byte (measured on the H200: the write 0.72x dd with them there)
            on_gpu = trainer.device.type == "cuda"
            stats = start_state_stats(live) if on_gpu else None
            fault_point("staging")
            staged = self.staging.stage(live, self._group)
            fault_point("staged")
            stats_of = _known(stats()) if stats is not None else None
            manifest = manifest_now(trainer, layout, sharding, False) if dist.get_rank() == 0 else None
        except BaseException:
            try:
                if dist.get_rank() == 0:
                    writer.abort()
            finally:
                session.end(failed=True)
            raise
        future = self._pool.submit(try_write_rank_files, staged, writer.folder, layout, self.writer_threads,
                                   self._group, True, stats_of)
        self._pending = _InFlight(future, writer, manifest, trainer.device)
        self.blocking_s = time.perf_counter() - start
        return writer.target, committed

    def poll(self) -> Path | ObjectURL | None:
        """After a step: commit the save in flight if every rank has written its files (for a bucket:
        start its upload, then report it once the upload is done); the location committed, or None
        (nothing in flight, or still writing or uploading). Collective."""
        p = self._pending
        if p is None:
            return None
        if p.uploading:
            done = p.upload is None or p.upload.done()  # only rank 0 uploads
        else:
            done = p.future.done()
        flag = torch.tensor([1 if done else 0], dtype=torch.int32, device=p.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return self._advance() if int(flag.item()) else None

    def finalize(self) -> Path | ObjectURL | None:
        """Wait for the save in flight (its writes, then a bucket's upload), then the completion check
        and commit (collective); the location committed, or None if nothing was in flight. Raises
        ``CheckpointSaveError`` if any rank failed to write or the upload failed."""
        out = None
        while self._pending is not None:
            out = self._advance()
        return out

    def _advance(self) -> Path | ObjectURL | None:
        """The next phase of the save in flight, waiting for the current one (collective): the writes'
        completion check and commit (a bucket: the start of the upload, None), or the upload's outcome."""
        p = self._pending
        assert p is not None
        try:
            if p.uploading:
                self._pending = None
                out = self._uploaded(p)
            else:
                result = p.future.result()
                if not p.writer.storage.in_place:
                    p.uploading = True
                    finish_save(p.writer, p.manifest, result, publish=lambda w, m: self._start_upload(p, w, m))
                    return None  # the session goes on with the upload
                self._pending = None
                out = finish_save(p.writer, p.manifest, result)
        except BaseException:
            self._pending = None
            try:
                if dist.get_rank() == 0:
                    p.writer.abort()
            finally:
                p.writer.session.end(failed=True)  # the save's session ends knowing it failed
            raise
        p.writer.session.end(failed=False)
        return out

    def _start_upload(self, p: _InFlight, writer: CheckpointWriter, manifest: Manifest) -> None:
        writer.hand_off()
        p.upload = self._pool.submit(upload_outcome, writer, manifest)

    def _uploaded(self, p: _InFlight) -> Path | ObjectURL:
        """Rank 0's upload outcome, told to every rank: the location, or every rank raises."""
        err: list[str | None] = [p.upload.result() if p.upload is not None else None]
        dist.broadcast_object_list(err, src=0)
        if err[0] is not None:
            raise_save_failed(p.writer, err[0])
        return p.writer.target

    def close(self) -> Path | ObjectURL | None:
        """End of training: :meth:`finalize`, then stop the writer thread."""
        try:
            return self.finalize()
        finally:
            self._pool.shutdown(wait=True)
