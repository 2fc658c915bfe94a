"""The per-parameter view of a ``dp_reshardable`` checkpoint: where every piece of every parameter is.

A ``dp_reshardable`` optimizer key holds one bucket of one gradient buffer as seen by one
model-parallel rank (``dp_group_idx``), and for folded buffers one CP rank (``.cp_rank_{i}``): a
flat fp32 vector in which each parameter of the bucket is a contiguous slice, the rank's shard of
it, row-major, followed by tail padding rows. This module turns the manifest's bucket layout into,
for each parameter, the list of :class:`Holder` s: which key, which flat range, and which box of
the parameter's full (unsharded, unpadded) tensor those elements are. Assembling the full fp32
master weight or Adam moment of a parameter is then a copy of each primary holder's valid rows
into its box; writing a checkpoint for another topology is the same map read the other way.

Pure arithmetic, no torch, no data file opened: ``ckpt inspect --params`` prints it, and
``ckpt reshard``/``export`` (:mod:`ckpt_tool.reshard`) stream data through it. The rank order and
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
from gtp_format.layout.shard import ShardSpec
from gtp_format.manifest import BucketLayout, BufferLayout, Manifest, ParamLayout
from gtp_format.model import Checkpoint
from gtp_format.names import OPT_PREFIX, optimizer_key, per_bucket_numel_key


@dataclass(frozen=True)
class KeyRef:
    """One bucket of one buffer as one model-parallel rank (and CP rank, if folded) keeps it."""

    dp_group_idx: int
    gbuf_idx: int
    dtype: str
    bucket_idx: int
    cp_rank: int | None
    numel_unpadded: int  # the key's global shape is (numel_unpadded,)
    prefix: str = OPT_PREFIX  # megatron-core's chained optimizers (MoE): ``chained_{i}.optimizer.distributed``

    def key(self, state: str) -> str:
        key = optimizer_key(self.dp_group_idx, self.gbuf_idx, self.dtype, self.bucket_idx, state, self.cp_rank)
        return key if self.prefix == OPT_PREFIX else self.prefix + key[len(OPT_PREFIX):]


@dataclass(frozen=True)
class Holder:
    """One shard of one parameter inside one optimizer key."""

    ref: KeyRef
    start: int  # bucket-relative first element of the param's slice
    spec: ShardSpec  # the shard's place (tp rank, weight-group rank, padding)
    ranks: tuple[int, ...]  # global ranks whose optimizer owns part of this slice
    primary: bool  # the copy the view reads; replicas hold identical bits

    @property
    def valid_numel(self) -> int:
        return self.spec.valid_rows * _prod(self.spec.local_shape[1:])

    @property
    def numel(self) -> int:
        return _prod(self.spec.local_shape)

    @property
    def full_offsets(self) -> tuple[int, ...]:
        """Where the shard's valid rows start in the full (unsharded, unpadded) parameter."""
        return full_box(self.spec)[0]


@dataclass(frozen=True)
class ParamView:
    name: str
    full_shape: tuple[int, ...]
    global_shape: tuple[int, ...]  # of the model-weight key: each TP part padded for GTP
    tp_mode: str | None
    shard_kind: str | None
    is_expert: bool
    gbuf_idx: int
    bucket_idx: int
    start: int  # bucket-relative (the same for every holder)
    param_dtype: str
    holders: tuple[Holder, ...]
    weight_key: str | None = None  # the model-weight key when it is not ``name`` (megatron-core: stacked layers)
    layer: int | None = None  # index along the stacked key's leading layer axis
    expert: int | None = None  # megatron-core MoE: index along the expert axis after the layer axis

    @property
    def model_key(self) -> str:
        return self.weight_key or self.name

    @property
    def lead(self) -> tuple[int, ...]:
        """The stacked key's leading indices of this parameter: (), (layer,) or (layer, expert)."""
        if self.layer is None:
            return ()
        return (self.layer,) if self.expert is None else (self.layer, self.expert)

    @property
    def primaries(self) -> tuple[Holder, ...]:
        return tuple(h for h in self.holders if h.primary)

    @property
    def numel(self) -> int:
        return _prod(self.full_shape)


def _prod(dims: tuple[int, ...]) -> int:
    out = 1
    for d in dims:
        out *= d
    return out


def full_box(spec: ShardSpec) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(offsets, sizes) of a shard's valid rows inside the full parameter."""
    tl = spec.tp_local_shape
    off = [0] * len(spec.full_shape)
    off[0] = spec.shard_start()
    if spec.tp_mode in ("column", "vocab"):
        off[0] += spec.tp_rank * tl[0]
    elif spec.tp_mode == "row":
        off[1] = spec.tp_rank * tl[1]
    return tuple(off), (spec.valid_rows, *tl[1:])


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
def _dp_members(par: ParallelConfig, kind: str, anchor: int) -> tuple[int, ...]:
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
                    members = _dp_members(par, buf.dp_group_kind, inst.anchor)
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


def describe(views: dict[str, ParamView]) -> list[dict[str, object]]:
    """Rows for ``ckpt inspect --params``: each parameter's bucket, offset, keys, ranks and CP ranks."""
    rows: list[dict[str, object]] = []
    for v in views.values():
        rows.append({
            "name": v.name, "key": v.model_key, "layer": v.layer, "full_shape": list(v.full_shape),
            "dtype": v.param_dtype, "expert": v.is_expert,
            "gbuf_idx": v.gbuf_idx, "bucket_idx": v.bucket_idx, "offset": v.start,
            "ranks": sorted({r for h in v.holders for r in h.ranks}),
            "cp_ranks": sorted({h.ref.cp_rank for h in v.holders if h.ref.cp_rank is not None}),
            "holders": [{"dp_group_idx": h.ref.dp_group_idx, "cp_rank": h.ref.cp_rank, "tp_rank": h.spec.tp_rank,
                         "shard_rank": h.spec.shard_rank, "valid_numel": h.valid_numel, "numel": h.numel,
                         "full_offsets": list(h.full_offsets), "ranks": list(h.ranks), "primary": h.primary}
                        for h in v.holders],
        })
    return rows


def param_views_of(ckpt: Checkpoint) -> dict[str, ParamView]:
    """The per-parameter view of an opened checkpoint: from its manifest (ours) or, without one,
    from megatron-core's bucketing rules (:mod:`gtp_format.megatron`)."""
    if ckpt.manifest is not None:
        return param_views(ckpt.manifest)
    from gtp_format.megatron import megatron_views

    return megatron_views(ckpt, experts=True)
