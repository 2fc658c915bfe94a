"""CPU binding of local ranks (gtp_runtime.affinity): the kernel's cpulist format, and shares
that are disjoint, equal and inside the allowed set, checked against brute force."""

from __future__ import annotations

import os
import subprocess
import sys

from hypothesis import given
from hypothesis import strategies as st

from gtp_runtime.affinity import bind_rank, parse_cpulist, share


def test_parse_cpulist() -> None:
    assert parse_cpulist("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert parse_cpulist("5") == [5]
    assert parse_cpulist("") == []


@given(st.sets(st.integers(0, 255), min_size=1, max_size=64), st.integers(1, 8))
def test_shares_are_disjoint_equal_and_allowed(cpus: set[int], world: int) -> None:
    shares = [share(list(cpus), r, world) for r in range(world)]
    flat = [c for s in shares for c in s]
    assert len(flat) == len(set(flat))  # disjoint
    assert set(flat) <= cpus
    assert {len(s) for s in shares} == {len(cpus) // world}
    assert len(cpus) - len(flat) < world  # at most the remainder is left out


def test_bind_rank_binds_this_process_to_its_share() -> None:
    # In a child: binding changes the calling process's affinity.
    code = ("import os; from gtp_runtime.affinity import bind_rank, share; allowed = sorted(os.sched_getaffinity(0)); "
            "got = bind_rank(1, 2); print(got == (share(allowed, 1, 2) or None), "
            "got is None or sorted(os.sched_getaffinity(0)) == got)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "True"]


def test_bind_rank_skips_when_fewer_cpus_than_ranks() -> None:
    assert bind_rank(0, len(os.sched_getaffinity(0)) + 1) is None
