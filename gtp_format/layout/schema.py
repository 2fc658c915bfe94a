"""A buffer's bucket layout as the manifest records it: which parameter sits where in which bucket.

Why in ``layout/`` and not beside the manifest parser: these records are layout, and the layout
code (:mod:`gtp_format.layout.params` builds them for any topology, :func:`param_shard_spec` places
any rank's slice) must not import the manifest that merely stores them; when they lived in
``gtp_format/manifest.py``, layout imported the manifest and the manifest imported layout.
:mod:`gtp_format.manifest` types them from JSON and writes them back.
"""

from __future__ import annotations

from dataclasses import dataclass

from gtp_format.layout.config import ParallelConfig
from gtp_format.layout.shard import ShardSpec


@dataclass(frozen=True)
class ParamLayout:
    """One parameter's slice of a bucket (offsets relative to the bucket's start)."""

    name: str
    start: int
    end: int
    valid_numel: int  # elements of real weight; the rest of [start, end) is GTP tail padding
    local_shape: tuple[int, ...]
    full_shape: tuple[int, ...]
    global_shape: tuple[int, ...]
    tp_mode: str | None
    shard_kind: str | None
    shard_size: int
    align: int


def param_shard_spec(param: ParamLayout, par: ParallelConfig, tp_rank: int, shard_rank: int) -> ShardSpec:
    """Where rank ``(tp_rank, shard_rank)`` keeps its piece of ``param``, from the manifest's layout alone.

    The manifest records one example rank's slice of each parameter; the shard rules place every
    other rank's (``migrate-aliased`` rebuilding a lost CP peer, ``reshard``). ``shard_rank`` is
    the rank in the parameter's weight group (``shard_size`` ranks; 0 when it is not sharded).
    """
    if not 0 <= tp_rank < par.tp:
        raise ValueError(f"tp_rank {tp_rank} is outside the {par.tp} TP ranks of {par.describe()}")
    size = param.shard_size if param.shard_kind else 1
    if not 0 <= shard_rank < size:
        raise ValueError(f"shard_rank {shard_rank} is outside the {size} ranks that shard {param.name}")
    return ShardSpec(full_shape=param.full_shape, tp_mode=param.tp_mode, tp_size=par.tp, tp_rank=tp_rank,
                     shard_kind=param.shard_kind, shard_size=param.shard_size, shard_rank=shard_rank,
                     align=param.align)


@dataclass(frozen=True)
class BucketLayout:
    bucket_idx: int
    numel: int
    numel_unpadded: int
    params: tuple[ParamLayout, ...]


@dataclass(frozen=True)
class BufferLayout:
    """One gradient buffer (gbuf): its dtypes, fold, DP group and buckets."""

    gbuf_idx: int
    dtype: str  # the key's dtype tag, repr((param_dtype, grad_dtype))
    param_dtype: str
    grad_dtype: str
    is_expert: bool
    excludes_cp: bool  # folded: keys carry .cp_rank_{i}
    dp_group_kind: str
    dp_size: int
    grad_divisor: int
    example_dp_group_idx: int
    buckets: tuple[BucketLayout, ...]

    def bucket(self, bucket_idx: int) -> BucketLayout | None:
        return next((b for b in self.buckets if b.bucket_idx == bucket_idx), None)



def derive_bucket_size(buffers: tuple[BufferLayout, ...], default: int) -> int:
    """A ``bucket_size`` that rebuilds ``buffers``' bucket layout, for manifests that lack one.

    The runtime's buffers close a bucket after the first param whose end reaches ``bucket_size``
    elements from the bucket start. So every param end before the last one of a bucket lies below
    it, and the last end of every bucket but a buffer's final one lies at or above it: any value in
    that interval lays the buffers out identically. ``ValueError`` when no value fits.
    """
    below, at_or_above = 0, None  # bucket_size > below, bucket_size <= at_or_above
    for buf in buffers:
        for i, b in enumerate(buf.buckets):
            ends = [p.end for p in b.params]
            if not ends:
                continue
            below = max([below, *ends[:-1]])
            if i < len(buf.buckets) - 1:
                at_or_above = ends[-1] if at_or_above is None else min(at_or_above, ends[-1])
    if at_or_above is None:
        return max(default, below + 1)
    if at_or_above <= below:
        raise ValueError(f"manifest bucket layout fits no bucket size (needs > {below} and <= {at_or_above})")
    return at_or_above
