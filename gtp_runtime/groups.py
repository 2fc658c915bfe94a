"""Process groups for one rank, built with ``torch.distributed.new_group`` from the rank generator.

``new_group`` is collective over the whole world: every rank must create every group, in the same
order, even the groups it is not a member of. :func:`build_groups` walks :mod:`topology` in a
fixed order and keeps the handles of the groups this rank belongs to.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist

from gtp_format.layout import topology as topo
from gtp_format.layout.config import ParallelConfig


@dataclass
class Group:
    """One group this rank belongs to: the handle, the members, and this rank's index in it."""

    kind: str
    ranks: list[int]
    handle: dist.ProcessGroup | None
    rank: int

    @property
    def size(self) -> int:
        return len(self.ranks)


@dataclass
class Groups:
    """All groups of one rank, plus its coordinates."""

    par: ParallelConfig
    rank: int
    topology: topo.Topology
    by_kind: dict[str, Group] = field(default_factory=dict)

    def __getitem__(self, kind: str) -> Group:
        return self.by_kind[kind]

    @property
    def coords(self) -> topo.RankCoords:
        return self.topology.coords(self.rank)


def build_groups(par: ParallelConfig, rank: int | None = None) -> Groups:
    """Create every group kind of :mod:`gtp_format.layout.topology` on an initialised default process group."""
    rank = dist.get_rank() if rank is None else rank
    t = topo.Topology(par)
    out = Groups(par=par, rank=rank, topology=t)
    for kind in (*topo.ALL_GROUP_KINDS, topo.WORLD):
        for members in t.groups(kind):
            # Size-1 groups need no communicator; skipping them keeps start-up cheap on 8 ranks.
            handle = dist.new_group(members) if len(members) > 1 and kind != topo.WORLD else None
            if rank in members:
                if kind == topo.WORLD:
                    handle = dist.group.WORLD
                out.by_kind[kind] = Group(kind, members, handle, members.index(rank))
    out.by_kind[topo.WEIGHT] = out.by_kind[topo.FOLDED if par.fold_cp else topo.GTP]
    return out


def offline_groups(par: ParallelConfig, rank: int) -> Groups:
    """The groups of ``rank`` without communicators, for layout questions asked offline.

    Building a model and its buffers needs only group sizes and ranks; the ``ckpt`` CLI and the
    writer-election tests use this to lay out any rank of any topology in one process.
    """
    t = topo.Topology(par)
    out = Groups(par=par, rank=rank, topology=t)
    for kind in (*topo.ALL_GROUP_KINDS, topo.WORLD):
        members = t.group_of(kind, rank)
        out.by_kind[kind] = Group(kind, members, None, members.index(rank))
    out.by_kind[topo.WEIGHT] = out.by_kind[topo.FOLDED if par.fold_cp else topo.GTP]
    return out
