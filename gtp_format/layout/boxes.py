"""Box arithmetic, once: where two boxes meet, whether they overlap, and whether a set tiles a shape.

Every caller that intersects boxes uses :func:`intersection` and :func:`overlaps` (the box reads of
``reshard``, migrate's weight reads, the load plan, the chunk reads of ``show``), and every
coverage check uses :func:`check_coverage` (``ckpt verify``'s geometry, ``show``'s assembled
region). Why here: the intersection was written out three times, and the reader imported the
coverage check from ``check/``; layout is below both.

Do a tensor's chunk boxes tile its global shape exactly: in bounds, no overlap, no hole?
This is the check behind DCP's silent failure modes: a writer election that picks two ranks
leaves an overlap, one that picks none leaves a hole, and DCP saves both without a word.

Boxes are ``(offsets, sizes)``. The overlap test sweeps along one dimension: boxes sorted by
start, an active set ordered by end; a new box is compared only with active boxes, the only ones
that meet it along the sweep dimension. The sweep dimension is the one with the most distinct
offsets, so for the usual layouts (1-D buckets, tensors cut along one dim) the active set holds
O(1) boxes and the whole test is O(n log n); a k x k grid costs O(n sqrt n). Identical boxes are
grouped before the sweep (a repeated chunk is counted by arithmetic), and the sweep stops after
``MAX_TESTS`` pair tests, reporting the count as a lower bound: nested boxes that all overlap
each other no longer cost O(n**2) (a 218 KB crafted file used to run past a minute).

Holes: with no overlap, the missing volume is the shape's volume minus the sum of the (clipped)
box volumes. With overlaps the union volume is computed exactly for 1-D (interval merge, which
also names the hole ranges) and on a compressed grid with a difference array for N-D (numpy;
only when the grid has at most ``GRID_LIMIT`` cells, else "not computed": overlaps are already
an error then).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

Box = tuple[tuple[int, ...], tuple[int, ...]]

MAX_REPORTED = 20
MAX_TESTS = 1_000_000  # box-pair tests in the overlap sweep; past it the count is a lower bound (about 1 s)
GRID_LIMIT = 1 << 21  # cells of the compressed grid for an N-D union with overlaps (16 MiB of int64)


@dataclass
class Coverage:
    """What is wrong with a set of boxes; empty lists and ``missing == 0`` mean an exact tiling."""

    bad_rank: list[int] = field(default_factory=list)  # boxes whose ndim differs from the shape
    out_of_bounds: list[int] = field(default_factory=list)
    overlaps: list[tuple[int, int]] = field(default_factory=list)  # first MAX_REPORTED pairs
    overlap_count: int = 0
    missing: int | None = 0  # elements covered by no box; None when not computed
    holes: list[tuple[int, int]] = field(default_factory=list)  # 1-D only: first uncovered ranges
    count_exact: bool = True  # False: overlap_count is a lower bound (the sweep hit MAX_TESTS)

    @property
    def ok(self) -> bool:
        return not (self.bad_rank or self.out_of_bounds or self.overlap_count) and self.missing == 0


def intersection(a: Box, b: Box) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The elements boxes ``a`` and ``b`` share, as corners ``(lo, hi)`` (``hi`` exclusive), or ``None``.

    An empty box shares nothing; two 0-D boxes (scalars) share their one element: ``((), ())``.
    """
    lo = tuple(max(o, p) for o, p in zip(a[0], b[0]))
    hi = tuple(min(o + s, p + t) for o, s, p, t in zip(a[0], a[1], b[0], b[1]))
    return None if any(x >= y for x, y in zip(lo, hi)) else (lo, hi)


def overlaps(a: Box, b: Box, skip: int = -1) -> bool:
    """Whether the spans of ``a`` and ``b`` cross in every dimension but ``skip`` (one the caller knows).

    For boxes with no empty dimension this is ``intersection(a, b) is not None``, without building
    it. An empty box strictly inside another's span counts as overlapping, which is what DCP's load
    planner does (``_check_shard_metadata_pair_overlap``), so :mod:`gtp_format.load_plan` counts the
    chunks a load really reads; :func:`find_overlaps` drops empty boxes before it asks.
    """
    (ao, asz), (bo, bsz) = a, b
    for d in range(len(ao)):
        if d != skip and not (ao[d] < bo[d] + bsz[d] and bo[d] < ao[d] + asz[d]):
            return False
    return True


def find_overlaps(boxes: Sequence[Box], ndim: int) -> tuple[list[tuple[int, int]], int, bool]:
    """Pairs of boxes that share at least one element (first MAX_REPORTED), their count, and whether
    the count is exact (``False``: at least that many; the sweep stopped after ``MAX_TESTS`` tests).

    Identical boxes are grouped first: ``k`` copies of one box are ``k*(k-1)/2`` pairs counted by
    arithmetic, and the sweep runs over distinct boxes only, each intersecting pair of groups
    counting the product of their sizes. Repeating one chunk a thousand times used to cost half a
    million comparisons.
    """
    if ndim == 1 and _disjoint_1d(boxes):  # the common case, one sort instead of the groups and the sweep
        return [], 0, True
    groups: dict[Box, list[int]] = {}
    for i, box in enumerate(boxes):
        if all(x > 0 for x in box[1]):
            groups.setdefault((tuple(box[0]), tuple(box[1])), []).append(i)
    pairs: list[tuple[int, int]] = []
    count = 0

    def add(a: list[int], b: list[int] | None) -> None:
        nonlocal count
        count += len(a) * (len(a) - 1) // 2 if b is None else len(a) * len(b)
        for i in a:
            if len(pairs) >= MAX_REPORTED:
                return
            for j in (a if b is None else b):
                if (b is not None or j > i) and len(pairs) < MAX_REPORTED:
                    pairs.append((min(i, j), max(i, j)))

    uniq = list(groups.items())
    for _, members in uniq:
        if len(members) > 1:
            add(members, None)
    if ndim == 0:  # scalars: every stored box is the one element, and all are identical
        return pairs, count, True
    dim = max(range(ndim), key=lambda d: len({box[0][d] for box, _ in uniq}))
    order = sorted(range(len(uniq)), key=lambda g: uniq[g][0][0][dim])
    active: list[tuple[int, int]] = []  # (end along dim, group index)
    tests = 0
    for g in order:
        box, members = uniq[g]
        start = box[0][dim]
        while active and active[0][0] <= start:
            heapq.heappop(active)
        tests += len(active)
        if tests > MAX_TESTS:
            return pairs, count, False
        for _, h in active:
            if overlaps(box, uniq[h][0], dim):
                add(members, uniq[h][1])
        heapq.heappush(active, (start + box[1][dim], g))
    return pairs, count, True


def _disjoint_1d(boxes: Sequence[Box]) -> bool:
    """Whether no two non-empty 1-D boxes share an element: sorted by start, each begins at or after the
    previous one's end (then the ends rise too, so no earlier box reaches further)."""
    spans = sorted((o[0], o[0] + s[0]) for o, s in boxes if s[0] > 0)
    return all(b[0] >= a[1] for a, b in zip(spans, spans[1:]))


def _clip(box: Box, shape: Sequence[int]) -> Box | None:
    cut = intersection(box, ((0,) * len(shape), tuple(shape)))
    return None if cut is None else (cut[0], tuple(h - lo for lo, h in zip(*cut, strict=True)))


def _inside(box: Box) -> Box | None:
    """:func:`_clip` of a box within the shape's bounds."""
    return (tuple(box[0]), tuple(box[1])) if all(x > 0 for x in box[1]) else None


def _tiles_1d(length: int, boxes: Sequence[Box], cov: Coverage) -> bool:
    """The common 1-D case in a few passes over columns: every box of rank 1, in bounds and disjoint from
    the others. Then ``cov`` gets the uncovered count and ranges, and the answer is True; otherwise it is
    left alone for the general path (which finds the same when this holds: tests/format/test_geometry.py).
    """
    if not all(len(o) == 1 and len(s) == 1 for o, s in boxes):
        return False
    starts = [o[0] for o, _ in boxes]
    sizes = [s[0] for _, s in boxes]
    if boxes and (min(starts) < 0 or min(sizes) < 0 or max(map(sum, zip(starts, sizes))) > length):
        return False
    spans = sorted((a, a + n) for a, n in zip(starts, sizes) if n > 0)
    if not all(b[0] >= a[1] for a, b in zip(spans, spans[1:])):
        return False
    cov.missing, cov.holes = _merge_spans(spans, length)
    return True


def _merge_1d(boxes: Sequence[Box], length: int) -> tuple[int, list[tuple[int, int]]]:
    """Uncovered element count of ``[0, length)`` and the first uncovered ranges."""
    return _merge_spans(sorted((b[0][0], b[0][0] + b[1][0]) for b in boxes), length)


def _merge_spans(spans: list[tuple[int, int]], length: int) -> tuple[int, list[tuple[int, int]]]:
    """:func:`_merge_1d` of spans ``(start, end)`` sorted by start."""
    missing, holes, pos = 0, [], 0
    for start, end in spans:
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


def _union_volume(boxes: Sequence[Box], ndim: int, total: int) -> int | None:
    """Exact volume of a union of boxes, or ``None`` when the compressed grid would be too large.

    Coordinates are compressed to the boxes' own edges; each box adds +1/-1 at its ``2**ndim``
    corners of a difference array and one cumulative sum per axis gives every cell's cover count
    (numpy, so the cost is the grid's size, at most ``GRID_LIMIT`` cells, not boxes times cells).
    """
    if ndim > 8 or total >= 1 << 62:
        return None
    axes = [sorted({b[0][d] for b in boxes} | {b[0][d] + b[1][d] for b in boxes}) for d in range(ndim)]
    if math.prod(len(a) for a in axes) > GRID_LIMIT:
        return None
    where = [{v: i for i, v in enumerate(a)} for a in axes]
    diff = np.zeros([len(a) for a in axes], dtype=np.int64)
    corners = list(itertools.product((0, 1), repeat=ndim))
    for lo, size in boxes:
        for corner in corners:
            at = tuple(where[d][lo[d] + (size[d] if c else 0)] for d, c in enumerate(corner))
            diff[at] += -1 if sum(corner) % 2 else 1
    for d in range(ndim):
        np.cumsum(diff, axis=d, out=diff)
    volume = (diff[tuple(slice(0, len(a) - 1) for a in axes)] > 0).astype(np.int64)
    for a in reversed(axes):  # sum of covered cells' volumes: contract one axis at a time with its widths
        volume = volume @ np.diff(np.array(a, dtype=np.int64))
    return int(volume)


def check_coverage(shape: Sequence[int], boxes: Sequence[Box]) -> Coverage:
    """Check that ``boxes`` tile ``shape`` exactly; see the module docstring for the method."""
    ndim = len(shape)
    cov = Coverage()
    if ndim == 1 and _tiles_1d(shape[0], boxes, cov):
        return cov
    good: list[int] = []
    for i, (offsets, sizes) in enumerate(boxes):
        if len(offsets) != ndim or len(sizes) != ndim:
            cov.bad_rank.append(i)
            continue
        if any(o < 0 or s < 0 or o + s > n for o, s, n in zip(offsets, sizes, shape, strict=True)):
            cov.out_of_bounds.append(i)
        good.append(i)
    ranked = [boxes[i] for i in good]
    local_pairs, cov.overlap_count, cov.count_exact = find_overlaps(ranked, ndim)
    cov.overlaps = [(good[a], good[b]) for a, b in local_pairs]
    # a box in bounds is its own clip (None when empty): only those out of bounds need the intersection
    outside = set(cov.out_of_bounds)
    clipped = list(dict.fromkeys(c for c in (_clip(boxes[i], shape) if i in outside else _inside(boxes[i])
                                             for i in good) if c is not None))  # distinct
    total = math.prod(shape)
    if ndim == 0:
        cov.missing = 0 if ranked else 1
    elif ndim == 1:
        cov.missing, cov.holes = _merge_1d(clipped, shape[0])
    elif cov.overlap_count == 0:  # the fast path: disjoint boxes, volumes add up
        cov.missing = total - sum(math.prod(s) for _, s in clipped)
    else:
        union = _union_volume(clipped, ndim, total)
        cov.missing = None if union is None else total - union
    return cov
