"""The box arithmetic of gtp_format/layout/boxes.py (intersection, overlap, coverage) against a brute force."""

from __future__ import annotations

import itertools
import math

from hypothesis import given, settings
from hypothesis import strategies as st

from gtp_format.layout.boxes import MAX_REPORTED, Box, check_coverage, intersection, overlaps


def brute(shape: tuple[int, ...], boxes: list[Box]):
    """Out-of-bounds boxes, overlapping pairs and uncovered in-bounds cells, by enumeration."""
    oob = [i for i, (o, s) in enumerate(boxes) if any(a < 0 or a + b > n for a, b, n in zip(o, s, shape))]
    cells = [set(itertools.product(*(range(a, a + b) for a, b in zip(o, s)))) for o, s in boxes]
    pairs = {(i, j) for i, j in itertools.combinations(range(len(boxes)), 2) if cells[i] & cells[j]}
    inside = set(itertools.product(*(range(n) for n in shape)))
    covered = set().union(*cells) if cells else set()
    return oob, pairs, len(inside - covered)


def boxes_for(ndim: int):
    dims = st.tuples(*[st.tuples(st.integers(0, 8), st.integers(0, 4))] * ndim)
    return st.lists(dims.map(lambda d: (tuple(a for a, _ in d), tuple(b for _, b in d))), max_size=7)


@st.composite
def cases(draw):
    ndim = draw(st.sampled_from([1, 2]))
    shape = tuple(draw(st.integers(0, 7)) for _ in range(ndim))
    return shape, draw(boxes_for(ndim))


@settings(max_examples=300, deadline=None)
@given(cases())
def test_matches_brute_force(case):
    shape, boxes = case
    cov = check_coverage(shape, boxes)
    oob, pairs, missing = brute(shape, boxes)
    assert cov.out_of_bounds == oob
    assert cov.overlap_count == len(pairs)
    if len(pairs) <= MAX_REPORTED:
        assert set(cov.overlaps) == pairs
    else:  # only the first MAX_REPORTED pairs are kept
        assert set(cov.overlaps) < pairs and len(cov.overlaps) == MAX_REPORTED
    assert cov.missing == missing
    assert cov.ok == (not oob and not pairs and missing == 0)


def _cells(box: Box) -> set[tuple[int, ...]]:
    return set(itertools.product(*(range(o, o + s) for o, s in zip(*box))))


@settings(max_examples=400, deadline=None)
@given(st.sampled_from([0, 1, 2, 3]).flatmap(lambda n: st.tuples(boxes_for(n), boxes_for(n))))
def test_intersection_and_overlap_match_brute_force(pair):
    """The one intersection every box read uses is exactly the shared cells; ``overlaps`` agrees with
    it whenever neither box is empty, and on empty boxes keeps DCP's planner's span test."""
    for a in pair[0]:
        for b in pair[1]:
            shared = _cells(a) & _cells(b)
            cut = intersection(a, b)
            if not shared:
                assert cut is None
                continue
            assert cut is not None and _cells((cut[0], tuple(h - lo for lo, h in zip(*cut)))) == shared
            assert intersection(b, a) == cut
    for a in pair[0]:
        for b in pair[1]:
            if all(a[1]) and all(b[1]):
                assert overlaps(a, b) == bool(_cells(a) & _cells(b))
            spans = all(o < p + t and p < o + s for o, s, p, t in zip(a[0], a[1], b[0], b[1]))
            assert overlaps(a, b) == spans


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 5), min_size=1, max_size=12), st.randoms())
def test_exact_1d_tiling_is_ok_in_any_order(sizes, rnd):
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    boxes = [((o,), (s,)) for o, s in zip(offsets, sizes)]
    rnd.shuffle(boxes)
    assert check_coverage((sum(sizes),), boxes).ok


def test_1d_holes_are_named():
    cov = check_coverage((10,), [((0,), (3,)), ((5,), (2,))])
    assert cov.missing == 5 and cov.holes == [(3, 5), (7, 10)]


def test_huge_declared_shape_is_arithmetic_not_memory():
    cov = check_coverage((10**15,), [((0,), (4,))])
    assert cov.missing == 10**15 - 4
    cov = check_coverage((10**8, 10**7), [((0, 0), (10**8, 10**7))])
    assert cov.ok


def test_grid_and_scalar():
    grid = [((r * 2, c * 3), (2, 3)) for r in range(4) for c in range(3)]
    assert check_coverage((8, 9), grid).ok
    assert check_coverage((), [((), ())]).ok
    assert check_coverage((), []).missing == 1
    assert check_coverage((), [((), ()), ((), ())]).overlap_count == 1
    assert check_coverage((4,), [((0, 0), (4, 1))]).bad_rank == [0]
    assert math.prod(()) == 1


def test_identical_boxes_are_counted_without_pairwise_tests(monkeypatch):
    from gtp_format.layout import boxes

    calls = []
    real = boxes.overlaps
    monkeypatch.setattr(boxes, "overlaps", lambda *a: calls.append(1) or real(*a))
    n = 3000
    cov = check_coverage((4, 4), [((0, 0), (4, 4))] * n)
    assert cov.overlap_count == n * (n - 1) // 2 and cov.count_exact and cov.missing == 0
    assert len(cov.overlaps) == MAX_REPORTED and not calls


def test_nested_overlapping_boxes_stop_at_the_test_budget(monkeypatch):
    from gtp_format.layout import boxes

    calls = []
    real = boxes.overlaps
    monkeypatch.setattr(boxes, "overlaps", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(boxes, "MAX_TESTS", 10_000)
    n = 400
    boxes = [((i, i), (2 * n - 2 * i, 2 * n - 2 * i)) for i in range(n)]
    cov = check_coverage((2 * n, 2 * n), boxes)
    assert not cov.count_exact and cov.overlap_count >= len(calls) > 0 and len(calls) <= 10_000
    assert cov.missing == 0  # the union on the compressed grid is still exact


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 5), st.integers(1, 4), st.integers(1, 4)), max_size=12),
       st.integers(1, 3))
def test_union_with_repeats_matches_brute_force(raw, repeat):
    shape = (8, 8)
    boxes = [((a, b), (c, d)) for a, b, c, d in raw] * repeat
    cov = check_coverage(shape, boxes)
    oob, pairs, missing = brute(shape, boxes)
    assert cov.overlap_count == len(pairs) and cov.missing == missing


def test_disjoint_1d_chunks_take_one_sort_and_no_pair_test(monkeypatch):
    """A 1-D key of many disjoint chunks (a DCP optimizer bucket: 100 per key, a million in a file) is
    checked by sorting their spans; the sweep's pair tests run only when two spans cross."""
    from gtp_format.layout import boxes

    calls = []
    real = boxes.overlaps
    monkeypatch.setattr(boxes, "overlaps", lambda *a: calls.append(1) or real(*a))
    tiles = [((i * 3,), (3,)) for i in range(5000)][::-1]
    assert check_coverage((15000,), tiles).ok and not calls
    cov = check_coverage((15000,), [*tiles, ((7,), (2,))])  # one crossing: the exact path
    assert cov.overlap_count == 1 and cov.overlaps == [(4997, 5000)] and calls
