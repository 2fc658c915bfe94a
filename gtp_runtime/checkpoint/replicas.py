"""Replica cross-check at save: state that several ranks hold must be bit-identical before it is written.

Why: a save writes one copy of each replicated chunk (the elected writer's, or the one DCP keeps
of duplicates). Parameters that TP does not split and no weight group shards (norms, the router)
sit on every rank of their weight group and DP group, and GTP shards on every DP peer; their
gradients are all-reduced, so the copies are equal unless something broke (silent data
corruption on one device, a missed all-reduce). Which copy reaches disk is then luck, and the
damage surfaces in a loss curve weeks later. Comparing the copies' hashes before the write turns
that into a failed save naming the parameter and the ranks.

How: a chunk is identified by (key, global offsets). The set of chunks each rank holds depends
only on the topology and the model, so it is gathered once per trainer and cached; each save
then hashes only the chunks some other rank holds too (xxh3-128 of the bytes on CPU; on CUDA a
fingerprint computed on the device, so nothing is copied to the host for it) and exchanges
those digests with one ``all_gather_object``: a few bytes per replicated chunk.

``GTP_FAULT_REPLICA=<rank>`` (tests only) flips one bit of that rank's first replicated chunk
before the check, standing in for a corrupted replica.
"""

from __future__ import annotations

import os
import weakref
from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist

from gtp_format.integrity.hash import chunk_digest
from gtp_runtime.checkpoint.dcp_chunks import Chunks
from gtp_runtime.checkpoint.errors import CheckpointError

ChunkId = tuple[str, tuple[int, ...]]
FAULT_ENV = "GTP_FAULT_REPLICA"
_SHARED: weakref.WeakKeyDictionary[Any, tuple[tuple[ChunkId, ...], frozenset[ChunkId]]] = \
    weakref.WeakKeyDictionary()  # trainer -> (this rank's chunk ids, the ones other ranks hold too)


def fingerprint(t: torch.Tensor) -> str:
    """A bit-exact digest of one tensor's stored bits: xxh3-128 on CPU, a device-side sum on CUDA.

    The CUDA fingerprint is a position-weighted sum of the 32-bit words, mod 2**63 (any single
    flipped bit changes it), computed where the tensor is so that only 8 bytes cross to the host.
    """
    c = t.detach().contiguous().reshape(-1)
    if not c.is_cuda:
        return chunk_digest(c.view(torch.uint8).numpy()) if c.numel() else chunk_digest(b"")
    raw = c.view(torch.uint8)
    pad = (-raw.numel()) % 4
    words = torch.cat([raw, raw.new_zeros(pad)]).view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    weights = torch.arange(1, words.numel() + 1, device=c.device, dtype=torch.int64) * 0x9E3779B1
    return f"cuda:{int(((words * weights) & ((1 << 62) - 1)).sum()):x}"


def _held(states: list[dict[str, Any]]) -> dict[ChunkId, torch.Tensor]:
    out: dict[ChunkId, torch.Tensor] = {}
    for sd in states:
        for key, value in sd.items():
            if isinstance(value, Chunks):
                for offsets, t in value.chunks.items():
                    out[(key, tuple(offsets))] = t
    return out


def _shared_ids(trainer: Any, held: dict[ChunkId, torch.Tensor]) -> frozenset[ChunkId]:
    ids = tuple(sorted(held))
    cached = _SHARED.get(trainer)
    if cached is not None and cached[0] == ids:
        return cached[1]
    everyone: list[tuple[ChunkId, ...] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, ids)
    count: dict[ChunkId, int] = defaultdict(int)
    for part in everyone:
        for cid in part or ():
            count[cid] += 1
    shared = frozenset(cid for cid in ids if count[cid] > 1)
    _SHARED[trainer] = (ids, shared)
    return shared


def check_replicas(trainer: Any, states: list[dict[str, Any]]) -> int:
    """Raise :class:`CheckpointError` on every rank when two ranks' copies of a chunk differ.

    ``states``: this rank's state dicts holding *every* chunk it keeps, replicas included (the
    model state built for a load, not the save's elected-writer subset). Returns how many
    replicated chunks this rank compared. Every rank takes part in the same collectives and
    reaches the same verdict, so a mismatch fails the save everywhere instead of hanging it.
    """
    held = _held(states)
    shared = _shared_ids(trainer, held)
    rank = dist.get_rank()
    if os.environ.get(FAULT_ENV) == str(rank) and shared:
        with torch.no_grad():
            victim = held[min(shared)].reshape(-1)[:1]
            victim.view(torch.int32 if victim.element_size() == 4 else torch.uint8).bitwise_xor_(1)
    mine = {cid: fingerprint(held[cid]) for cid in sorted(shared)}
    everyone: list[dict[ChunkId, str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    by_chunk: dict[ChunkId, dict[str, list[int]]] = defaultdict(lambda: defaultdict(list))
    for r, part in enumerate(everyone):
        for cid, digest in (part or {}).items():
            by_chunk[cid][digest].append(r)
    for (key, offsets), digests in sorted(by_chunk.items()):
        if len(digests) > 1:
            groups = sorted(digests.values(), key=lambda ranks: (-len(ranks), ranks))
            odd = ", ".join(f"ranks {g}" for g in groups[1:])
            raise CheckpointError(f"save refused: {key} at offsets {list(offsets)} differs between replicas: ranks "
                                  f"{groups[0]} agree, {odd} differ (silent data corruption or a missed all-reduce); "
                                  "nothing was written: restart from the last good checkpoint")
    return len(mine)
