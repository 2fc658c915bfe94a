"""The per-parameter view of our ``dp_reshardable`` checkpoints, from the manifest's bucket layout.

A ``dp_reshardable`` optimizer key holds one bucket of one gradient buffer as seen by one
model-parallel rank (``dp_group_idx``), and for folded buffers one CP rank (``.cp_rank_{i}``): a
flat fp32 vector in which each parameter of the bucket is a contiguous slice, the rank's shard of
it, row-major, followed by tail padding rows. This module turns the manifest's bucket layout into,
for each parameter, the list of holders (:mod:`gtp_format.views.records`): which key, which flat
range, and which box of the parameter's full (unsharded, unpadded) tensor those elements are. Assembling the full fp32
master weight or Adam moment of a parameter is then a copy of each primary holder's valid rows
into its box; writing a checkpoint for another topology is the same map read the other way.

Pure arithmetic, no torch, no data file opened: ``ckpt inspect --params`` prints it, and
``ckpt reshard``/``export`` (:mod:`ckpt_tool.copying`) stream data through it. The rank order and
shard rules come from :mod:`gtp_format.layout` (the runtime uses the same functions).

Replicas: a parameter that TP does not split, or that no weight group shards (norms, embedding
rows per TP rank, the router), sits in the bucket of several keys, with bit-identical values
(their gradients are all-reduced before the step). The first such copy in key order is the
*primary*; the view reads it, and a reshard writes every copy of the target topology.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache

from gtp_format.errors import FormatError
from gtp_format.layout import topology as topo
from gtp_format.layout.config import ParallelConfig
from gtp_format.layout.schema import BucketLayout, BufferLayout, ParamLayout
from gtp_format.layout.shard import ShardSpec
from gtp_format.manifest import Manifest
from gtp_format.names import per_bucket_numel_key
from gtp_format.views.records import Holder, KeyRef, ParamView


@dataclass(frozen=True)
class _Instance:
    """A (tp, lane[, cp]) position that keeps its own copy of a buffer's buckets."""

    dp_group_idx: int
    cp_rank: int | None
    tp: int
    shard_rank_weight: int  # rank in the dense weight group (folded or not)
    expert_gtp: int
    anchor: int  # a global rank at this position with dp == 0 (expert: expert_dp == 0)


def instances(buf: BufferLayout, par: ParallelConfig) -> Iterator[_Instance]:
    """Every key position of a buffer, in ``dp_group_idx`` then CP order."""
    grid = topo.Topology(par)
    if buf.is_expert:
        for eg in range(par.expert_gtp_remat):
            for t in range(par.tp):
                yield _Instance(par.tp * par.gtp_remat + t + par.tp * eg, None, t, 0, eg, grid.expert_rank_of(t, eg, 0))
        return
    for g in range(par.gtp_remat):
        for t in range(par.tp):
            for c in range(par.cp) if buf.excludes_cp else (None,):
                shard = (c or 0) + par.cp * g if buf.excludes_cp else g
                yield _Instance(t + par.tp * g, c, t, shard, 0, grid.rank_of(t, c or 0, g, 0))


@cache
def dp_members(par: ParallelConfig, kind: str, anchor: int) -> tuple[int, ...]:
    return tuple(topo.Topology(par).group_of(kind, anchor))


def _holder_spec(p: ParamLayout, par: ParallelConfig, inst: _Instance) -> ShardSpec:
    shard = {topo.WEIGHT: inst.shard_rank_weight, topo.EXPERT_GTP: inst.expert_gtp}.get(p.shard_kind or "", 0)
    spec = ShardSpec(p.full_shape, p.tp_mode, par.tp, inst.tp if p.tp_mode else 0, p.shard_kind, p.shard_size,
                     shard, p.align)
    if spec.local_shape != p.local_shape or spec.global_shape != p.global_shape:
        raise FormatError(f"manifest: param {p.name} has local shape {list(p.local_shape)} / global shape "
                          f"{list(p.global_shape)}, but topology {par.describe()} gives {list(spec.local_shape)} / "
                          f"{list(spec.global_shape)}; the manifest does not describe this checkpoint")
    return spec


def _owners(buf: BufferLayout, b: BucketLayout, p: ParamLayout, members: tuple[int, ...]) -> tuple[int, ...]:
    """Members of the buffer's DP group whose owned slice of bucket ``b`` overlaps ``p``."""
    n = b.numel // max(1, len(members))
    if n == 0:
        return members[:1]
    return tuple(m for i, m in enumerate(members) if i * n < p.end and p.start < (i + 1) * n)


def param_views(manifest: Manifest) -> dict[str, ParamView]:
    """Every parameter of a checkpoint of our runtime, from its manifest (model-weight key = name)."""
    par, buffers = manifest.topology, manifest.buffers
    if par is None or buffers is None:
        why = f" ({manifest.problems[0]})" if manifest.problems else ""  # a section dropped as ill-formed
        raise FormatError(f"manifest has no usable topology or bucket layout{why}: the per-parameter view needs "
                          "both; restore gtp_manifest.json from the run that wrote the checkpoint")
    out: dict[str, ParamView] = {}
    for buf in buffers:
        insts = list(instances(buf, par))
        for b in buf.buckets:
            for p in b.params:
                seen: set[tuple[int, int]] = set()
                holders = []
                for inst in insts:
                    spec = _holder_spec(p, par, inst)
                    members = dp_members(par, buf.dp_group_kind, inst.anchor)
                    ref = KeyRef(inst.dp_group_idx, buf.gbuf_idx, buf.dtype, b.bucket_idx, inst.cp_rank,
                                 b.numel_unpadded)
                    coord = (spec.tp_rank, spec.shard_rank)
                    holders.append(Holder(ref, p.start, spec, _owners(buf, b, p, members), coord not in seen))
                    seen.add(coord)
                if p.name in out:
                    raise FormatError(f"manifest: param {p.name} appears in two buckets; the layout is ambiguous")
                out[p.name] = ParamView(p.name, p.full_shape, p.global_shape, p.tp_mode, p.shard_kind,
                                        buf.is_expert, buf.gbuf_idx, b.bucket_idx, p.start, buf.param_dtype,
                                        tuple(holders))
    return out


def bucket_refs(manifest: Manifest) -> list[KeyRef]:
    """Every optimizer bucket key (without state) the manifest's layout implies."""
    par = manifest.topology
    assert par is not None and manifest.buffers is not None
    return [KeyRef(inst.dp_group_idx, buf.gbuf_idx, buf.dtype, b.bucket_idx, inst.cp_rank, b.numel_unpadded)
            for buf in manifest.buffers for inst in instances(buf, par) for b in buf.buckets]


def bucket_numels(manifest: Manifest) -> dict[str, list[int]]:
    """``per_bucket_numel[_unpadded]`` key -> values over (gbuf, bucket), as the runtime writes them."""
    par = manifest.topology
    assert par is not None and manifest.buffers is not None
    out: dict[str, list[int]] = {}
    for buf in manifest.buffers:
        ns = sorted({inst.dp_group_idx for inst in instances(buf, par)})
        for n in ns:
            for unpadded in (False, True):
                out.setdefault(per_bucket_numel_key(n, unpadded), []).extend(
                    b.numel_unpadded if unpadded else b.numel for b in buf.buckets)
    return out
