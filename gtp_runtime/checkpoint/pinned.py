"""Pinned host buffers reused by every sync save and load of a process (CUDA state only).

Why: a GPU tensor reaches the disk through host memory, and the kind of host memory decides the
speed. Measured on the lent H200 (``benchmarks/ckpt_io_stages.py``, 8.6 GB of 256 MiB chunks):
``tensor.cpu()``, which DCP's file writer does per item, ran at 1.0 GB/s (each call allocates fresh
pageable memory, the kernel faults every page in, and the driver copies through its own bounce
buffer), where a copy into pinned memory that already exists ran at 24 GB/s; the disk wrote 1.2-1.9
GB/s. So a sync save spent longer moving bytes to the host than writing them. Pinning is itself slow
(``cudaHostAlloc``, 1.5 GB/s there), so the buffers are allocated once and kept: one per writer or
reader thread, each the size of the largest chunk it has had to hold, a few hundred MiB to a few GiB
in all, never the whole checkpoint (that is what ``--async-save`` staging costs, not a sync save).

:meth:`PinnedPool.host_copy` hands back a CPU tensor over exactly the chunk's bytes of a pooled
buffer (``torch.frombuffer``: its storage is the chunk's size, so DCP's writer neither copies it
again with ``.cpu()`` nor clones it for a storage larger than the tensor). The buffer stays the
thread's until that thread asks for its next one: DCP's writer threads serialise an item completely
(the sink has copied its bytes) before they resolve the next item, so a thread never needs two.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch


class PinnedPool:
    """Pinned ``uint8`` buffers lent to one thread at a time and kept for the next save or load
    (ordinary memory where torch has no CUDA: a CPU load reads into them too, so that no chunk
    allocates and page-faults a buffer of its own)."""

    def __init__(self) -> None:
        self._free: list[torch.Tensor] = []
        self._lent: dict[int, torch.Tensor] = {}
        self._lock = threading.Lock()
        self._session = threading.Lock()  # held by the one save or load using the pool (:meth:`lease`)

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(b.numel() for b in self._free) + sum(b.numel() for b in self._lent.values())

    def take(self, nbytes: int) -> memoryview:
        """A pinned buffer of at least ``nbytes`` lent to this thread (the one it held before is given
        back first), as a writable byte view."""
        me = threading.get_ident()
        with self._lock:
            prev = self._lent.pop(me, None)
            if prev is not None:
                self._free.append(prev)
            # by position, never list.remove: that compares tensors with ==, elementwise (a size error
            # for two buffers of different sizes, found on the H200)
            fits = [i for i, b in enumerate(self._free) if b.numel() >= nbytes]
            if fits:
                buf = self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
            else:
                if self._free:  # the largest buffer is too small: replace it rather than keep both
                    self._free.pop(max(range(len(self._free)), key=lambda i: self._free[i].numel()))
                buf = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=torch.cuda.is_available())
            self._lent[me] = buf
        return memoryview(buf.numpy()).cast("B")

    def give_back(self) -> None:
        """Every lent buffer is free again (the end of a save or load: no thread still reads one)."""
        with self._lock:
            self._free.extend(self._lent.values())
            self._lent.clear()

    @contextmanager
    def lease(self) -> Iterator[PinnedPool]:
        """The pool for one sync save or load; every lent buffer is free again on exit.

        One at a time: :meth:`give_back` frees every buffer lent, so a second save or load running
        meanwhile (a load while an async save's background write is in flight, say) would have its
        threads' buffers handed to other threads while they still read them. A second lease waits
        for the first to end instead.
        """
        with self._session:
            try:
                yield self
            finally:
                self.give_back()

    def host_copy(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (a contiguous CUDA tensor) copied into this thread's pinned buffer: a CPU tensor whose
        storage is exactly ``t``'s bytes."""
        n = t.numel() * t.element_size()
        if n == 0:
            return torch.empty(t.shape, dtype=t.dtype)
        view = self.take(n)[:n]
        out = torch.frombuffer(view, dtype=torch.uint8).view(t.dtype).view(t.shape)
        out.copy_(t)  # a DMA from the device into pinned memory; returns when it is done
        return out


POOL = PinnedPool()  # the process's one pool: one sync save or load at a time holds it (PinnedPool.lease)


def exact_storage(t: torch.Tensor) -> torch.Tensor:
    """``t`` (a contiguous CPU tensor) as a tensor over the same memory whose storage is exactly its
    bytes: no copy (``torch.frombuffer`` over a byte view of ``t``, which it keeps alive)."""
    raw = t.detach().reshape(-1).view(torch.uint8).numpy()
    return torch.frombuffer(raw, dtype=torch.uint8).view(t.dtype).view(t.shape)


def host_for_write(t: Any) -> Any:
    """What DCP's writer should serialise for ``t``: a pinned host copy of a contiguous CUDA tensor; a
    contiguous CPU view of a larger storage (a chunk of a parameter or optimizer buffer) as the same
    memory with a storage of its own size (:func:`exact_storage`); anything else as it is.

    Why the CPU case: DCP's writer clones every tensor whose storage is larger than the tensor (so
    that ``torch.save`` does not write the whole storage), and every chunk of a GTP-sharded buffer is
    such a view. Measured on the 2-core machine (2 gloo ranks, hidden 1024, 4 layers, 1.14 GB a
    rank, ``py-spy`` over 12 saves): the clones were 37% of a sync save's CPU samples, more than
    ``torch.save`` (25%) and the sink's CRC-32C and staging copy (17%) together."""
    if not isinstance(t, torch.Tensor):
        return t
    if t.is_cuda and t.is_contiguous():
        return POOL.host_copy(t.detach())
    if (t.device.type == "cpu" and t.is_contiguous() and t.numel()
            and t.untyped_storage().nbytes() != t.numel() * t.element_size()):
        return exact_storage(t)
    return t
