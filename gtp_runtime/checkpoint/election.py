"""Writer election (Megatron's ``replica_id == 0``): exactly one writer per model-weight chunk.

Every chunk of every key must be written by exactly one rank across the world. The replicas of a
chunk are the ranks that hold the identical tensor, so the writer is rank 0 of that replica set:

* folded dense shard: distinct over tp x (cp x gtp_remat); replicas are the CP-free ``dp`` group.
  Electing over ``dp_cp`` instead would leave shards held only by ``cp_rank != 0`` unwritten.
* unfolded dense shard: distinct over tp x gtp_remat; replicas are ``dp_cp``.
* expert shard: distinct over tp x expert_gtp_remat; replicas are ``expert_dp``.
* replicated tensor (norms, embedding rows, router): replicas are cp x gtp_remat x dp, and
  every TP rank too when the tensor is not split by TP.

Optimizer chunks need no election: every rank owns a distinct slice of its buckets, and keys
separate what slices cannot (dp_group_idx, and ``.cp_rank_{i}`` for folded buffers).
"""

from __future__ import annotations

import torch.nn as nn

from gtp_format.layout import topology as topo
from gtp_format.layout.config import ParallelConfig


def replica_kind(p: nn.Parameter, par: ParallelConfig) -> str:
    """The group kind whose members hold identical copies of ``p``'s local tensor."""
    if p.spec.shard_kind == topo.EXPERT_GTP:
        return topo.EXPERT_DP
    if p.spec.shard_kind == topo.WEIGHT:
        return topo.DP if par.fold_cp else topo.DP_CP
    return topo.REPLICATED


def is_writer(p: nn.Parameter, rank: int, t: topo.Topology) -> bool:
    """Whether ``rank`` writes ``p``'s local chunk of the model weights."""
    members = t.group_of(replica_kind(p, t.par), rank)
    if members[0] != rank:
        return False
    return p.spec.tp_mode is not None or t.coords(rank).tp == 0
