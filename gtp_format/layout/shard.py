"""Where one rank's piece of a GTP-sharded weight sits: pure arithmetic, shared by every reader.

A GTP-managed weight is first split by TP (dim 0 for column-parallel, dim 1 for row-parallel),
then the TP-local weight is sharded along dim 0 over its *weight group* (``gtp_remat``, or
``cp x gtp_remat`` with ``fold_cp``, or the expert GTP group). dim 0 is padded at the tail to a
multiple of ``align * group_size`` so every shard has the same row count. The runtime places its
parameters with this, and ``ckpt`` uses the same numbers to find a rank's rows in a checkpoint
without torch (``migrate-aliased`` rebuilding lost CP shards, ``reshard``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class ShardSpec:
    """Where one rank's tensor sits inside the full (padded) tensor of its parameter.

    ``tp_mode``: ``"column"`` splits dim 0 over TP, ``"row"`` splits dim 1, ``"vocab"`` splits
    dim 0 without GTP (embedding), ``None`` means TP-replicated. ``shard_kind``: the group kind
    that shards dim 0 of the TP-local tensor, or ``None``.
    """

    full_shape: tuple[int, ...]
    tp_mode: str | None
    tp_size: int
    tp_rank: int
    shard_kind: str | None
    shard_size: int
    shard_rank: int
    align: int

    @property
    def tp_local_shape(self) -> tuple[int, ...]:
        s = list(self.full_shape)
        if self.tp_mode in ("column", "vocab"):
            s[0] //= self.tp_size
        elif self.tp_mode == "row":
            s[1] //= self.tp_size
        return tuple(s)

    @property
    def padded_rows(self) -> int:
        rows = self.tp_local_shape[0]
        if self.shard_kind is None:
            return rows
        m = self.align * self.shard_size
        return math.ceil(rows / m) * m

    @property
    def shard_rows(self) -> int:
        return self.padded_rows // (self.shard_size if self.shard_kind else 1)

    @property
    def local_shape(self) -> tuple[int, ...]:
        return (self.shard_rows, *self.tp_local_shape[1:])

    @property
    def valid_rows(self) -> int:
        """Rows of this shard that hold real weight (the rest is tail padding)."""
        start = self.shard_rank * self.shard_rows if self.shard_kind else 0
        return max(0, min(self.shard_rows, self.tp_local_shape[0] - start))

    @property
    def global_shape(self) -> tuple[int, ...]:
        """Shape of the checkpointed tensor: the full weight with each TP part padded."""
        s = list(self.tp_local_shape)
        s[0] = self.padded_rows
        if self.tp_mode in ("column", "vocab"):
            s[0] *= self.tp_size
        elif self.tp_mode == "row":
            s[1] *= self.tp_size
        return tuple(s)

    @property
    def global_offset(self) -> tuple[int, ...]:
        off = [0] * len(self.full_shape)
        off[0] = self.shard_rank * self.shard_rows if self.shard_kind else 0
        if self.tp_mode in ("column", "vocab"):
            off[0] += self.tp_rank * self.padded_rows
        elif self.tp_mode == "row":
            off[1] = self.tp_rank * self.tp_local_shape[1]
        return tuple(off)

    def shard_start(self) -> int:
        """First row of this shard inside the padded TP-local weight."""
        return self.shard_rank * self.shard_rows if self.shard_kind else 0

    def with_rank(self, tp_rank: int, shard_rank: int) -> ShardSpec:
        """The same parameter's spec on another (TP rank, weight-group rank)."""
        return ShardSpec(self.full_shape, self.tp_mode, self.tp_size, tp_rank, self.shard_kind, self.shard_size,
                         shard_rank, self.align)
