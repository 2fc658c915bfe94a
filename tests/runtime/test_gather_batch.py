"""Weight gathers started in batches (``sharding.GATHER_BATCH``), and the last weights kept
gathered from forward to backward (``sharding.KEEP_LAST``), train bit for bit like one gather per
use, on real gloo ranks (folded cp2)."""

from __future__ import annotations

import launch_jobs
from dist_harness import run_ranks


def _most_in_flight(events: list[tuple[str, int]]) -> int:
    """The most gathers started and not yet used at any point."""
    started: set[int] = set()
    most = 0
    for what, idx in events:
        if what == "start":
            started.add(idx)
            most = max(most, len(started))
        else:
            started.discard(idx)
    return most


def test_batched_gathers_train_bit_for_bit_like_single_ones() -> None:
    one = run_ranks(2, launch_jobs.train_with_gather_batch, 1, 2)
    four = run_ranks(2, launch_jobs.train_with_gather_batch, 4, 2)
    for (l1, p1, e1), (l4, p4, e4) in zip(one, four, strict=True):
        assert l1 == l4
        assert p1 == p4
        starts = sorted(i for what, i in e1 if what == "start")
        assert starts == sorted(i for what, i in e4 if what == "start")  # the same gathers
        assert starts == sorted(i for what, i in e1 if what == "use")  # each started once per use
        # the weight in use and PREFETCH_DEPTH (2) ahead; batched: the weight in use, the one
        # ahead, and a batch of 4 started when the one after it was missing
        assert (_most_in_flight(e1), _most_in_flight(e4)) == (3, 6)


def test_kept_last_gathers_train_bit_for_bit_and_skip_their_backward_gather() -> None:
    """With an evaluation after every step: a kept gather from a forward without backward must not
    be used by the next step's forward, after the optimizer changed the shards."""
    plain = run_ranks(2, launch_jobs.train_with_gather_batch, 1, 3, 0, True)
    kept = run_ranks(2, launch_jobs.train_with_gather_batch, 1, 3, 4, True)
    for (l0, p0, e0), (lk, pk, ek) in zip(plain, kept, strict=True):
        assert l0 == lk
        assert p0 == pk
        n0 = sum(what == "start" for what, _ in e0)
        nk = sum(what == "start" for what, _ in ek)
        assert n0 - nk == 3 * 4  # 4 backward gathers fewer in each of the 3 training steps
