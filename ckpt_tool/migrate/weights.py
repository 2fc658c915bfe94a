"""Lost fp32 masters, rebuilt from the model weights of the same checkpoint.

The optimizer publishes its fp32 master into the model weights after every step (cast to the
param dtype), so a CP peer's lost ``param`` chunk is its shard of the weights, laid out as the
bucket lays them out: each param's valid rows in place, zeros in GTP tail padding and alignment
gaps. With fp32 weights that is bit-exact; with bf16 weights it is the rounded value (the plan
records those weights as lossy). Weights are read chunk by chunk through the format's decoder,
never through ``dcp.load``: a few shards are needed, not the whole checkpoint.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Any

import torch

from ckpt_tool.migrate.plan import LostChunk, Plan, lost_shard_spec, pieces
from gtp_format.errors import EXIT_CHECK_FAILED, FormatError
from gtp_format.layout.boxes import intersection
from gtp_format.layout.shard import ShardSpec
from gtp_format.model import Checkpoint, Entry
from gtp_format.names import parse_optimizer_key
from gtp_format.reader.chunks import load_chunk


def read_box(ckpt: Checkpoint, entry: Entry, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
    """The box ``[offsets, offsets + sizes)`` of a tensor key, from whichever chunks cover it."""
    assert entry.dtype is not None
    for c in entry.chunks:  # the usual case: the writer's chunk is exactly the shard
        if c.offsets == tuple(offsets) and c.sizes == tuple(sizes):
            return load_chunk(ckpt, entry, c)
    out = torch.zeros(sizes, dtype=entry.dtype.torch)
    covered = 0
    for c in entry.chunks:
        cut = intersection((offsets, sizes), (c.offsets, c.sizes))
        if cut is None:
            continue
        lo, hi = cut
        t = load_chunk(ckpt, entry, c)
        src = t[tuple(slice(a - co, b - co) for a, b, co in zip(lo, hi, c.offsets))]
        out[tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, offsets))] = src
        covered += math.prod(b - a for a, b in zip(lo, hi))
    if covered != math.prod(sizes):
        raise FormatError(f"{entry.key}: only {covered} of the {math.prod(sizes)} elements at offsets {list(offsets)} "
                        f"sizes {list(sizes)} are stored; the weight shard needed to rebuild a master is incomplete",
                        EXIT_CHECK_FAILED)
    return out


class ShardCache:
    """Flattened fp32 weight shards, most recent few only (consecutive chunks share params)."""

    def __init__(self, ckpt: Checkpoint, size: int = 4) -> None:
        self.ckpt, self.size = ckpt, size
        self.items: OrderedDict[tuple[Any, ...], torch.Tensor] = OrderedDict()

    def get(self, name: str, spec: ShardSpec) -> torch.Tensor:
        k = (name, spec.global_offset, spec.local_shape)
        if k not in self.items:
            entry = self.ckpt.entries[name]
            self.items[k] = read_box(self.ckpt, entry, spec.global_offset, spec.local_shape).reshape(-1).float()
            while len(self.items) > self.size:
                self.items.popitem(last=False)
        self.items.move_to_end(k)
        return self.items[k]


def rebuild_master(plan: Plan, lost: LostChunk, shards: ShardCache) -> torch.Tensor:
    """fp32 master of a lost chunk: the shard's elements where a param is, 0 in tail padding and gaps."""
    assert plan.par is not None
    opt = parse_optimizer_key(lost.source_key)
    assert opt is not None
    bucket = plan.buffers[opt.gbuf_idx].bucket(opt.bucket_idx)
    assert bucket is not None
    lo, n = lost.offsets[0], lost.sizes[0]
    out = torch.zeros(n, dtype=torch.float32)
    for p, a, b in pieces(bucket, lo, lo + n):
        spec = lost_shard_spec(p, plan.par, opt.dp_group_idx, lost.cp_rank)
        valid_end = p.start + spec.valid_rows * math.prod(spec.local_shape[1:])
        z = min(b, valid_end)
        if a < z:
            out[a - lo: z - lo] = shards.get(p.name, spec)[a - p.start: z - p.start]
    return out
