"""``--load`` reads through the format package: the reader and the checks of ``ckpt verify``, then DCP.

Why: the runtime used to read ``.metadata`` with an unpickler of its own and trusted the storage
paths in it, so a path with ``..`` (or an absolute one) made ``--load`` read tensors from outside
the checkpoint, train on them and exit 0, while ``ckpt verify`` refused the same folder. Now a load
(in the launcher's parent process, before any rank starts, and again on every rank before it
allocates or reads anything):

1. passes the one gate, :func:`gtp_format.check.gate.open_gated`: the reader of ``ckpt`` (latest-marker
   resolution, confined metadata reads, the inert pickle reader), the strict manifest verdict of
   that same single parse, and ``ckpt verify``'s metadata checks (not ``--data``), refused on the
   first error with the line ``ckpt verify`` prints;
2. checks the strict manifest against the running configuration.

The tensors are then read by :class:`VerifiedReader`: DCP plans the reads against metadata built
from that same verified model (``.metadata`` is parsed once, by one parser, so no second reader can
understand the file differently), and every chunk is read by :func:`gtp_format.reader.chunks.load_chunk`:
opened relative to the folder, regular files only, byte range checked against the real size,
decoded without ``torch.load``, dtype and shape checked against the metadata.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader

from gtp_format import names as fmt
from gtp_format.check.gate import open_gated
from gtp_format.errors import FormatError
from gtp_format.manifest import Manifest
from gtp_format.model import TENSOR, Checkpoint, Chunk, Entry
from gtp_format.reader.chunks import load_chunk
from gtp_format.session import Session
from gtp_runtime.checkpoint.errors import CheckpointError, sharding_refusal
from gtp_runtime.checkpoint.pinned import POOL
from gtp_runtime.training import TrainConfig

LOAD_NEEDS = ("--load resumes from the manifest's topology and bucket layout (a megatron-core one? bring its "
              "weights in with 'ckpt export SRC HF --to hf' then 'ckpt import HF DST --from hf'; optimizer state "
              "does not carry over), or pass a folder that gtp_runtime saved")


def open_verified(path: str | os.PathLike, session: Session | None = None) -> tuple[Checkpoint, Manifest]:
    """The checkpoint at ``path`` (or its latest iteration) and its strict manifest, through the one gate;
    read in ``session`` (the load's), whose storage the checkpoint keeps."""
    try:
        gated = open_gated(path, needs_manifest=LOAD_NEEDS, session=session)
    except FormatError as e:
        raise CheckpointError(e.message) from None
    ckpt, manifest = gated.ckpt, gated.manifest
    assert manifest is not None  # needs_manifest
    if manifest.layout != ckpt.layout:
        raise CheckpointError(f"{ckpt.root}: the manifest says layout {manifest.layout!r} but the folder holds "
                              f"{ckpt.layout!r} files; the manifest belongs to another checkpoint")
    return ckpt, manifest


def check_compatible(cfg: TrainConfig, manifest: Manifest, folder: Path) -> None:
    """The running configuration can load this checkpoint: only DP may differ."""
    par, saved = cfg.par, manifest.topology
    assert saved is not None and manifest.model is not None  # a strict parse has every section
    changed = [f"{k}: saved {getattr(saved, k)} now {getattr(par, k)}"
               for k in ("tp", "cp", "gtp_remat", "fold_cp", "expert_gtp_remat")
               if getattr(saved, k) != getattr(par, k)]
    if changed:
        fold = "--fold-cp" if par.fold_cp else "--no-fold-cp"
        raise CheckpointError(f"{folder}: dp_reshardable reshards over DP only, but {'; '.join(changed)}; reshard "
                              f"it first: ckpt reshard {folder} NEW --tp {par.tp} --cp {par.cp} --gtp-remat "
                              f"{par.gtp_remat} {fold} --expert-gtp-remat {par.expert_gtp_remat} --dp {par.dp}, then "
                              "--load NEW ('ckpt plan' shows what changes), or load with the saved "
                              "TP/CP/GTP_remat/fold_cp")
    model, stored = cfg.model.to_dict(), manifest.model.to_dict()
    diff = [f"{k}: saved {stored.get(k)} now {v}" for k, v in model.items() if stored.get(k) != v]
    if diff:
        raise CheckpointError(f"{folder}: model config differs ({'; '.join(diff)}); use the saved model flags")
    if manifest.param_dtype != str(cfg.param_dtype):
        raise CheckpointError(f"{folder}: saved with params {manifest.param_dtype}, running "
                              f"{cfg.param_dtype}; match --bf16 to the checkpoint")
    saved_opt = "muon" if manifest.optimizer is not None and manifest.optimizer.type == "muon" else "adam"
    if saved_opt != cfg.optimizer:
        # Muon's momentum sits where AdamW's first moment would: loading one as the other would
        # run without error and train with the wrong state.
        raise CheckpointError(f"{folder}: saved with --optimizer {saved_opt}, running --optimizer {cfg.optimizer}; "
                              f"pass --optimizer {saved_opt}")
    if manifest.optimizer_sharding != fmt.FORMAT_NAME:
        sharding_refusal(manifest.optimizer_sharding, any(b.excludes_cp for b in manifest.buffers or ()), "load")


def preflight(path: str | os.PathLike, cfg: TrainConfig, sharding: str, lineage: bool = True) -> Path:
    """Everything ``--load`` checks before a rank exists; returns the checkpoint folder to load.
    ``lineage``: refuse an iteration that fails the lineage checks (``--no-check-lineage`` turns it off)."""
    sharding_refusal(sharding, cfg.par.fold_cp and cfg.par.cp > 1, "load")
    ckpt, manifest = open_verified(path)
    check_compatible(cfg, manifest, ckpt.root)
    if lineage:
        check_lineage(ckpt)
    return ckpt.root


def check_lineage(ckpt: Checkpoint) -> None:
    """Refuse to resume from an iteration that ``ckpt log`` flags (:mod:`gtp_format.check.lineage`): stale,
    foreign, renamed, with restarted optimizer state, or not the one the latest marker should name.
    Metadata only: each iteration's manifest and chunk records. A folder not named ``iter_*`` has no run
    around it to compare with and is not checked."""
    from gtp_format.check.lineage import resume_check

    if not fmt.ITER_DIR_RE.match(ckpt.root.name):
        return
    run = ckpt.root.parent
    try:
        why, note = resume_check(run, ckpt.root.name, str(run), ckpt)
    except FormatError as e:
        raise CheckpointError(f"{ckpt.root}: refusing to resume: {e.message}; pass --no-check-lineage to load it "
                              "anyway") from None
    if why is not None:
        raise CheckpointError(why)
    if note is not None and int(os.environ.get("RANK", "0")) == 0:
        print(f"note: {note}", flush=True)


READ_THREADS = max(1, min(8, os.cpu_count() or 1))  # chunks read at once by a load (one per core, at most 8)


class VerifiedReader(StorageReader):
    """A DCP storage reader over a verified :class:`Checkpoint` (either layout)."""

    def __init__(self, ckpt: Checkpoint) -> None:
        super().__init__()
        self.ckpt = ckpt
        self.storage_data: dict[MetadataIndex, tuple[Entry, Chunk]] = {}

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        pass

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """DCP metadata of every tensor, built from the verified model (gtp_runtime saves no objects)."""
        sdm: dict[str, Any] = {}
        storage: dict[MetadataIndex, tuple[Entry, Chunk]] = {}
        for key, e in self.ckpt.entries.items():
            if e.kind != TENSOR or e.dtype is None or e.shape is None:
                continue
            sdm[key] = TensorStorageMetadata(
                properties=TensorProperties(dtype=e.dtype.torch), size=torch.Size(e.shape),
                chunks=[ChunkStorageMetadata(offsets=torch.Size(c.offsets), sizes=torch.Size(c.sizes))
                        for c in e.chunks])
            for c in e.chunks:
                storage[MetadataIndex(key, torch.Size(c.offsets), c.index)] = (e, c)
        return Metadata(state_dict_metadata=sdm, storage_data=storage, storage_meta=StorageMeta())

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future:
        # Reads grouped by stored chunk: each is read and decoded once, however many of this
        # rank's boxes overlap it (a DP reshard), and its buffer reused after. Several chunks are read
        # at once (:data:`READ_THREADS`): one thread waits for the disk, checks a CRC-32 (zlib, no
        # GIL) or copies to the device at a time: one chunk at a time, the H200 load read 0.50x the cold
        # dd rate, several at once 0.66x, and with O_DIRECT reads into the pooled buffers
        # (:mod:`gtp_format.reader.preads`) 1.21x (docs/performance.md). Into a CUDA tensor, each thread
        # reads into its pinned buffer (:mod:`.pinned`), so the copy to the device is a DMA (24 GB/s
        # there against 1 GB/s from pageable memory).
        by_chunk: dict[tuple[str, int], list[tuple[ReadItem, torch.Tensor]]] = {}
        for item in plan.items:
            e, c = self.storage_data[item.storage_index]
            by_chunk.setdefault((e.key, c.index), []).append((item, planner.resolve_tensor(item).detach()))
        groups = list(by_chunk.values())
        stream: dict[tuple[int, torch.device], Any] = {}

        def read(group: list[tuple[ReadItem, torch.Tensor]]) -> None:
            e, c = self.storage_data[group[0][0].storage_index]
            stored = load_chunk(self.ckpt, e, c, POOL.take)
            on_gpu = group[0][1].is_cuda
            if on_gpu:
                dev = group[0][1].device
                s = stream.get((threading.get_ident(), dev))
                if s is None:
                    s = stream[(threading.get_ident(), dev)] = torch.cuda.Stream(device=dev)
                s.wait_stream(torch.cuda.current_stream(dev))
            for item, dest in group:
                src = stored
                for dim, (o, n) in enumerate(zip(item.storage_offsets, item.lengths)):
                    src = src.narrow(dim, o, n)
                if dest.shape != src.shape:
                    raise CheckpointError(f"{self.ckpt.root}: chunk of {e.key} has shape {tuple(src.shape)} where "
                                          f"{tuple(dest.shape)} was planned")
                if dest.is_cuda and on_gpu:
                    with torch.cuda.stream(s):
                        dest.copy_(src, non_blocking=True)
                else:
                    dest.copy_(src)
            if on_gpu:
                s.synchronize()  # the pinned buffer is this thread's next chunk's

        with POOL.lease():  # given back once every thread has stopped (the executor's exit waits for them)
            threads = min(READ_THREADS, len(groups))
            if threads <= 1:
                for g in groups:
                    read(g)
            else:
                with ThreadPoolExecutor(threads, thread_name_prefix="ckpt-load") as ex:
                    futures = [ex.submit(read, g) for g in groups]
                    try:
                        for f in futures:
                            f.result()
                    except BaseException:
                        for f in futures:  # the first bad chunk ends the load: read no more
                            f.cancel()
                        raise
        for g in groups:
            for item, dest in g:
                planner.commit_tensor(item, dest)
        done: torch.futures.Future = torch.futures.Future()
        done.set_result(None)
        return done

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return True
