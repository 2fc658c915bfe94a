"""Do a tensor's chunk boxes tile its global shape exactly: in bounds, no overlap, no hole?

This is the check behind DCP's silent failure modes: a writer election that picks two ranks
leaves an overlap, one that picks none leaves a hole, and DCP saves both without a word.

Boxes are ``(offsets, sizes)``. The overlap test sweeps along one dimension: boxes sorted by
start, an active set ordered by end; a new box is compared only with active boxes, the only ones
that meet it along the sweep dimension. The sweep dimension is the one with the most distinct
offsets, so for the usual layouts (1-D buckets, tensors cut along one dim) the active set holds
O(1) boxes and the whole test is O(n log n); a k x k grid costs O(n sqrt n); pathological inputs
degrade to the pairwise O(n**2) but stay correct.

Holes: with no overlap, the missing volume is the shape's volume minus the sum of the (clipped)
box volumes. With overlaps the union volume is computed exactly for 1-D (interval merge, which
also names the hole ranges) and by a recursive slab sweep for N-D (small inputs only; overlaps
are already an error then).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

Box = tuple[tuple[int, ...], tuple[int, ...]]

MAX_REPORTED = 20
UNION_LIMIT = 400  # boxes beyond which the N-D union with overlaps is not computed


@dataclass
class Coverage:
    """What is wrong with a set of boxes; empty lists and ``missing == 0`` mean an exact tiling."""

    bad_rank: list[int] = field(default_factory=list)  # boxes whose ndim differs from the shape
    out_of_bounds: list[int] = field(default_factory=list)
    overlaps: list[tuple[int, int]] = field(default_factory=list)  # first MAX_REPORTED pairs
    overlap_count: int = 0
    missing: int | None = 0  # elements covered by no box; None when not computed
    holes: list[tuple[int, int]] = field(default_factory=list)  # 1-D only: first uncovered ranges

    @property
    def ok(self) -> bool:
        return not (self.bad_rank or self.out_of_bounds or self.overlap_count) and self.missing == 0


def _intersects(a: Box, b: Box, skip: int) -> bool:
    (ao, asz), (bo, bsz) = a, b
    for d in range(len(ao)):
        if d != skip and not (ao[d] < bo[d] + bsz[d] and bo[d] < ao[d] + asz[d]):
            return False
    return True


def find_overlaps(boxes: Sequence[Box], ndim: int) -> tuple[list[tuple[int, int]], int]:
    """Pairs of boxes that share at least one element (first MAX_REPORTED) and their count."""
    live = [i for i, (_, s) in enumerate(boxes) if all(x > 0 for x in s)]
    if ndim == 0:  # scalars: every stored box is the one element
        pairs = [(live[i], live[j]) for i in range(len(live)) for j in range(i + 1, len(live))]
        return pairs[:MAX_REPORTED], len(pairs)
    dim = max(range(ndim), key=lambda d: len({boxes[i][0][d] for i in live}))
    order = sorted(live, key=lambda i: (boxes[i][0][dim], i))
    active: list[tuple[int, int]] = []  # (end along dim, box index)
    pairs: list[tuple[int, int]] = []
    count = 0
    for i in order:
        start = boxes[i][0][dim]
        while active and active[0][0] <= start:
            heapq.heappop(active)
        for _, j in active:
            if _intersects(boxes[i], boxes[j], dim):
                count += 1
                if len(pairs) < MAX_REPORTED:
                    pairs.append((min(i, j), max(i, j)))
        heapq.heappush(active, (start + boxes[i][1][dim], i))
    return pairs, count


def _clip(box: Box, shape: Sequence[int]) -> Box | None:
    lo = tuple(max(0, o) for o in box[0])
    hi = tuple(min(n, o + s) for o, s, n in zip(box[0], box[1], shape, strict=True))
    if any(h <= lo_ for lo_, h in zip(lo, hi, strict=True)):
        return None
    return lo, tuple(h - lo_ for lo_, h in zip(lo, hi, strict=True))


def _merge_1d(boxes: Sequence[Box], length: int) -> tuple[int, list[tuple[int, int]]]:
    """Uncovered element count of ``[0, length)`` and the first uncovered ranges."""
    missing, holes, pos = 0, [], 0
    for start, end in sorted((b[0][0], b[0][0] + b[1][0]) for b in boxes):
        if start > pos:
            missing += start - pos
            if len(holes) < MAX_REPORTED:
                holes.append((pos, start))
        pos = max(pos, end)
    if pos < length:
        missing += length - pos
        if len(holes) < MAX_REPORTED:
            holes.append((pos, length))
    return missing, holes


def _union_volume(boxes: Sequence[Box], dim: int = 0) -> int:
    """Exact volume of a union of boxes (all of the same rank) by recursive slab sweep."""
    if not boxes:
        return 0
    ndim = len(boxes[0][0])
    if dim == ndim:
        return 1
    cuts = sorted({b[0][dim] for b in boxes} | {b[0][dim] + b[1][dim] for b in boxes})
    total = 0
    for lo, hi in zip(cuts, cuts[1:], strict=False):
        inside = [b for b in boxes if b[0][dim] <= lo and hi <= b[0][dim] + b[1][dim]]
        if inside:
            total += (hi - lo) * _union_volume(inside, dim + 1)
    return total


def check_coverage(shape: Sequence[int], boxes: Sequence[Box]) -> Coverage:
    """Check that ``boxes`` tile ``shape`` exactly; see the module docstring for the method."""
    ndim = len(shape)
    cov = Coverage()
    good: list[int] = []
    for i, (offsets, sizes) in enumerate(boxes):
        if len(offsets) != ndim or len(sizes) != ndim:
            cov.bad_rank.append(i)
            continue
        if any(o < 0 or s < 0 or o + s > n for o, s, n in zip(offsets, sizes, shape, strict=True)):
            cov.out_of_bounds.append(i)
        good.append(i)
    ranked = [boxes[i] for i in good]
    local_pairs, cov.overlap_count = find_overlaps(ranked, ndim)
    cov.overlaps = [(good[a], good[b]) for a, b in local_pairs]
    clipped = [c for c in (_clip(b, shape) for b in ranked) if c is not None]
    total = math.prod(shape)
    if ndim == 0:
        cov.missing = 0 if ranked else 1
    elif ndim == 1:
        cov.missing, cov.holes = _merge_1d(clipped, shape[0])
    elif cov.overlap_count == 0:
        cov.missing = total - sum(math.prod(s) for _, s in clipped)
    elif len(clipped) <= UNION_LIMIT:
        cov.missing = total - _union_volume(clipped)
    else:
        cov.missing = None
    return cov
