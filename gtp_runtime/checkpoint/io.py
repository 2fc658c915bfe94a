"""Save and load ``dp_reshardable`` checkpoints through DCP, with an atomic commit.

Save: every rank writes its chunks into ``.tmp.iter_{N}.{nonce}/`` (fsynced), rank 0 adds the
manifest and Megatron's ``metadata.json``, fsyncs the folder, renames it to ``iter_{N:07d}``, and
only then replaces ``latest_checkpointed_iteration.txt`` (write to a temporary file, fsync,
``os.replace``). A crash before the rename leaves only a ``.tmp.*`` folder that no reader treats
as a checkpoint; a crash after it leaves a complete new checkpoint and, at worst, ``latest``
still naming the previous one. Nothing ever looks complete without being complete.

Load: the manifest is checked against the running topology first (DP may differ; TP, CP,
GTP_remat, fold_cp, expert sizes and the model may not), then the keys and shapes of the stored
metadata, then DCP reads exactly the boxes this rank needs.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from gtp_format import names as fmt
from gtp_format.commit import commit_folder, write_atomic, write_durable
from gtp_format.errors import FormatError
from gtp_format.manifest import FileEntry, Manifest, read_manifest, write_manifest
from gtp_runtime.checkpoint import preflight
from gtp_runtime.checkpoint.dcp_chunks import ChunkLoadPlanner, ChunkSavePlanner
from gtp_runtime.checkpoint.manifest import buffer_layout, build_manifest, file_entry
from gtp_runtime.checkpoint.safe_metadata import SafeFileSystemReader, UnsafeMetadataError
from gtp_runtime.checkpoint.safetensors_storage import INDEX_FILE, SafetensorsReader, SafetensorsWriter
from gtp_runtime.checkpoint.state import (
    bucket_numel_state,
    expected_bucket_numels,
    model_state,
    optimizer_state,
)
from gtp_runtime.training import Trainer

MEGATRON_METADATA = {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                     "common_backend": "torch", "common_backend_version": 1}


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be saved or loaded as asked. One line, names the fix."""


def _fault(point: str) -> None:
    """Fault injection for crash tests: ``GTP_FAULT_INJECT=point:rank`` kills that rank there."""
    spec = os.environ.get("GTP_FAULT_INJECT", "")
    if spec and spec.split(":")[0] == point and int(spec.split(":")[1]) == dist.get_rank():
        os._exit(17)


def check_sharding(trainer: Trainer, sharding: str, action: str) -> None:
    """Refuse what would write (or read) a wrong checkpoint."""
    if sharding not in fmt.OPTIMIZER_SHARDINGS:
        raise CheckpointError(f"unknown --optimizer-sharding {sharding!r}; use one of {fmt.OPTIMIZER_SHARDINGS}")
    if sharding == fmt.FORMAT_NAME:
        return
    if any(buf.key.excludes_cp for buf in trainer.optimizer.buffers):
        raise CheckpointError(f"cannot {action}: " + fmt.folded_refusal(sharding))
    raise CheckpointError(f"cannot {action}: optimizer sharding {sharding!r} is not implemented by gtp_runtime "
                          "(it would gather buffers over DP x CP); use 'dp_reshardable'")


def _own_files(folder: Path, layout: str, rank: int) -> list[Path]:
    suffix = ".distcp" if layout == "torch_dist" else ".safetensors"
    return sorted(folder.glob(f"__{rank}_*{suffix}"))


def save_checkpoint(trainer: Trainer, root: str | os.PathLike, layout: str = "torch_dist",
                    sharding: str = fmt.FORMAT_NAME, aliased: bool = False, writer_threads: int | None = None) -> Path:
    """Save ``trainer`` at its current iteration under ``root``; return the committed folder.

    ``aliased=True`` is the pre-fix writer (see :func:`state.optimizer_state`), for fixtures only.
    ``writer_threads`` (torch_dist): files per rank, written in parallel; by default one per core, at
    most 4. Fixtures pin it so that their file list does not depend on the machine.
    """
    check_sharding(trainer, sharding, "save")
    if layout not in fmt.LAYOUTS:
        raise CheckpointError(f"unknown --ckpt-layout {layout!r}; use one of {fmt.LAYOUTS}")
    root = Path(root)
    rank = dist.get_rank()
    it = trainer.iteration
    name = [f".tmp.{fmt.iter_dir_name(it)}.{uuid.uuid4().hex[:8]}" if rank == 0 else None]
    dist.broadcast_object_list(name, src=0)
    tmp, final = root / name[0], root / fmt.iter_dir_name(it)
    if rank == 0:
        tmp.mkdir(parents=True)
    dist.barrier()

    sd: dict[str, Any] = {}
    sd.update(model_state(trainer.model, trainer.groups, for_load=False))
    sd.update(optimizer_state(trainer.optimizer, trainer.groups, aliased=aliased))
    sd.update(bucket_numel_state(trainer.optimizer, trainer.groups, for_load=False))
    _fault("before_write")
    # Several writer threads per rank (files __{rank}_0.., __{rank}_1..): torch.save releases the
    # GIL while it copies and writes, and measured on 2 cores this doubles DCP's save rate.
    threads = writer_threads or max(1, min(4, os.cpu_count() or 1))
    writer = (dcp.FileSystemWriter(tmp, sync_files=True, thread_count=threads) if layout == "torch_dist"
              else SafetensorsWriter(tmp))
    dcp.save(sd, storage_writer=writer, planner=ChunkSavePlanner())
    _fault("after_write")

    mine = {p.name: file_entry(p) for p in _own_files(tmp, layout, rank)}
    everything: list[dict[str, FileEntry] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everything, mine)
    if rank == 0:
        files: dict[str, FileEntry] = {}
        for part in everything:
            files.update(part or {})
        meta = tmp / (fmt.DCP_METADATA_FILE if layout == "torch_dist" else INDEX_FILE)
        files[meta.name] = file_entry(meta)
        cfg = trainer.cfg
        manifest = build_manifest(
            layout=layout, sharding=sharding, iteration=it, par=cfg.par, model=cfg.model, adam=cfg.adam,
            step=trainer.optimizer.step_count, buffers=buffer_layout(trainer.optimizer, trainer.groups),
            files=files, param_dtype=str(cfg.param_dtype), bucket_size=cfg.bucket_size)
        if aliased:
            manifest.notes.append("written by the pre-fix (aliased) writer: folded keys lack .cp_rank_{i}")
        write_manifest(tmp, manifest)
        megatron = MEGATRON_METADATA if layout == "torch_dist" else {"sharded_backend": "gtp_safetensors"}
        write_durable(tmp / fmt.MEGATRON_METADATA_FILE, json.dumps(megatron))
        _fault("before_rename")
        commit_folder(tmp, final)
        _fault("before_latest")
        write_atomic(root / fmt.LATEST_FILE, f"{it}\n")
    dist.barrier()
    return final


def resolve_checkpoint_dir(path: str | os.PathLike) -> Path:
    """A checkpoint folder, or its parent holding ``latest_checkpointed_iteration.txt``."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"{p}: no such checkpoint folder; check --load")
    if not p.is_dir():
        raise CheckpointError(f"{p}: is a file, expected a checkpoint folder; check --load")
    if (p / fmt.MANIFEST_FILE).exists():
        return p
    latest = p / fmt.LATEST_FILE
    if latest.exists():
        text = latest.read_text().strip()
        if not text.isdigit():
            raise CheckpointError(f"{latest}: expected an iteration number, found {text[:40]!r}")
        it_dir = p / fmt.iter_dir_name(int(text))
        if not it_dir.is_dir():
            raise CheckpointError(f"{latest} names iteration {text} but {it_dir.name} does not exist")
        return it_dir
    raise CheckpointError(f"{p}: neither a checkpoint (no {fmt.MANIFEST_FILE}) nor a parent with {fmt.LATEST_FILE}")


def _check_manifest(trainer: Trainer, manifest: Manifest, folder: Path) -> None:
    par, saved = trainer.cfg.par, manifest.topology
    assert saved is not None and manifest.model is not None  # a strict parse has every section
    changed = [f"{k}: saved {getattr(saved, k)} now {getattr(par, k)}"
               for k in ("tp", "cp", "gtp_remat", "fold_cp", "expert_gtp_remat")
               if getattr(saved, k) != getattr(par, k)]
    if changed:
        raise CheckpointError(f"{folder}: dp_reshardable reshards over DP only, but {'; '.join(changed)}; "
                              "load with the saved TP/CP/GTP_remat/fold_cp (only --dp may change)")
    model, stored = trainer.cfg.model.to_dict(), manifest.model.to_dict()
    diff = [f"{k}: saved {stored.get(k)} now {v}" for k, v in model.items() if stored.get(k) != v]
    if diff:
        raise CheckpointError(f"{folder}: model config differs ({'; '.join(diff)}); use the saved model flags")
    if manifest.param_dtype != str(trainer.cfg.param_dtype):
        raise CheckpointError(f"{folder}: saved with params {manifest.param_dtype}, running "
                              f"{trainer.cfg.param_dtype}; match --bf16 to the checkpoint")
    if manifest.optimizer_sharding != fmt.FORMAT_NAME:
        check_sharding(trainer, manifest.optimizer_sharding, "load")


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
    """Load into ``trainer`` (same topology: bit-exact; other DP size: resharded)."""
    check_sharding(trainer, sharding, "load")
    try:  # the format's confined reader and structural checks before DCP opens anything (see preflight)
        folder = preflight.resolve(path)
        preflight.check(folder)
    except preflight.PreflightError as e:
        raise CheckpointError(str(e)) from None
    try:
        manifest = read_manifest(folder, strict=True)
    except FormatError as e:
        raise CheckpointError(e.message) from None
    _check_manifest(trainer, manifest, folder)
    layout = manifest.layout
    reader = SafeFileSystemReader(folder) if layout == "torch_dist" else SafetensorsReader(folder)
    try:
        metadata = reader.read_metadata()
    except UnsafeMetadataError as e:
        raise CheckpointError(str(e)) from e
    sd: dict[str, Any] = {}
    sd.update(model_state(trainer.model, trainer.groups, for_load=True))
    sd.update(optimizer_state(trainer.optimizer, trainer.groups))
    numels = bucket_numel_state(trainer.optimizer, trainer.groups, for_load=True)
    sd.update(numels)
    _check_keys(sd, metadata.state_dict_metadata, folder)
    with torch.no_grad():
        dcp.load(sd, storage_reader=reader, planner=ChunkLoadPlanner())
    expected = expected_bucket_numels(trainer.optimizer, trainer.groups)
    for key, ch in numels.items():
        got, want = next(iter(ch.chunks.values())).tolist(), expected[key]
        if got != want:
            raise CheckpointError(f"{folder}: {key} is {got}, the running model's buckets are {want}; "
                                  "bucket layout differs (same --bucket-size and model?)")
    assert manifest.optimizer is not None
    trainer.optimizer.step_count = manifest.optimizer.step
    trainer.iteration = manifest.iteration
    trainer.optimizer.zero_grad()
    return folder
