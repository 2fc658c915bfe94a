"""Weight gathers started in batches (``sharding.GATHER_BATCH``) train bit for bit like one at a
time, on real gloo ranks (folded cp2), and each weight is still gathered once per use."""

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
