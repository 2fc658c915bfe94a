"""Host staging for an async save: this rank's chunks copied into buffers allocated once.

Why allocated once: PyTorch DCP's ``async_save`` with its pinned ``DefaultStager`` allocates its
pinned buffers anew on every save, and pinning (``cudaHostAlloc``) is the slow part: measured on an
H200, 17 GB staged in 5.8-7.2 s (2.4-3.0 GB/s) where a copy into pinned memory that
already exists runs at 55 GB/s. Here the first save allocates one buffer per chunk (pinned when the
chunks live on a GPU, ordinary memory on CPU) and every later save copies into the same buffers,
so the staging memory is the rank's checkpoint bytes, once, and does not grow over saves.

Why one buffer per chunk rather than one flat buffer with views: DCP's file writer serialises a
tensor whose storage is larger than the tensor by cloning it first (``torch.save`` of a view would
write the whole storage), so views into a flat buffer would cost a second copy per save.

CUDA: the copies run on a side stream that first waits for the training stream (so they see the
finished optimizer step), ``non_blocking`` into pinned memory, and :meth:`Staging.stage` returns once
an event recorded after the last copy has completed: from then on the optimizer may update the
parameters again. CPU: a plain copy; nothing is asynchronous about it.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from gtp_runtime.checkpoint.dcp_chunks import Chunks
from gtp_runtime.checkpoint.errors import CheckpointError

Layout = tuple[tuple[str, tuple[int, ...], tuple[int, ...], torch.dtype, str], ...]


def _layout(sd: dict[str, Any]) -> Layout:
    return tuple((k, off, tuple(t.shape), t.dtype, t.device.type)
                 for k, c in sd.items() for off, t in c.chunks.items())


class Staging:
    """Buffers for one rank's state dict of :class:`Chunks`, allocated on the first :meth:`stage`.

    ``budget``: the most bytes the buffers may take (``--async-save-staging``); ``None`` means
    the rank's checkpoint bytes. A state dict that needs more is refused in one line on every rank
    before anything is allocated.
    """

    def __init__(self, budget: int | None = None) -> None:
        self.budget = budget
        self._layout: Layout | None = None
        self._bufs: dict[str, Chunks] = {}
        self._stream: Any = None
        self._first: dict[str, dict[Any, torch.Tensor]] | None = None  # the stale_staging fault's first state

    @property
    def nbytes(self) -> int:
        """Bytes held by the staging buffers (what the repeated-save test watches)."""
        return sum(t.numel() * t.element_size() for c in self._bufs.values() for t in c.chunks.values())

    def _allocate(self, sd: dict[str, Any], group: Any) -> None:
        need = sum(t.numel() * t.element_size() for c in sd.values() for t in c.chunks.values())
        worst = torch.tensor([need], dtype=torch.int64)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=group)
        if self.budget is not None and int(worst.item()) > self.budget:
            raise CheckpointError(
                f"--async-save-staging {self.budget} bytes is below the {int(worst.item())} bytes the largest "
                f"rank's checkpoint needs; raise it to at least that or save without --async-save")
        for k, c in sd.items():
            out = Chunks(c.global_shape, c.dtype)
            for off, t in c.chunks.items():
                pin = t.device.type == "cuda"
                out.chunks[off] = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
            self._bufs[k] = out
        self._layout = _layout(sd)

    def reserve(self, sd: dict[str, Any], group: Any) -> None:
        """Allocate the buffers for ``sd``'s layout now, before the first save (collective, like the
        first :meth:`stage`). Measured on an H200 (docs/performance.md): pinning 24.5 GiB took the
        first save 13.1 s of blocking, the later ones 0.48 s; reserved at the start of the run, that
        once-only cost is paid before training starts instead of inside the first save's step."""
        if self._layout is None:
            self._allocate(sd, group)

    def stage(self, sd: dict[str, Any], group: Any) -> dict[str, Chunks]:
        """Copy every chunk of ``sd`` into the staging buffers; return the staged state dict.

        When this returns the copies are complete: the live tensors may change. ``group``: a gloo
        group of every rank, idle now, for the budget check on the first call.
        """
        stale = os.environ.get("GTP_FAULT_INJECT") == "stale_staging"  # io.fault_mode: the first save's state again
        if self._layout is None:
            self._allocate(sd, group)
        elif stale and self._first is not None:
            with torch.no_grad():  # the first save's state, whole (the buffers are also the write's staging)
                for k, chunks in self._first.items():
                    for off, t in chunks.items():
                        self._bufs[k].chunks[off].copy_(t)
            return self._bufs
        elif _layout(sd) != self._layout:
            raise CheckpointError("the state to save changed shape since the first async save (another bucket "
                                  "layout?); staging buffers are sized once per run")
        cuda = [t for c in sd.values() for t in c.chunks.values() if t.device.type == "cuda"]
        if cuda:
            self._stage_cuda(sd, cuda[0].device)
        else:
            with torch.no_grad():
                for k, c in sd.items():
                    for off, t in c.chunks.items():
                        self._bufs[k].chunks[off].copy_(t)
        if stale and self._first is None:
            self._first = {k: {off: t.clone() for off, t in c.chunks.items()} for k, c in self._bufs.items()}
        return self._bufs

    def _stage_cuda(self, sd: dict[str, Any], device: torch.device) -> None:
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=device)
        self._stream.wait_stream(torch.cuda.current_stream(device))
        with torch.no_grad(), torch.cuda.stream(self._stream):
            for k, c in sd.items():
                for off, t in c.chunks.items():
                    self._bufs[k].chunks[off].copy_(t, non_blocking=t.device.type == "cuda")
        done = torch.cuda.Event()
        done.record(self._stream)
        done.synchronize()
