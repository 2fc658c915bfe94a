"""Writer election (Megatron's ``replica_id == 0``) and ``dp_group_idx``: who writes what, by arithmetic.

Every chunk of every key must be written by exactly one rank across the world. The replicas of a
model-weight chunk are the ranks that hold the identical tensor, so the writer is rank 0 of that
replica set:

* folded dense shard: distinct over tp x (cp x gtp_remat); replicas are the CP-free ``dp`` group.
  Electing over ``dp_cp`` instead would leave shards held only by ``cp_rank != 0`` unwritten.
* unfolded dense shard: distinct over tp x gtp_remat; replicas are ``dp_cp``.
* expert shard: distinct over tp x expert_gtp_remat; replicas are ``expert_dp``.
* replicated tensor (norms, embedding rows, router): replicas are cp x gtp_remat x dp, and
  every TP rank too when the tensor is not split by TP.

Optimizer chunks need no election: every rank owns a distinct slice of its buckets, and keys
separate what slices cannot (``dp_group_idx``, and ``.cp_rank_{i}`` for folded buffers). Both
the runtime (saving) and ``ckpt`` (checking and rewriting offline) decide with these functions, so
they cannot disagree. ``tests/runtime/test_election.py`` proves no gap and no duplicate.
"""

from __future__ import annotations

from gtp_format.layout import topology as topo
from gtp_format.layout.config import ParallelConfig
from gtp_format.layout.shard import ShardSpec


def replica_kind(spec: ShardSpec, par: ParallelConfig) -> str:
    """The group kind whose members hold identical copies of a tensor placed by ``spec``."""
    if spec.shard_kind == topo.EXPERT_GTP:
        return topo.EXPERT_DP
    if spec.shard_kind == topo.WEIGHT:
        return topo.DP if par.fold_cp else topo.DP_CP
    return topo.REPLICATED


def is_writer(spec: ShardSpec, rank: int, t: topo.Topology) -> bool:
    """Whether ``rank`` writes its local chunk of the model weight placed by ``spec``."""
    members = t.group_of(replica_kind(spec, t.par), rank)
    if members[0] != rank:
        return False
    return spec.tp_mode is not None or t.coords(rank).tp == 0


def dp_group_idx(t: topo.Topology, rank: int, is_expert: bool) -> int:
    """``N`` of an optimizer key: the rank in the model-parallel group that owns the buffer's layout.

    Dense buffers: the rank in tp x gtp_remat, with no CP coordinate; that is why CP peers of a
    folded buffer collided before ``.cp_rank_{i}``. Expert buffers shard over the expert GTP group
    instead, so (our choice, Megatron has no expert GTP) their N is ``tp*gtp_remat`` plus the rank
    in tp x expert_gtp_remat: the dense N would alias expert shards of different expert-GTP ranks,
    and the offset keeps dense and expert ``per_bucket_numel`` keys apart.
    """
    par, c = t.par, t.coords(rank)
    if is_expert:
        return par.tp * par.gtp_remat + c.tp + par.tp * c.expert_gtp
    return t.model_parallel_rank(rank)
