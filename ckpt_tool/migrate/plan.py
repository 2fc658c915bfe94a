"""The migration plan: every rename, every lost chunk and every refusal, before a byte is written.

Everything here works on metadata and the typed manifest (``gtp_format.manifest``), and imports no
torch: ``ckpt migrate-aliased --dry-run`` is this module plus printing, so it starts in a fraction
of a second instead of paying for torch's import (docs/performance.md, "migrate-aliased
--dry-run"). Only the verify structural checks read data, the tiny ``per_bucket_numel`` tensors,
and they decode them without torch too.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gtp_format.check.analysis import OPTIMIZER, classify_all, topology_view
from gtp_format.check.gate import REPAIR, no_manifest_line, open_gated, run_checks
from gtp_format.dtypes import DTYPES
from gtp_format.errors import EXIT_CHECK_FAILED, FormatError
from gtp_format.layout import topology as topo
from gtp_format.layout.config import ParallelConfig
from gtp_format.layout.schema import BucketLayout, BufferLayout, ParamLayout, param_shard_spec
from gtp_format.layout.shard import ShardSpec
from gtp_format.layout.topology import Topology
from gtp_format.manifest import Manifest
from gtp_format.model import TENSOR, Checkpoint
from gtp_format.names import LATEST_FILE, MANIFEST_FILE, STATES, OptimizerKey, distcp_writer_rank
from gtp_format.reader.locate import LAYOUT_TORCH_DIST, locate
from gtp_format.reader.storage import read_small_file
from gtp_format.session import Session
from gtp_format.storage.base import storage_for
from gtp_format.storage.location import ObjectURL
from gtp_format.writer.checkpoint import check_destination

MIGRATION_VERSION = 1
TOOL = "ckpt migrate-aliased"
REBUILD = "rebuilt_from_weights"  # lost fp32 master, rebuilt from the model weights
RESET = "reset_to_zero"  # lost Adam moment, written as zeros (--reset-lost-moments)
LOST = "lost"  # lost Adam moment, not written (the migration is refused)
FP32 = str(DTYPES["float32"])  # "torch.float32", as weight dtypes are recorded


# -- the source -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Source:
    """The checkpoint to migrate: the iteration folder, and its parent when SRC named one."""

    given: Path | ObjectURL
    folder: Path | ObjectURL
    parent: Path | ObjectURL | None  # SRC was a parent holding latest_checkpointed_iteration.txt
    latest_text: str | None

    def refuse_destination(self, dst: Path | ObjectURL) -> None:
        """DST must be new, have an existing parent, and lie outside SRC (by either of its names)."""
        check_destination(dst, (self.given, self.folder), "migrate-aliased", "pass a new DST, or --in-place")


def locate_source(path: Path | ObjectURL, session: Session | None = None) -> Source:
    loc = locate(path, session)
    if loc.layout != LAYOUT_TORCH_DIST:
        raise FormatError(f"{loc.folder} uses the {loc.layout} layout; migrate-aliased rewrites DCP .metadata and "
                        "only applies to torch_dist checkpoints (gtp_runtime never wrote aliased safetensors ones)")
    store = storage_for(path)
    given: Path | ObjectURL = store.location
    if loc.folder == given if store.remote else \
            Path(os.path.abspath(loc.folder)) == Path(os.path.abspath(given)):
        return Source(given, loc.folder, None, None)
    marker = given / LATEST_FILE
    text = read_small_file(marker, 64, "an iteration marker", f"fix {LATEST_FILE}").decode("utf-8", "replace")
    return Source(given, loc.folder, given, text.strip())


# -- the plan ---------------------------------------------------------------------------------------

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
class KeyRename:
    """The rename of one aliased key (:class:`gtp_format.check.analysis.AliasFinding` says why it is
    aliased): its new key per CP rank, and its surviving chunks."""

    source_key: str
    opt: OptimizerKey
    new_keys: list[str]  # index = CP rank
    kept: list[KeptChunk] = field(default_factory=list)


@dataclass
class Plan:
    """What a migration of ``source`` does; ``status`` is ``"aliased"`` when there is anything to do."""

    source: Source
    ckpt: Checkpoint
    par: ParallelConfig | None
    status: str  # "aliased" | "not_aliased"
    message: str
    keys: list[KeyRename] = field(default_factory=list)
    lost: list[LostChunk] = field(default_factory=list)
    buffers: dict[int, BufferLayout] = field(default_factory=dict)
    manifest: Manifest | None = None  # parsed strictly: the migrated manifest is built from it
    weight_dtypes: dict[str, str] = field(default_factory=dict)  # weights read for rebuilt masters
    reset_lost_moments: bool = False

    @property
    def kept(self) -> list[KeptChunk]:
        return [c for k in self.keys for c in k.kept]

    @property
    def lossy(self) -> list[str]:
        """Weights that are not fp32: masters rebuilt from them are rounded."""
        return sorted(n for n, d in self.weight_dtypes.items() if d != FP32)

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


REPAIR_REST = "; migrate-aliased repairs only the aliasing: repair the rest first"


def plan_migration(src: Path | ObjectURL, cp_size: int | None, reset_lost_moments: bool,
                   session: Session | None = None) -> Plan:
    """Work out every rename and every lost chunk from metadata and the manifest.

    Reads no tensor data except the tiny ``per_bucket_numel`` ones that verify's structural checks
    decode; every refusal happens here, before anything is written: exit 2 for unusable input, exit 1
    with verify's own line (:func:`gtp_format.check.gate.run_checks`) for a source that fails
    verify apart from the aliasing it repairs. ``session``: the command's, whose storage reads SRC.
    """
    source = locate_source(src, session)
    # .metadata is read here, and only here; verify runs below, only where keys are aliased
    gated = open_gated(source.folder, aliased=REPAIR, checks=False, keep_raw_metadata=True, session=session)
    ckpt, manifest = gated.ckpt, gated.manifest
    folder = ckpt.root
    classes = classify_all(ckpt)
    cpless = [k for k, c in classes.items() if c.category == OPTIMIZER and c.opt is not None and c.opt.cp_rank is None]
    if manifest is None:
        from gtp_format.megatron.topology import is_megatron_core

        if is_megatron_core(ckpt):  # no false alarm: --cp-size is a CP size there, not a declaration of folding
            raise FormatError(f"{folder} is a megatron-core checkpoint: megatron-core does not fold CP, so its "
                              "optimizer keys cannot be aliased; nothing to migrate")
        raise FormatError(_no_manifest_message(folder, cp_size, cpless, classes))
    view = topology_view(manifest, None)
    par = view.par
    if par is None:
        why = "; ".join(p.message for p in view.notes) or "it has no topology"
        raise FormatError(f"{folder / MANIFEST_FILE}: cannot use its topology ({why}); the writer rank -> CP rank map "
                        "needs it: restore the manifest from the run")
    if cp_size is not None and cp_size != par.cp:
        raise FormatError(f"--cp-size {cp_size} contradicts {folder / MANIFEST_FILE} (cp={par.cp}); drop --cp-size or "
                        "fix the manifest")
    buffers = {b.gbuf_idx: b for b in manifest.buffers or ()}
    plan = Plan(source, ckpt, par, "not_aliased", "", buffers=buffers, manifest=manifest,
                reset_lost_moments=reset_lost_moments)
    if not (par.fold_cp and par.cp > 1):
        plan.message = f"not folded ({par.describe()}): no key can be aliased"
        return plan
    folded = {g for g, b in buffers.items() if b.excludes_cp and not b.is_expert}
    aliased = [k for k in cpless if classes[k].opt.gbuf_idx in folded]  # type: ignore[union-attr]
    if not aliased:
        plan.message = "no folded optimizer key lacks .cp_rank_{i}"
        return plan
    run_checks(ckpt, allow_aliased=True, refusal_suffix=REPAIR_REST)
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
    return no_manifest_line(folder, f"{hint}, but mapping each chunk's writer rank to its CP rank and rebuilding the "
                            "lost CP ranks' fp32 masters need the manifest's topology and bucket layout; restore "
                            f"{MANIFEST_FILE} from the run (migrate-aliased refuses to guess)")


def _plan_key(ckpt: Checkpoint, key: str, opt: OptimizerKey, buffers: dict[int, BufferLayout], grid: Topology,
              present: dict[tuple[Any, ...], str]) -> KeyRename:
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
    ak = KeyRename(key, opt, new_keys)
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


def lost_shard_spec(p: ParamLayout, par: ParallelConfig, n: int, cp_rank: int) -> ShardSpec:
    """Where CP rank ``cp_rank`` of model-parallel rank ``n`` keeps its shard of ``p`` (dense, folded).

    ``n = tp + TP * gtp``; the folded weight group's rank is ``cp_rank + CP * gtp``
    (docs/glossary.md, "folded group").
    """
    return param_shard_spec(p, par, n % par.tp, cp_rank + par.cp * (n // par.tp))


def pieces(bucket: BucketLayout, lo: int, hi: int) -> list[tuple[ParamLayout, int, int]]:
    """The params of ``bucket`` that overlap ``[lo, hi)``, each with its overlap."""
    return [(p, max(lo, p.start), min(hi, p.end)) for p in bucket.params if max(lo, p.start) < min(hi, p.end)]


def _lost_chunk(plan: Plan, ak: KeyRename, kept: KeptChunk, j: int, grid: Topology) -> LostChunk:
    opt = ak.opt
    if opt.state != "param":
        action = RESET if plan.reset_lost_moments else LOST
        return LostChunk(ak.source_key, ak.new_keys[j], opt.state, j, kept.offsets, kept.sizes, kept.rank,
                         kept.cp_rank, action)
    bucket = plan.buffers[opt.gbuf_idx].bucket(opt.bucket_idx)
    assert bucket is not None  # _plan_key checked it
    lo = kept.offsets[0]
    names = []
    for p, _a, _b in pieces(bucket, lo, lo + kept.sizes[0]):
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
    spec = lost_shard_spec(p, par, opt.dp_group_idx, j)
    entry = plan.ckpt.entries.get(p.name)
    if entry is None or entry.kind != TENSOR:
        raise FormatError(f"{where}: the model weight {p.name!r} is not in {plan.ckpt.root}; the lost fp32 master "
                        "cannot be rebuilt")
    if spec.local_shape != p.local_shape or spec.global_shape != p.global_shape or entry.shape != p.global_shape:
        raise FormatError(f"{where}: weight {p.name} has global shape {list(entry.shape or ())}, {MANIFEST_FILE} "
                        f"says {list(p.global_shape)} (local {list(p.local_shape)}), the shard math gives "
                        f"{list(spec.global_shape)} (local {list(spec.local_shape)}); the manifest does not match")
    plan.weight_dtypes[p.name] = str(entry.dtype)


def lost_dict(x: LostChunk) -> dict[str, Any]:
    """A lost chunk as the report and the manifest's ``migration`` record list it."""
    return {"key": x.new_key, "source_key": x.source_key, "state": x.state, "cp_rank": x.cp_rank,
            "offsets": list(x.offsets), "sizes": list(x.sizes), "kept_from_rank": x.kept_rank,
            "kept_cp_rank": x.kept_cp_rank, "action": x.action, "params": list(x.params)}


def fail_if_moments_lost(plan: Plan) -> None:
    refused = plan.refused_moments
    if not refused:
        return
    keys = sorted({c.new_key for c in refused})
    raise FormatError(f"{len(refused)} Adam moment chunks (exp_avg/exp_avg_sq) of {len(keys)} keys were lost at save, "
                    f"e.g. {keys[0]} at offset {list(refused[0].offsets)}; they cannot be recovered: rerun with "
                    "--reset-lost-moments to write them as zeros (recorded in the manifest); nothing was written",
                    EXIT_CHECK_FAILED)

