"""The records of the per-parameter view: which key, which flat range, which box of the full parameter.

Both ways of building the view produce these records: from our manifest's bucket layout
(:mod:`gtp_format.views.ours`) and from megatron-core's bucketing rules
(:mod:`gtp_format.megatron.view`, :mod:`gtp_format.megatron.moe`). Why a module of their
own: the megatron view returned the records of the other, and the other dispatched to the
megatron view, so each imported the other inside a function to dodge the circle.
"""

from __future__ import annotations

from dataclasses import dataclass

from gtp_format.layout.shard import ShardSpec
from gtp_format.names import OPT_PREFIX, optimizer_key


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
