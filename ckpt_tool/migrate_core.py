"""Library behind ``ckpt migrate-aliased``: turn a pre-fix (aliased) checkpoint into a correct one.

The pre-fix writer left ``.cp_rank_{i}`` off the optimizer keys of folded buffers, so CP peers
offered the same key and offset and DCP kept one copy per chunk (domain reference, section 5).
What survives of chunk ``(key, offset)`` is one CP rank's state; the name ``__{rank}_{k}.distcp``
of the file holding it names the writer, and the manifest topology gives the writer's CP rank.

A migration never touches SRC:

1. each surviving chunk becomes a chunk of ``{key}.cp_rank_{w}`` (canonical suffix form). Only
   ``.metadata`` changes (state_dict_metadata, storage_data, planner_data); the data files are
   hard-linked (copied where links fail);
2. the other CP ranks' copies of that chunk are lost. Their fp32 master (``param``) is rebuilt
   from the model weights of the same checkpoint with the manifest's bucket layout: bit-exact
   when the weights are fp32 (the master is what the optimizer published into them), lossy
   otherwise (recorded). Their Adam moments are gone: written as zeros only when asked
   (``reset_lost_moments``), and recorded in the manifest (``notes`` and ``migration``);
3. the result is built in a temporary sibling folder, checked with ``ckpt verify``'s own
   structural checks, fsynced, and renamed into place.

The new chunks go to one new data file ``__{world}_{k}.distcp``: a DCP-shaped name (readers that
parse ranks accept it) whose "rank" is outside the world, so it can never be taken for a rank's
file. Each chunk in it is a complete ``torch.save`` blob, exactly as DCP's FileSystemWriter writes.

``.metadata`` of SRC is read only through the allow-listing unpickler; the new one is built from
real ``torch.distributed.checkpoint`` objects and pickled the way ``FileSystemWriter.finish``
does (``pickle.dump`` of the ``Metadata``).
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import errno
import math
import os
import pickle
import shutil
import sys
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from gtp_format.check.analysis import OPTIMIZER, classify_all, topology_view
from gtp_format.commit import fsync_dir
from gtp_format.dtypes import DTYPES, LAYOUTS, DType
from gtp_format.errors import EXIT_CHECK_FAILED, FormatError
from gtp_format.hashing import CRCS, HASHERS, Crc, file_digests, gf2_times
from gtp_format.layout import topology as topo
from gtp_format.layout.config import ParallelConfig
from gtp_format.layout.shard import ShardSpec
from gtp_format.layout.topology import Topology
from gtp_format.manifest import (
    HASH_ALGORITHM,
    BucketLayout,
    BufferLayout,
    Manifest,
    ParamLayout,
    parse_manifest,
    read_manifest,
    write_manifest,
)
from gtp_format.model import TENSOR, Checkpoint, Entry
from gtp_format.names import (
    DCP_METADATA_FILE,
    LATEST_FILE,
    MANIFEST_FILE,
    STATES,
    OptimizerKey,
    distcp_writer_rank,
    parse_optimizer_key,
)
from gtp_format.reader.checkpoint import open_checkpoint
from gtp_format.reader.chunks import load_chunk
from gtp_format.reader.locate import LAYOUT_TORCH_DIST, locate, metadata_limit
from gtp_format.reader.safe_pickle import (
    BytesStorageRecord,
    MemFormatEncodingRecord,
    MetadataIndexRecord,
    MetadataRecord,
    StorageInfoRecord,
    StorageMetaRecord,
    TensorPropertiesRecord,
    TensorStorageRecord,
    TorchConstant,
    load_metadata_pickle,
)
from gtp_format.reader.storage import read_small_file

MIGRATION_VERSION = 1
TOOL = "ckpt migrate-aliased"
REBUILD = "rebuilt_from_weights"  # lost fp32 master, rebuilt from the model weights
RESET = "reset_to_zero"  # lost Adam moment, written as zeros (--reset-lost-moments)
LOST = "lost"  # lost Adam moment, not written (the migration is refused)
_KNOWN_METADATA_FIELDS = {"state_dict_metadata", "planner_data", "storage_data", "storage_meta", "version"}

Progress = Callable[[int], None]


# --------------------------------------------------------------------------------------------
# The source
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Source:
    """The checkpoint to migrate: the iteration folder, and its parent when SRC named one."""

    given: Path
    folder: Path
    parent: Path | None  # SRC was a parent holding latest_checkpointed_iteration.txt
    latest_text: str | None


def locate_source(path: Path) -> Source:
    loc = locate(path)
    if loc.layout != LAYOUT_TORCH_DIST:
        raise FormatError(f"{loc.folder} uses the {loc.layout} layout; migrate-aliased rewrites DCP .metadata and "
                        "only applies to torch_dist checkpoints (gtp_runtime never wrote aliased safetensors ones)")
    if Path(os.path.abspath(loc.folder)) == Path(os.path.abspath(path)):
        return Source(Path(path), loc.folder, None, None)
    marker = Path(path) / LATEST_FILE
    text = read_small_file(marker, 64, "an iteration marker", f"fix {LATEST_FILE}").decode("utf-8", "replace")
    return Source(Path(path), loc.folder, Path(path), text.strip())


# --------------------------------------------------------------------------------------------
# The manifest's bucket layout
# --------------------------------------------------------------------------------------------

# --------------------------------------------------------------------------------------------
# The plan
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class KeptChunk:
    """A surviving chunk: it moves to ``new_key`` (its writer's CP rank), data untouched."""

    source_key: str
    new_key: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    rank: int
    cp_rank: int


@dataclass(frozen=True)
class LostChunk:
    """A CP rank's copy of a chunk that DCP dropped at save."""

    source_key: str
    new_key: str
    state: str
    cp_rank: int
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    kept_rank: int  # writer of the copy that survived
    kept_cp_rank: int
    action: str  # REBUILD, RESET or LOST
    params: tuple[str, ...] = ()  # for a param chunk: the params it covers (empty for padding)


@dataclass
class AliasedKey:
    source_key: str
    opt: OptimizerKey
    new_keys: list[str]  # index = CP rank
    kept: list[KeptChunk] = field(default_factory=list)


@dataclass
class Plan:
    source: Source
    ckpt: Checkpoint
    par: ParallelConfig | None
    status: str  # "aliased" | "not_aliased"
    message: str
    keys: list[AliasedKey] = field(default_factory=list)
    lost: list[LostChunk] = field(default_factory=list)
    buffers: dict[int, BufferLayout] = field(default_factory=dict)
    weight_dtypes: dict[str, str] = field(default_factory=dict)  # weights read for rebuilt masters
    reset_lost_moments: bool = False

    @property
    def kept(self) -> list[KeptChunk]:
        return [c for k in self.keys for c in k.kept]

    @property
    def lossy(self) -> list[str]:
        """Weights that are not fp32: masters rebuilt from them are rounded."""
        return sorted(n for n, d in self.weight_dtypes.items() if d != str(torch.float32))

    @property
    def refused_moments(self) -> list[LostChunk]:
        return [c for c in self.lost if c.action == LOST]

    def counts(self) -> dict[str, int]:
        lost = self.lost
        return {
            "aliased_keys": len(self.keys),
            "new_keys": sum(len(k.new_keys) for k in self.keys),
            "kept_chunks": len(self.kept),
            "lost_chunks": len(lost),
            "lost_elements": sum(math.prod(c.sizes) for c in lost),
            "rebuilt_param_chunks": sum(c.action == REBUILD for c in lost),
            "reset_moment_chunks": sum(c.action == RESET for c in lost),
            "unrecoverable_moment_chunks": sum(c.action == LOST for c in lost),
        }


def plan_migration(src: Path, cp_size: int | None, reset_lost_moments: bool) -> Plan:
    """Work out every rename and every lost chunk from metadata and the manifest.

    Reads no tensor data except the tiny ``per_bucket_numel`` ones that verify's structural checks
    decode; every refusal (exit 2) happens here, before anything is written.
    """
    source = locate_source(src)
    ckpt = open_checkpoint(source.folder)
    folder = ckpt.root
    classes = classify_all(ckpt)
    cpless = [k for k, c in classes.items() if c.category == OPTIMIZER and c.opt is not None and c.opt.cp_rank is None]
    if ckpt.manifest is None:
        raise FormatError(_no_manifest_message(folder, cp_size, cpless, classes))
    view = topology_view(ckpt.manifest, None)
    par = view.par
    if par is None:
        why = "; ".join(p.message for p in view.notes) or "it has no topology"
        raise FormatError(f"{folder / MANIFEST_FILE}: cannot use its topology ({why}); the writer rank -> CP rank map "
                        "needs it: restore the manifest from the run")
    if cp_size is not None and cp_size != par.cp:
        raise FormatError(f"--cp-size {cp_size} contradicts {folder / MANIFEST_FILE} (cp={par.cp}); drop --cp-size or "
                        "fix the manifest")
    buffers = {b.gbuf_idx: b for b in read_manifest(folder, strict=True).buffers or ()}
    plan = Plan(source, ckpt, par, "not_aliased", "", buffers=buffers, reset_lost_moments=reset_lost_moments)
    if not (par.fold_cp and par.cp > 1):
        plan.message = f"not folded ({par.describe()}): no key can be aliased"
        return plan
    folded = {g for g, b in buffers.items() if b.excludes_cp and not b.is_expert}
    aliased = [k for k in cpless if classes[k].opt.gbuf_idx in folded]  # type: ignore[union-attr]
    if not aliased:
        plan.message = "no folded optimizer key lacks .cp_rank_{i}"
        return plan
    _refuse_structural_problems(ckpt)
    present = {(c.opt.bucket_id, c.opt.state, c.opt.cp_rank): k for k, c in classes.items()
               if c.opt is not None and c.opt.cp_rank is not None}
    grid = Topology(par)
    for key in aliased:
        plan.keys.append(_plan_key(ckpt, key, classes[key].opt, buffers, grid, present))  # type: ignore[arg-type]
    for ak in plan.keys:
        for c in ak.kept:
            for j in range(par.cp):
                if j == c.cp_rank:
                    continue
                plan.lost.append(_lost_chunk(plan, ak, c, j, grid))
    plan.status = "aliased"
    plan.message = (f"{len(plan.keys)} folded optimizer keys lack .cp_rank_{{i}}: {len(plan.kept)} chunks survive, "
                    f"{len(plan.lost)} CP-peer chunks were lost at save")
    return plan


def _no_manifest_message(folder: Path, cp_size: int | None, cpless: list[str], classes: dict[str, Any]) -> str:
    buffers = sorted({(c.opt.dp_group_idx, c.opt.gbuf_idx) for k, c in classes.items() if k in cpless})
    gbufs = sorted({g for _, g in buffers})
    if cp_size is None:
        hint = "--cp-size N only says whether it was folded"
    elif cp_size <= 1:
        return f"{folder}: --cp-size {cp_size} declares it unfolded: no key can be aliased; nothing to migrate"
    elif len(gbufs) > 1:
        hint = (f"with --cp-size {cp_size} its {len(cpless)} cp-less optimizer keys span gbuf_idx {gbufs}, and only "
                "the manifest says which of those buffers folded (replicated params never do)")
    else:
        hint = f"--cp-size {cp_size} marks its {len(cpless)} cp-less optimizer keys as folded"
    return (f"{folder} has no {MANIFEST_FILE}: {hint}, but mapping each chunk's writer rank to its CP rank and "
            "rebuilding the lost CP ranks' fp32 masters need the manifest's topology and bucket layout; restore "
            f"{MANIFEST_FILE} from the run (migrate-aliased refuses to guess)")


def _refuse_structural_problems(ckpt: Checkpoint) -> None:
    """SRC must be sound apart from the aliasing itself: verify's structural checks, metadata only."""
    from gtp_format.check.verify import verify

    result = verify(ckpt)
    errors = [p for p in result.problems if p.severity == "error" and p.check != "aliasing"]
    if errors:
        p = errors[0]
        where = p.key or p.file or str(ckpt.root)
        raise FormatError(f"{ckpt.root} has {len(errors)} problems besides the aliasing, first: {where}: {p.message}; "
                        "run 'ckpt verify' on it and repair it first")


def _plan_key(ckpt: Checkpoint, key: str, opt: OptimizerKey, buffers: dict[int, BufferLayout], grid: Topology,
              present: dict[tuple[Any, ...], str]) -> AliasedKey:
    par = grid.par
    folder = ckpt.root
    entry = ckpt.entries[key]
    buf = buffers[opt.gbuf_idx]
    if opt.state not in STATES:
        raise FormatError(f"{key}: unknown optimizer state {opt.state!r}; migrate-aliased knows {list(STATES)}")
    if opt.dtype != buf.dtype:
        raise FormatError(f"{key}: dtype {opt.dtype} but {MANIFEST_FILE} says gbuf_idx_{opt.gbuf_idx} is {buf.dtype}; "
                        "the manifest does not describe this checkpoint")
    if buf.dp_group_kind != topo.DP or buf.dp_size != par.dp:
        raise FormatError(f"{folder / MANIFEST_FILE}: folded gbuf_idx_{opt.gbuf_idx} reduces over "
                        f"{buf.dp_group_kind} of size {buf.dp_size}, expected the dp group of size {par.dp}")
    bucket = buf.bucket(opt.bucket_idx)
    if bucket is None or entry.shape != (bucket.numel_unpadded,) or entry.dtype is not DTYPES["float32"]:
        want = "missing" if bucket is None else f"(numel_unpadded {bucket.numel_unpadded},) float32"
        raise FormatError(f"{key}: shape {list(entry.shape or ())} {entry.dtype}, but {MANIFEST_FILE} has bucket "
                        f"{opt.bucket_idx} of gbuf_idx_{opt.gbuf_idx} {want}")
    new_keys = [opt.with_cp_rank(j) for j in range(par.cp)]
    for j in range(par.cp):
        clash = present.get((opt.bucket_id, opt.state, j))
        if clash is not None:
            raise FormatError(f"{key} is aliased but {clash} exists too: a half-migrated checkpoint; migrate from the "
                            "original aliased copy")
    local = bucket.numel // buf.dp_size
    ak = AliasedKey(key, opt, new_keys)
    for c in entry.chunks:
        file = c.storage.file if c.storage else ""
        rank = distcp_writer_rank(os.path.basename(file))
        if rank is None or rank >= grid.world_size:
            raise FormatError(f"{key} chunk {c.index} is stored in {file!r}, not a __{{rank}}_{{k}}.distcp file of a "
                            f"rank of the {grid.world_size}-rank world: its writer, and so its CP rank, is unknown")
        co = grid.coords(rank)
        n = grid.model_parallel_rank(rank)
        if n != opt.dp_group_idx or c.offsets[0] // local != co.dp:
            raise FormatError(f"{key} chunk {c.index} at offset {c.offsets[0]} is stored in {file} (rank {rank}: "
                            f"model-parallel rank {n}, dp rank {co.dp}), which cannot have written it; the file "
                            "names do not match the manifest topology")
        ak.kept.append(KeptChunk(key, new_keys[co.cp], c.offsets, c.sizes, file, rank, co.cp))
    return ak


def _shard_spec(p: ParamLayout, par: ParallelConfig, n: int, cp_rank: int) -> ShardSpec:
    """Where CP rank ``cp_rank`` of model-parallel rank ``n`` keeps its shard of ``p`` (dense folded)."""
    tp, g = n % par.tp, n // par.tp
    return ShardSpec(full_shape=p.full_shape, tp_mode=p.tp_mode, tp_size=par.tp, tp_rank=tp,
                     shard_kind=p.shard_kind, shard_size=p.shard_size, shard_rank=cp_rank + par.cp * g,
                     align=p.align)


def _pieces(bucket: BucketLayout, lo: int, hi: int) -> list[tuple[ParamLayout, int, int]]:
    return [(p, max(lo, p.start), min(hi, p.end)) for p in bucket.params if max(lo, p.start) < min(hi, p.end)]


def _lost_chunk(plan: Plan, ak: AliasedKey, kept: KeptChunk, j: int, grid: Topology) -> LostChunk:
    opt = ak.opt
    if opt.state != "param":
        action = RESET if plan.reset_lost_moments else LOST
        return LostChunk(ak.source_key, ak.new_keys[j], opt.state, j, kept.offsets, kept.sizes, kept.rank,
                         kept.cp_rank, action)
    bucket = plan.buffers[opt.gbuf_idx].bucket(opt.bucket_idx)
    lo = kept.offsets[0]
    names = []
    for p, _a, _b in _pieces(bucket, lo, lo + kept.sizes[0]):
        _check_rebuildable(plan, p, opt, j, grid)
        names.append(p.name)
    return LostChunk(ak.source_key, ak.new_keys[j], opt.state, j, kept.offsets, kept.sizes, kept.rank,
                     kept.cp_rank, REBUILD, tuple(names))


def _check_rebuildable(plan: Plan, p: ParamLayout, opt: OptimizerKey, j: int, grid: Topology) -> None:
    par = grid.par
    where = f"param {p.name} of {opt.with_cp_rank(j)}"
    if p.shard_kind != topo.WEIGHT or p.shard_size != par.cp * par.gtp_remat:
        raise FormatError(f"{where}: {MANIFEST_FILE} says shard_kind {p.shard_kind!r} over {p.shard_size} ranks, not "
                        f"the folded weight group of {par.cp * par.gtp_remat}; cannot locate its lost shard")
    spec = _shard_spec(p, par, opt.dp_group_idx, j)
    entry = plan.ckpt.entries.get(p.name)
    if entry is None or entry.kind != TENSOR:
        raise FormatError(f"{where}: the model weight {p.name!r} is not in {plan.ckpt.root}; the lost fp32 master "
                        "cannot be rebuilt")
    if spec.local_shape != p.local_shape or spec.global_shape != p.global_shape or entry.shape != p.global_shape:
        raise FormatError(f"{where}: weight {p.name} has global shape {list(entry.shape or ())}, {MANIFEST_FILE} "
                        f"says {list(p.global_shape)} (local {list(p.local_shape)}), the shard math gives "
                        f"{list(spec.global_shape)} (local {list(spec.local_shape)}); the manifest does not match")
    plan.weight_dtypes[p.name] = str(entry.dtype)


# --------------------------------------------------------------------------------------------
# Reading weights and rebuilding masters
# --------------------------------------------------------------------------------------------

def read_box(ckpt: Checkpoint, entry: Entry, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
    """The box ``[offsets, offsets + sizes)`` of a tensor key, from whichever chunks cover it."""
    assert entry.dtype is not None
    for c in entry.chunks:  # the usual case: the writer's chunk is exactly the shard
        if c.offsets == tuple(offsets) and c.sizes == tuple(sizes):
            return load_chunk(ckpt, entry, c)
    out = torch.zeros(sizes, dtype=entry.dtype.torch)
    covered = 0
    for c in entry.chunks:
        lo = [max(o, co) for o, co in zip(offsets, c.offsets)]
        hi = [min(o + s, co + cs) for o, s, co, cs in zip(offsets, sizes, c.offsets, c.sizes)]
        if any(a >= b for a, b in zip(lo, hi)):
            continue
        t = load_chunk(ckpt, entry, c)
        src = t[tuple(slice(a - co, b - co) for a, b, co in zip(lo, hi, c.offsets))]
        out[tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, offsets))] = src
        covered += math.prod(b - a for a, b in zip(lo, hi))
    if covered != math.prod(sizes):
        raise FormatError(f"{entry.key}: only {covered} of the {math.prod(sizes)} elements at offsets {list(offsets)} "
                        f"sizes {list(sizes)} are stored; the weight shard needed to rebuild a master is incomplete",
                        EXIT_CHECK_FAILED)
    return out


class _ShardCache:
    """Flattened fp32 weight shards, most recent few only (consecutive chunks share params)."""

    def __init__(self, ckpt: Checkpoint, size: int = 4) -> None:
        self.ckpt, self.size = ckpt, size
        self.items: OrderedDict[tuple[Any, ...], torch.Tensor] = OrderedDict()

    def get(self, name: str, spec: ShardSpec) -> torch.Tensor:
        k = (name, spec.global_offset, spec.local_shape)
        if k not in self.items:
            entry = self.ckpt.entries[name]
            self.items[k] = read_box(self.ckpt, entry, spec.global_offset, spec.local_shape).reshape(-1).float()
            while len(self.items) > self.size:
                self.items.popitem(last=False)
        self.items.move_to_end(k)
        return self.items[k]


def rebuild_master(plan: Plan, lost: LostChunk, shards: _ShardCache) -> torch.Tensor:
    """fp32 master of a lost chunk: the shard's elements where a param is, 0 in tail padding and gaps."""
    assert plan.par is not None
    opt = parse_optimizer_key(lost.source_key)
    assert opt is not None
    bucket = plan.buffers[opt.gbuf_idx].bucket(opt.bucket_idx)
    lo, n = lost.offsets[0], lost.sizes[0]
    out = torch.zeros(n, dtype=torch.float32)
    for p, a, b in _pieces(bucket, lo, lo + n):
        spec = _shard_spec(p, plan.par, opt.dp_group_idx, lost.cp_rank)
        valid_end = p.start + spec.valid_rows * math.prod(spec.local_shape[1:])
        z = min(b, valid_end)
        if a < z:
            out[a - lo: z - lo] = shards.get(p.name, spec)[a - p.start: z - p.start]
    return out


# --------------------------------------------------------------------------------------------
# DCP metadata: safe records -> real objects, with the renames
# --------------------------------------------------------------------------------------------

_PLAIN_NODES_PER_KEY = 64  # DCP's planner_data holds a key path (a few strings) per key
_MEMORY_FORMATS = {0: torch.contiguous_format, 1: torch.channels_last, 2: torch.preserve_format}


def _plain(value: Any, where: str, budget: list[int]) -> Any:
    """A copy of plain data (planner_data); anything else is refused rather than re-pickled.

    ``budget`` (one mutable count) caps the values visited: a pickle can put one list in both
    slots of another, and so on, so that a few hundred bytes of file make a walk of 2**100 values.
    """
    budget[0] -= 1
    if budget[0] < 0:
        raise FormatError(f"{where} holds more values than its keys can use (shared sub-lists?); migrate-aliased only "
                        "rewrites plain planner_data (DCP's default planner writes a dict of key paths)")
    if value is None or type(value) in (str, int, float, bool):
        return value
    if type(value) in (list, tuple):
        return type(value)(_plain(v, where, budget) for v in value)
    if type(value) is dict:
        return {_plain(k, where, budget): _plain(v, where, budget) for k, v in value.items()}
    raise FormatError(f"{where} holds a {type(value).__name__}; migrate-aliased only rewrites plain planner_data "
                    "(DCP's default planner writes a dict of key paths)")


def _properties(rec: Any, where: str) -> Any:
    from torch.distributed.checkpoint.metadata import TensorProperties

    if not isinstance(rec, TensorPropertiesRecord):
        raise FormatError(f"{where}: properties are not TensorProperties")
    enc = rec.get("memory_format")
    fmt = _MEMORY_FORMATS.get(enc.value) if isinstance(enc, MemFormatEncodingRecord) else None
    layout, dtype = rec.get("layout"), rec.get("dtype")
    if fmt is None or type(layout) is not TorchConstant or layout.name not in LAYOUTS or type(dtype) is not DType:
        raise FormatError(f"{where}: properties have an unknown memory format, layout or dtype")
    return TensorProperties(dtype=dtype.torch, layout=layout.torch, requires_grad=bool(rec.get("requires_grad", False)),
                            memory_format=fmt, pin_memory=bool(rec.get("pin_memory", False)))


def read_source_metadata(folder: Path, data_bytes: int) -> Any:
    """SRC's ``.metadata`` through the allow-list (never ``pickle.load``)."""
    path = folder / DCP_METADATA_FILE
    raw = read_small_file(path, metadata_limit(data_bytes), "DCP metadata", "restore it from a good copy")
    md = load_metadata_pickle(raw, str(path))
    if not isinstance(md, MetadataRecord):
        raise FormatError(f"{path} does not hold DCP Metadata; restore it from a good copy")
    extra = sorted(set(md.state) - _KNOWN_METADATA_FIELDS)
    if extra:
        raise FormatError(f"{path} has Metadata fields {extra} that migrate-aliased does not know how to carry over; "
                        "it handles torch.distributed.checkpoint metadata as torch 2.13 writes it")
    return md


def build_metadata(plan: Plan, md: Any, new_file: str, lost_storage: dict[tuple[str, tuple[int, ...]], tuple[int, int]],
                   checkpoint_id: Path) -> Any:
    """The migrated ``Metadata``: aliased keys split per CP rank, storage pointed at kept or new data."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorStorageMetadata,
    )

    path = plan.ckpt.root / DCP_METADATA_FILE
    by_key = {k.source_key: k for k in plan.keys}
    kept_cp = {(c.source_key, c.offsets): c.cp_rank for c in plan.kept}
    sdm: dict[str, Any] = {}
    for key, item in md.get("state_dict_metadata").items():
        if isinstance(item, BytesStorageRecord):
            sdm[key] = BytesStorageMetadata()
            continue
        if not isinstance(item, TensorStorageRecord):
            raise FormatError(f"{path}: key {key!r} is neither tensor nor bytes metadata")
        size = torch.Size(item.get("size"))
        chunks = [(tuple(c.get("offsets")), tuple(c.get("sizes"))) for c in item.get("chunks")]
        for new in (by_key[key].new_keys if key in by_key else [key]):
            sdm[new] = TensorStorageMetadata(
                properties=_properties(item.get("properties"), f"{path}: key {key!r}"), size=size,
                chunks=[ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for o, s in chunks])

    storage: dict[Any, Any] = {}
    for k, v in md.get("storage_data").items():
        if not isinstance(k, MetadataIndexRecord) or not isinstance(v, StorageInfoRecord):
            raise FormatError(f"{path}: storage_data holds something other than MetadataIndex -> _StorageInfo")
        fqn, offset, hint = k.get("fqn"), k.get("offset"), k.get("index")
        transforms = v.get("transform_descriptors") or None
        info = _StorageInfo(v.get("relative_path"), v.get("offset"), v.get("length"),
                            transform_descriptors=list(transforms) if transforms else None)
        if fqn not in by_key:
            storage[MetadataIndex(fqn, offset, hint)] = info
            continue
        offsets = tuple(offset)
        if (fqn, offsets) not in kept_cp:
            continue  # an orphan entry naming no chunk (verify warns about it): nothing to carry over
        for j, new in enumerate(by_key[fqn].new_keys):
            if j == kept_cp[(fqn, offsets)]:
                storage[MetadataIndex(new, offset, hint)] = info
            else:
                start, length = lost_storage[(new, offsets)]
                storage[MetadataIndex(new, offset, hint)] = _StorageInfo(new_file, start, length)

    try:
        planner = _plain(md.get("planner_data"), f"{path}: planner_data", [_PLAIN_NODES_PER_KEY * (len(sdm) + 16)])
    except RecursionError:
        raise FormatError(f"{path}: planner_data is nested too deeply for DCP's key paths; restore the file from a "
                        "good copy") from None
    if isinstance(planner, dict):
        for old, ak in by_key.items():
            if old not in planner:
                continue
            value = planner.pop(old)
            for new in ak.new_keys:
                planner[new] = _rename_path(value, old, new, path)

    old_meta = md.get("storage_meta")
    modules = old_meta.get("modules") if isinstance(old_meta, StorageMetaRecord) else None
    version = md.get("version")
    return Metadata(
        state_dict_metadata=sdm, planner_data=planner, storage_data=storage,
        storage_meta=StorageMeta(checkpoint_id=checkpoint_id, save_id=str(uuid.uuid4()),
                                 modules=list(modules) if isinstance(modules, list) else []),
        version=version if isinstance(version, str) else None)


def _rename_path(value: Any, old: str, new: str, path: Path) -> Any:
    """planner_data maps a flattened key to its path in the state dict; give the new key its own."""
    if value == (old,):
        return (new,)
    if isinstance(value, tuple) and value and ".".join(map(str, value)) == old and isinstance(value[-1], str):
        return (*value[:-1], value[-1] + new[len(old):])
    raise FormatError(f"{path}: planner_data maps {old!r} to {value!r}, which migrate-aliased cannot rename")


# --------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Blob:
    data: bytes
    crc: int
    shift: list[int]
    zeros: tuple[int, int]  # the longest run of zero bytes: the tensor's data


class _ZeroBlobs:
    """``torch.save`` blobs of fp32 zero tensors, one per shape (they are byte-identical), bounded."""

    def __init__(self, crc: Crc, budget: int = 512 << 20) -> None:
        self.crc, self.budget = crc, budget
        self.items: OrderedDict[tuple[int, ...], _Blob] = OrderedDict()

    def get(self, sizes: tuple[int, ...]) -> _Blob:
        import io

        import numpy as np

        blob = self.items.get(sizes)
        if blob is None:
            buf = io.BytesIO()
            torch.save(torch.zeros(sizes, dtype=torch.float32), buf)
            data = buf.getvalue()
            nz = np.flatnonzero(np.frombuffer(data, dtype=np.uint8))
            zeros = (0, 0)
            if len(nz) > 1:
                i = int(np.argmax(np.diff(nz)))
                zeros = (int(nz[i]) + 1, int(nz[i + 1]))
            blob = _Blob(data, self.crc.update(data, 0), self.crc.shift(len(data)), zeros)
            self.items[sizes] = blob
            while sum(len(b.data) for b in self.items.values()) > self.budget and len(self.items) > 1:
                self.items.popitem(last=False)
        self.items.move_to_end(sizes)
        return blob


HOLE_MIN = 64 << 10  # zero runs at least this long are left as holes (sparse file), not written


class _CountingWriter:
    """A write-only stream for ``torch.save`` that tracks the position and the CRC of its bytes."""

    def __init__(self, f: Any, crc: Crc) -> None:
        self.f, self.pos, self.crc, self._update = f, 0, 0, crc.update

    def write(self, b: Any) -> int:
        mv = memoryview(b)
        self.f.write(mv)
        self.crc = self._update(mv, self.crc)
        self.pos += mv.nbytes
        return mv.nbytes

    def write_blob(self, blob: _Blob) -> None:
        """Append a prepared blob: its zero run becomes a hole (reads back as the same zeros)."""
        a, z = blob.zeros
        if z - a >= HOLE_MIN:
            self.f.write(blob.data[:a])
            self.f.seek(z - a, os.SEEK_CUR)
            self.f.write(blob.data[z:])
        else:
            self.f.write(blob.data)
        self.crc = gf2_times(blob.shift, self.crc) ^ blob.crc
        self.pos += len(blob.data)

    def flush(self) -> None:
        self.f.flush()

    def close_out(self) -> None:
        """Make the file exactly ``pos`` bytes long (a trailing hole leaves it short) and durable."""
        self.f.flush()
        if os.fstat(self.f.fileno()).st_size != self.pos:
            self.f.truncate(self.pos)
        os.fsync(self.f.fileno())


def _new_data_file(names: set[str], world: int) -> str:
    k = 0
    while f"__{world}_{k}.distcp" in names:
        k += 1
    return f"__{world}_{k}.distcp"


@dataclass
class Outcome:
    destination: Path
    new_data_file: str | None
    new_bytes: int
    linked: int
    copied: int
    backup: Path | None = None
    notes: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)  # seconds per phase (benchmarks read them)


def _link_or_copy(src: Path, dst: Path) -> bool:
    """Hard-link ``src`` to ``dst``; copy (and fsync) where a link is impossible. True when linked."""
    try:
        os.link(src, dst, follow_symlinks=False)
        return True
    except OSError as e:
        if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EACCES):
            raise
    shutil.copyfile(src, dst, follow_symlinks=False)
    with open(dst, "rb+") as f:
        os.fsync(f.fileno())
    return False


def _checksums(path: Path, algorithms: list[str], streamed: tuple[str, int] | None = None) -> dict[str, str]:
    """The file's digests under ``algorithms``; ``streamed`` is a CRC already computed while writing it."""
    out = {}
    rest = []
    for a in algorithms:
        if streamed is not None and a == streamed[0]:
            out[a] = f"{streamed[1]:08x}"
        elif a in HASHERS:
            rest.append(a)
    if rest:
        with open(path, "rb") as f:
            out.update(file_digests(f, rest))
    return out


def build_migrated(plan: Plan, out: Path, checkpoint_id: Path, progress: Progress) -> Outcome:
    """Write the migrated iteration folder ``out`` (must not exist). Reads SRC, never writes it."""
    assert plan.par is not None and plan.ckpt.manifest is not None
    src = plan.ckpt.root
    names = sorted(os.listdir(src))
    clock = time.perf_counter()
    md = read_source_metadata(src, sum(plan.ckpt.data_files.values()))
    out.mkdir()
    outcome = Outcome(out, None, 0, 0, 0)

    def lap(name: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        outcome.timings[name] = now - clock
        clock = now

    for name in names:
        p = src / name
        if name in (DCP_METADATA_FILE, MANIFEST_FILE):
            continue
        if p.is_symlink() or not p.is_file():
            raise FormatError(f"{p} is not a regular file; migrate-aliased only carries the files of a checkpoint "
                            "folder over; move it out of the folder first")
        if _link_or_copy(p, out / name):
            outcome.linked += 1
        else:
            outcome.copied += 1
        progress(1)
    lap("link")

    new_file = _new_data_file(set(names), plan.par.world_size)
    lost_storage: dict[tuple[str, tuple[int, ...]], tuple[int, int]] = {}
    written = [c for c in plan.lost if c.action in (REBUILD, RESET)]
    crc = None
    stream = CRCS.get(_hash_algorithm(plan.ckpt.manifest), CRCS[HASH_ALGORITHM])  # the new file's CRC, as written
    if written:
        shards, zeros = _ShardCache(plan.ckpt), _ZeroBlobs(stream)
        order = {k: i for i, k in enumerate(md.get("state_dict_metadata"))}
        written.sort(key=lambda c: (order[c.source_key], c.cp_rank, c.offsets))
        with open(out / new_file, "wb") as f:
            w = _CountingWriter(f, stream)
            for c in written:
                start = w.pos
                if c.action == REBUILD:
                    torch.save(rebuild_master(plan, c, shards), w)
                else:
                    w.write_blob(zeros.get(c.sizes))
                lost_storage[(c.new_key, c.offsets)] = (start, w.pos - start)
                progress(1)
            w.close_out()
        crc = (stream.name, w.crc)
        outcome.new_data_file, outcome.new_bytes = new_file, w.pos
    lap("lost_state")

    metadata = build_metadata(plan, md, new_file, lost_storage, checkpoint_id)
    with open(out / DCP_METADATA_FILE, "wb") as f:
        pickle.dump(metadata, f)  # what FileSystemWriter.finish does
        f.flush()
        os.fsync(f.fileno())

    manifest = _migrated_manifest(plan, out, outcome, crc)
    write_manifest(out, manifest)
    outcome.notes = list(manifest.notes[-1:])
    fsync_dir(out)
    lap("metadata")
    return outcome


def _hash_algorithm(manifest: Manifest) -> str:
    """The algorithm the source's manifest checksums its files with (older ones name none: CRC-32)."""
    return manifest.hash_algorithm


def _migrated_manifest(plan: Plan, out: Path, outcome: Outcome,
                       new_crc: tuple[str, int] | None) -> Manifest:
    assert plan.ckpt.manifest is not None
    manifest = plan.ckpt.manifest.to_json()
    files = manifest.setdefault("files", {})
    algorithms = [_hash_algorithm(plan.ckpt.manifest)]
    for name in [DCP_METADATA_FILE] + ([outcome.new_data_file] if outcome.new_data_file else []):
        path = out / name
        crc = new_crc if name == outcome.new_data_file else None
        files[name] = {"size": path.stat().st_size, **_checksums(path, algorithms, crc)}
    c = plan.counts()
    moments = [x for x in plan.lost if x.action == RESET]
    exact = not plan.lossy
    step = plan.ckpt.manifest.optimizer.step if plan.ckpt.manifest.optimizer else "?"
    if exact:
        how = "bit-exact: the weights are fp32"
    else:
        dtypes = sorted({plan.weight_dtypes[n] for n in plan.lossy})
        how = f"LOSSY: rounded, rebuilt from {'/'.join(dtypes)} weights of {len(plan.lossy)} params"
    note = (f"{TOOL} on {_now()} from {plan.source.folder}: {c['aliased_keys']} aliased folded optimizer keys split "
            f"into {c['new_keys']} .cp_rank_{{i}} keys ({c['kept_chunks']} surviving chunks renamed to their writer's "
            f"CP rank); {c['lost_chunks']} CP-peer chunks ({c['lost_elements']} elements) had been lost at save: "
            f"{c['rebuilt_param_chunks']} fp32 master chunks rebuilt from the model weights ({how}), "
            f"{len(moments)} Adam moment chunks (exp_avg, exp_avg_sq) reset to zero, so those elements restart "
            f"their moments at optimizer step {step}; details under 'migration'")
    manifest.setdefault("notes", []).append(note)
    manifest["migration"] = {
        "tool": TOOL,
        "version": MIGRATION_VERSION,
        "time": _now(),
        "source": str(plan.source.folder),
        "topology": plan.par.describe() if plan.par else None,
        "counts": c,
        "param_rebuild": "exact" if exact else "lossy",
        "lossy_weights": {n: plan.weight_dtypes[n] for n in plan.lossy},
        "new_data_file": outcome.new_data_file,
        "renamed_keys": {k.source_key: k.new_keys for k in plan.keys},
        "kept_chunks": [{"key": x.new_key, "offsets": list(x.offsets), "sizes": list(x.sizes), "file": x.file,
                         "rank": x.rank} for x in plan.kept],
        "lost_chunks": [lost_dict(x) for x in plan.lost],
    }
    return parse_manifest(manifest, str(out / MANIFEST_FILE), strict=True)


def lost_dict(x: LostChunk) -> dict[str, Any]:
    return {"key": x.new_key, "source_key": x.source_key, "state": x.state, "cp_rank": x.cp_rank,
            "offsets": list(x.offsets), "sizes": list(x.sizes), "kept_from_rank": x.kept_rank,
            "kept_cp_rank": x.kept_cp_rank, "action": x.action, "params": list(x.params)}


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def self_check(folder: Path) -> None:
    """The migrated folder must pass verify's structural checks and hold no aliased key."""
    from gtp_format.check.verify import verify

    result = verify(open_checkpoint(folder))
    errors = [p for p in result.problems if p.severity == "error"]
    if errors:
        p = errors[0]
        raise FormatError(f"the migrated copy fails verify ({len(errors)} errors, first: {p.key or p.file}: "
                        f"{p.message}); nothing was committed, please report this", EXIT_CHECK_FAILED)


# --------------------------------------------------------------------------------------------
# Committing: temp sibling, fsync, rename (or swap for --in-place)
# --------------------------------------------------------------------------------------------

@contextlib.contextmanager
def _temp_sibling(final: Path) -> Iterator[Path]:
    """A fresh path next to ``final`` (same filesystem, so the last step is a rename); removed on failure."""
    tmp = final.parent / f".tmp.{final.name}.migrate.{uuid.uuid4().hex[:8]}"
    try:
        yield tmp
    finally:
        if os.path.lexists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)  # hard links only: SRC's files keep their own name


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def check_destination(dst: Path, src: Source) -> None:
    """DST must be new, have an existing parent, and lie outside SRC."""
    if os.path.lexists(dst):
        raise FormatError(f"{dst} already exists; migrate-aliased never overwrites: pass a new DST, or --in-place")
    if not dst.parent.is_dir():
        raise FormatError(f"{dst.parent} (the parent of DST) does not exist; create it first")
    inner = Path(os.path.realpath(dst.parent)) / dst.name
    for root in (src.given, src.folder):
        real = Path(os.path.realpath(root))
        if inner == real or real in inner.parents:
            raise FormatError(f"{dst} is inside SRC {root}; SRC is never modified, pick a DST outside it")


def migrate_to(plan: Plan, dst: Path, progress: Progress) -> Outcome:
    """Build the migrated checkpoint in a temporary sibling of ``dst`` and rename it to ``dst``.

    SRC an iteration folder: ``dst`` is the migrated iteration folder. SRC a parent with
    ``latest_checkpointed_iteration.txt``: ``dst`` becomes a parent holding the migrated iteration
    (same folder name) and its own ``latest_checkpointed_iteration.txt``.
    """
    src = plan.source
    check_destination(dst, src)
    nested = src.parent is not None
    final_iter = dst / src.folder.name if nested else dst
    with _temp_sibling(dst) as tmp:
        if nested:
            tmp.mkdir()
        build_dir = tmp / src.folder.name if nested else tmp
        outcome = build_migrated(plan, build_dir, Path(os.path.abspath(final_iter)), progress)
        t = time.perf_counter()
        self_check(build_dir)
        outcome.timings["self_check"] = time.perf_counter() - t
        if nested:
            with open(tmp / LATEST_FILE, "w") as f:
                f.write(f"{src.latest_text}\n")
                f.flush()
                os.fsync(f.fileno())
            fsync_dir(tmp)
        os.rename(tmp, dst)
    fsync_dir(dst.parent)
    outcome.destination = final_iter
    return outcome


def migrate_in_place(plan: Plan, progress: Progress) -> Outcome:
    """Build the migrated iteration next to SRC's, then swap; SRC's old folder is kept as a backup.

    Where the kernel can exchange two paths atomically (Linux ``renameat2``), readers of SRC see
    the old or the new folder, never none; elsewhere there is a moment between two renames.
    """
    folder = plan.source.folder
    stamp = datetime.datetime.now().strftime("%Y%m%dT%H%M%S")
    backup = folder.parent / f"{folder.name}.pre-migrate-{stamp}"
    while os.path.lexists(backup):
        backup = folder.parent / f"{folder.name}.pre-migrate-{stamp}-{uuid.uuid4().hex[:4]}"
    with _temp_sibling(folder) as tmp:
        outcome = build_migrated(plan, tmp, Path(os.path.abspath(folder)), progress)
        t = time.perf_counter()
        self_check(tmp)
        outcome.timings["self_check"] = time.perf_counter() - t
        if _exchange(tmp, folder):
            os.rename(tmp, backup)  # tmp now names the old folder
        else:
            os.rename(folder, backup)
            try:
                os.rename(tmp, folder)
            except OSError:
                os.rename(backup, folder)
                raise
    fsync_dir(folder.parent)
    outcome.destination, outcome.backup = folder, backup
    return outcome


def fail_if_moments_lost(plan: Plan) -> None:
    refused = plan.refused_moments
    if not refused:
        return
    keys = sorted({c.new_key for c in refused})
    raise FormatError(f"{len(refused)} Adam moment chunks (exp_avg/exp_avg_sq) of {len(keys)} keys were lost at save, "
                    f"e.g. {keys[0]} at offset {list(refused[0].offsets)}; they cannot be recovered: rerun with "
                    "--reset-lost-moments to write them as zeros (recorded in the manifest); nothing was written",
                    EXIT_CHECK_FAILED)

