"""Per-rank :class:`~gtp_runtime.groups.Groups` without a process group.

``build_groups`` only needs ``dist.new_group`` for communicator handles; layouts, shard specs and
buffers read the member lists and ranks alone. Patching ``new_group`` to return ``None`` runs the
real ``build_groups`` for any rank of any topology inside one test process.
"""

from __future__ import annotations

from unittest import mock

import torch.distributed as dist

from gtp_format.layout.config import ParallelConfig
from gtp_runtime.groups import Groups, build_groups


def fake_groups(par: ParallelConfig, rank: int) -> Groups:
    with mock.patch.object(dist, "new_group", lambda ranks: None):
        return build_groups(par, rank)
