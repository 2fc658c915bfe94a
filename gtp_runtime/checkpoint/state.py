"""The sharded state dict of one rank: model-weight chunks and ``dp_reshardable`` optimizer chunks.

The same function builds the dict for saving (chunks are views of live tensors to write from)
and for loading (the same views to read into), so save and load can never disagree on a key,
an offset or a size. Loading at another DP size simply asks for other boxes; DCP reads the
overlapping parts of the stored chunks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from gtp_format.layout import election
from gtp_format.names import dtype_tag, optimizer_key, per_bucket_numel_key
from gtp_runtime.buffers import Bucket, GradBuffer
from gtp_runtime.checkpoint.dcp_chunks import Chunks
from gtp_runtime.groups import Groups
from gtp_runtime.optimizer import DistributedAdam


def dp_group_idx(buf: GradBuffer, groups: Groups) -> int:
    """``N`` of this rank's keys for ``buf`` (:func:`gtp_format.layout.election.dp_group_idx`)."""
    return election.dp_group_idx(groups.topology, groups.rank, buf.key.is_expert)


@dataclass(frozen=True)
class Piece:
    """A run of one bucket's owned slice: a param's part, or a padding gap between params."""

    start: int  # bucket-relative
    end: int
    param: str | None  # None for padding


def owned_pieces(buf: GradBuffer, b: Bucket) -> list[Piece]:
    """This rank's owned part of bucket ``b`` (without the final DP padding), cut at param edges.

    Megatron writes one chunk per param inside each bucket; the gaps left by param alignment
    become padding chunks so every key's global tensor is fully covered.
    """
    lo, hi = buf.owned_range(b)
    lo, hi = lo - b.start, min(hi - b.start, b.numel_unpadded)
    edges = sorted({lo, hi} | {e for s in b.slots for e in (s.start - b.start, s.end - b.start) if lo < e < hi})
    pieces = []
    for a, z in zip(edges, edges[1:]):
        owner = next((s.name for s in b.slots if s.start - b.start <= a < s.end - b.start), None)
        pieces.append(Piece(a, z, owner))
    return pieces


def model_state(model: nn.Module, groups: Groups, for_load: bool) -> dict[str, Chunks]:
    """Model weights as chunks at their global offsets; only the elected writer saves a chunk."""
    out: dict[str, Chunks] = {}
    for name, p in model.named_parameters():
        c = Chunks(p.spec.global_shape, p.dtype)
        if for_load or election.is_writer(p.spec, groups.rank, groups.topology):
            c.add(p.spec.global_offset, p.data)
        out[name] = c
    return out


def optimizer_state(opt: DistributedAdam, groups: Groups, aliased: bool = False) -> dict[str, Chunks]:
    """``dp_reshardable`` bucket states of this rank.

    ``aliased=True`` reproduces the pre-fix writer (no ``.cp_rank_{i}`` on folded buffers). It
    exists only so that fixtures and regression tests can show the data loss it caused.
    """
    out: dict[str, Chunks] = {}
    for buf, states in zip(opt.buffers, opt.state):
        n = dp_group_idx(buf, groups)
        tag = dtype_tag(buf.key.param_dtype, buf.key.grad_dtype)
        cp_rank = groups.coords.cp if buf.key.excludes_cp and not aliased else None
        for b, st in zip(buf.buckets, states):
            base = buf.owned_range(b)[0] - b.start
            for state, tensor in st.tensors().items():
                c = Chunks((b.numel_unpadded,), torch.float32)
                for piece in owned_pieces(buf, b):
                    c.add((piece.start,), tensor[piece.start - base : piece.end - base])
                out[optimizer_key(n, buf.gbuf_idx, tag, b.index, state, cp_rank)] = c
    return out


def bucket_numel_state(opt: DistributedAdam, groups: Groups, for_load: bool) -> dict[str, Chunks]:
    """``per_bucket_numel`` / ``_unpadded`` per dp_group_idx as int64 tensors over (gbuf, bucket).

    One writer per key: for a dense N the rank with cp == dp == 0, for an expert N the rank
    with expert_dp == 0 (each is exactly one rank per N).
    """
    out: dict[str, Chunks] = {}
    c = groups.coords
    for unpadded in (False, True):
        by_n: dict[int, list[int]] = {}
        writer: dict[int, bool] = {}
        for buf in opt.buffers:
            n = dp_group_idx(buf, groups)
            by_n.setdefault(n, []).extend(b.numel_unpadded if unpadded else b.numel for b in buf.buckets)
            writer[n] = c.expert_dp == 0 if buf.key.is_expert else (c.cp == 0 and c.dp == 0)
        for n, values in by_n.items():
            if unpadded is False and for_load:
                continue  # padded sizes depend on the DP size: checked on load only when it matches
            t = torch.tensor(values, dtype=torch.int64)
            ch = Chunks((len(values),), torch.int64)
            if for_load or writer[n]:
                ch.add((0,), t if not for_load else torch.zeros_like(t))
            out[per_bucket_numel_key(n, unpadded)] = ch
    return out


def expected_bucket_numels(opt: DistributedAdam, groups: Groups) -> dict[str, list[int]]:
    """``per_bucket_numel_unpadded`` key -> the running model's unpadded bucket sizes (checked on load)."""
    res: dict[str, list[int]] = {}
    for buf in opt.buffers:
        key = per_bucket_numel_key(dp_group_idx(buf, groups), True)
        res.setdefault(key, []).extend(b.numel_unpadded for b in buf.buckets)
    return res

