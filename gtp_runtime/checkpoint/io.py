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

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from gtp_format import names as fmt
from gtp_format.errors import FormatError
from gtp_format.integrity.records import ChunkRecord
from gtp_format.layout.config import ConfigError
from gtp_format.manifest import FileEntry
from gtp_format.writer.checkpoint import CheckpointWriter, file_entry, megatron_metadata
from gtp_runtime.checkpoint.chunk_records import record_own_files, start_state_stats
from gtp_runtime.checkpoint.dcp_chunks import ChunkLoadPlanner, ChunkSavePlanner
from gtp_runtime.checkpoint.errors import CheckpointError
from gtp_runtime.checkpoint.manifest import buffer_layout, build_manifest, optimizer_info
from gtp_runtime.checkpoint.replicas import check_replicas
from gtp_runtime.checkpoint.run_state import load_run_state, save_run_state
from gtp_runtime.checkpoint.safetensors_storage import INDEX_FILE, SafetensorsWriter
from gtp_runtime.checkpoint.state import (
    bucket_numel_state,
    expected_bucket_numels,
    model_state,
    optimizer_state,
)
from gtp_runtime.checkpoint.verified import VerifiedReader, check_compatible, open_verified, sharding_refusal
from gtp_runtime.training import Trainer


def _fault(point: str) -> None:
    """Fault injection for crash tests: ``GTP_FAULT_INJECT=point:rank`` kills that rank there
    (exit 17, no report); ``point:rank:raise`` makes it raise instead (a crash with a traceback)."""
    spec = os.environ.get("GTP_FAULT_INJECT", "").split(":")
    if len(spec) >= 2 and spec[0] == point and int(spec[1]) == dist.get_rank():
        if spec[2:] == ["raise"]:
            raise RuntimeError(f"injected fault at {point}")
        os._exit(17)


def check_sharding(trainer: Trainer, sharding: str, action: str) -> None:
    """Refuse what would write (or read) a wrong checkpoint."""
    sharding_refusal(sharding, any(buf.key.excludes_cp for buf in trainer.optimizer.buffers), action)


def _own_files(folder: Path, layout: str, rank: int) -> list[Path]:
    suffix = ".distcp" if layout == "torch_dist" else ".safetensors"
    return sorted(folder.glob(f"__{rank}_*{suffix}"))


def save_checkpoint(trainer: Trainer, root: str | os.PathLike, layout: str = "torch_dist",
                    sharding: str = fmt.FORMAT_NAME, aliased: bool = False, writer_threads: int | None = None,
                    integrity: bool = True) -> Path:
    """Save ``trainer`` at its current iteration under ``root``; return the committed folder.

    ``aliased=True`` is the pre-fix writer (see :func:`state.optimizer_state`), for fixtures only.
    ``writer_threads`` (torch_dist): files per rank, written in parallel; by default one per core, at
    most 4. Fixtures pin it so that their file list does not depend on the machine. ``integrity=False``
    leaves out the replica cross-check and the chunk records: only ``benchmarks/bench_save_integrity.py``
    uses it, to measure what they cost against the same run's save without them.
    """
    check_sharding(trainer, sharding, "save")
    if layout not in fmt.LAYOUTS:
        raise CheckpointError(f"unknown --ckpt-layout {layout!r}; use one of {fmt.LAYOUTS}")
    root = Path(root)
    rank = dist.get_rank()
    it = trainer.iteration
    final = root / fmt.iter_dir_name(it)
    writer = CheckpointWriter(final, replace=True, fault=_fault)
    name = [None]
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        name = [writer.begin().name]
    dist.broadcast_object_list(name, src=0)
    writer.adopt(root / name[0])
    dist.barrier()
    try:
        _write_and_commit(trainer, writer, layout, sharding, aliased, writer_threads, integrity)
    except BaseException:
        if rank == 0:
            writer.abort()
        raise
    dist.barrier()
    return final


def _write_and_commit(trainer: Trainer, writer: CheckpointWriter, layout: str, sharding: str, aliased: bool,
                      writer_threads: int | None, integrity: bool = True) -> None:
    """Every rank writes its files into the writer's work folder; rank 0 finishes and commits it."""
    rank, it, tmp = dist.get_rank(), trainer.iteration, writer.folder
    sd: dict[str, Any] = {}
    sd.update(model_state(trainer.model, trainer.groups, for_load=False))
    sd.update(optimizer_state(trainer.optimizer, trainer.groups, aliased=aliased))
    sd.update(bucket_numel_state(trainer.optimizer, trainer.groups, for_load=False))
    # every copy of replicated state must agree before one of them is written (all ranks' copies).
    # Not for the pre-fix writer: its folded keys collide across CP peers on purpose (fixtures of the bug).
    if integrity and not aliased:
        check_replicas(trainer, [model_state(trainer.model, trainer.groups, for_load=True), sd])
    # statistics: on CUDA now, on the device, before DCP copies the chunks; on CPU on a thread during the write
    stats_of = start_state_stats(sd) if integrity else dict
    _fault("before_write")
    # Several writer threads per rank (files __{rank}_0.., __{rank}_1..): torch.save releases the
    # GIL while it copies and writes, and measured on 2 cores this doubles DCP's save rate.
    threads = writer_threads or max(1, min(4, os.cpu_count() or 1))
    storage = (dcp.FileSystemWriter(tmp, sync_files=True, thread_count=threads) if layout == "torch_dist"
               else SafetensorsWriter(tmp))
    try:
        metadata = dcp.save(sd, storage_writer=storage, planner=ChunkSavePlanner())
    finally:
        stats = stats_of()  # joined even when the write fails: no thread outlives the save
    _fault("after_write")

    # one read-back of each file this rank wrote: its CRC-32C and the hash of every chunk in it
    own = _own_files(tmp, layout, rank)
    mine = record_own_files(tmp, layout, metadata, own, stats) if integrity else ({p.name: file_entry(p) for p in own},
                                                                                  None)
    everything: list[tuple[dict[str, FileEntry], list[ChunkRecord] | None] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everything, mine)
    if rank == 0:
        for part in everything:
            writer.add_files(part[0] if part else {})
            if part and part[1] is not None:
                writer.add_records(part[1])
        writer.add_file(fmt.DCP_METADATA_FILE if layout == "torch_dist" else INDEX_FILE)
        cfg = trainer.cfg
        manifest = build_manifest(
            layout=layout, sharding=sharding, iteration=it, par=cfg.par, model=cfg.model,
            optimizer=optimizer_info(trainer.optimizer, cfg.adam, cfg.muon, trainer.optimizer.step_count),
            buffers=buffer_layout(trainer.optimizer, trainer.groups),
            files={}, param_dtype=str(cfg.param_dtype), bucket_size=cfg.bucket_size)
        manifest.extra.update(save_run_state(trainer))
        if aliased:
            manifest.notes.append("written by the pre-fix (aliased) writer: folded keys lack .cp_rank_{i}")
        writer.finish(manifest, megatron_metadata(layout))
        _fault("before_rename")
        writer.commit()
        _fault("before_latest")
        writer.set_latest(it)


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
    ckpt, manifest = open_verified(path)
    folder = ckpt.root
    check_compatible(trainer.cfg, manifest, folder)
    reader = VerifiedReader(ckpt)
    metadata = reader.read_metadata()
    sd: dict[str, Any] = {}
    sd.update(model_state(trainer.model, trainer.groups, for_load=True))
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
    trainer.optimizer.step_count = manifest.optimizer.step
    trainer.iteration = manifest.iteration
    try:
        load_run_state(trainer, manifest, folder)
    except ConfigError as e:
        raise CheckpointError(str(e)) from e
    trainer.optimizer.zero_grad()
    return folder
