"""The pool of reused host buffers behind sync saves and loads (gtp_runtime/checkpoint/pinned.py): a
thread holds one buffer at a time, buffers are reused rather than added, and buffers lent at the
same time never overlap. On CPU the buffers are ordinary memory; the pinned case runs in
tests/runtime/test_gpu_ckpt_io.py on a GPU."""

from __future__ import annotations

import threading

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gtp_runtime.checkpoint.pinned import PinnedPool


@given(st.lists(st.integers(1, 1 << 16), min_size=1, max_size=30))
def test_one_thread_holds_one_buffer_as_large_as_its_largest_request(sizes: list[int]) -> None:
    pool = PinnedPool()
    for n in sizes:
        view = pool.take(n)
        assert view.nbytes >= n and not view.readonly
    assert pool.nbytes == max(sizes)  # one buffer, replaced when too small, never kept beside a larger one
    pool.give_back()
    assert pool.nbytes == max(sizes)


@settings(max_examples=20)
@given(st.lists(st.lists(st.integers(1, 1 << 14), min_size=1, max_size=8), min_size=2, max_size=6))
def test_buffers_lent_at_once_never_overlap(per_thread: list[list[int]]) -> None:
    pool = PinnedPool()
    barrier = threading.Barrier(len(per_thread))
    bad: list[str] = []

    def run(me: int, sizes: list[int]) -> None:
        for n in sizes:
            view = np.frombuffer(pool.take(n), dtype=np.uint8)[:n]
            view[:] = me
            barrier_wait(barrier)
            if not (view == me).all():
                bad.append(f"thread {me}'s buffer was written by another")
            barrier_wait(barrier)

    def barrier_wait(b: threading.Barrier) -> None:
        try:
            b.wait(timeout=30)
        except threading.BrokenBarrierError:
            pass

    # every thread runs as many rounds as the longest list, repeating its own last size
    rounds = max(len(s) for s in per_thread)
    padded = [s + [s[-1]] * (rounds - len(s)) for s in per_thread]
    threads = [threading.Thread(target=run, args=(i, s)) for i, s in enumerate(padded)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not bad
    pool.give_back()
    assert pool.nbytes <= len(per_thread) * max(max(s) for s in per_thread)


def test_host_copy_of_a_cpu_tensor_is_left_to_dcp() -> None:
    from gtp_runtime.checkpoint.pinned import host_for_write

    t = torch.arange(10)
    assert host_for_write(t) is t


@settings(max_examples=60, deadline=None)
@given(dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.uint8,
                              torch.bool]),
       total=st.integers(1, 400), lo=st.integers(0, 399), n=st.integers(1, 400), cols=st.sampled_from([1, 3]))
def test_a_cpu_view_of_a_larger_buffer_is_handed_to_dcp_over_its_own_bytes_without_a_copy(
        dtype: torch.dtype, total: int, lo: int, n: int, cols: int) -> None:
    """DCP's writer clones a tensor whose storage is larger than it (``_SerialCpuLoader``); a chunk of a
    sharded buffer is such a view. Handed over as the same memory with a storage of its own size, it is
    neither cloned nor copied, and ``torch.save`` writes exactly its bytes."""
    import io

    from gtp_runtime.checkpoint.pinned import host_for_write

    lo, n = min(lo, total - 1), min(n, total - min(lo, total - 1))
    buf = (torch.arange(total * cols) % 7).to(dtype).reshape(total, cols)
    view = buf[lo:lo + n]
    out = host_for_write(view)
    if n == total:  # the whole buffer: already its own storage, left as it is
        assert out is view
        return
    assert out.untyped_storage().nbytes() == view.numel() * view.element_size()  # DCP's clone test is false
    assert out.data_ptr() == view.data_ptr() and out.dtype == view.dtype and out.shape == view.shape
    assert torch.equal(out, view)
    buf[lo] = 1  # the same memory, not a copy
    assert torch.equal(out[0], view[0])
    stream = io.BytesIO()
    torch.save(out, stream)
    stream.seek(0)
    assert torch.equal(torch.load(stream, weights_only=True), view)
    strided = buf.t()
    if not strided.is_contiguous():  # left to DCP, which clones it
        assert host_for_write(strided) is strided


def test_a_second_lease_waits_so_its_buffers_are_never_taken_from_a_reader() -> None:
    """A load while another save or load holds the pool (an async save's background write, say) would,
    without the lease, have the first one's give_back free the buffers its threads still read."""
    pool = PinnedPool()
    first_in, release, order = threading.Event(), threading.Event(), []

    def first() -> None:
        with pool.lease():
            view = np.frombuffer(pool.take(4096), dtype=np.uint8)
            view[:] = 1
            first_in.set()
            release.wait(30)
            order.append(("first reads", bool((view == 1).all())))

    def second() -> None:
        first_in.wait(30)
        with pool.lease():
            order.append(("second in", True))
            np.frombuffer(pool.take(4096), dtype=np.uint8)[:] = 2

    a, b = threading.Thread(target=first), threading.Thread(target=second)
    a.start()
    b.start()
    first_in.wait(30)
    b.join(0.3)
    assert b.is_alive() and order == []  # the second waits while the first holds the pool
    release.set()
    a.join(30)
    b.join(30)
    assert order == [("first reads", True), ("second in", True)]
    assert pool._lent == {}  # every lease gave its buffers back on exit
