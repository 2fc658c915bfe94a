"""Where each parameter sits in its gradient buffer and bucket: the runtime's rule, without torch.

Inside a buffer params are laid out in reverse model order (the order backward produces their
gradients), each start aligned to :data:`PARAM_ALIGN` elements; a bucket closes after the first
param whose end reaches ``bucket_size`` elements from the bucket start, and is padded to a
multiple of ``lcm(dp_size, BUCKET_PAD)`` so every DP rank owns an equal contiguous slice.

Why here and not in the runtime: ``ckpt reshard`` must know the bucket layout of a topology no
process runs, and the runtime's :class:`~gtp_runtime.buffers.GradBuffer` builds its buffers with
this same function, so the layout a reshard writes is the one a training run at the target
topology expects (``tests/runtime/test_param_layout.py`` compares both for many topologies).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

# The bucket size (elements) gtp_runtime.train's --bucket-size defaults to: the one value every tool
# assumes where a manifest does not record it (Megatron's default, 40M elements) or a command asks for one.
DEFAULT_BUCKET_SIZE = 40_000_000
PARAM_ALIGN = 64
BUCKET_PAD = 64


@dataclass(frozen=True)
class Slot:
    """One param's place in its buffer (buffer-absolute element offsets)."""

    start: int
    end: int
    bucket: int


@dataclass(frozen=True)
class BucketSpan:
    index: int
    start: int
    end: int  # padded end
    numel_unpadded: int

    @property
    def numel(self) -> int:
        return self.end - self.start


def lay_out(numels: Sequence[int], bucket_size: int, dp_size: int) -> tuple[list[Slot], list[BucketSpan], int]:
    """Slots (same order as ``numels``, which is layout order), buckets and the buffer's numel."""
    pad = math.lcm(dp_size, BUCKET_PAD)
    slots: list[Slot] = []
    buckets: list[BucketSpan] = []
    pos = bucket_start = 0
    open_bucket = False

    def close(end: int) -> int:
        b = BucketSpan(len(buckets), bucket_start, bucket_start + math.ceil((end - bucket_start) / pad) * pad,
                       end - bucket_start)
        buckets.append(b)
        return b.end

    for n in numels:
        pos = math.ceil(pos / PARAM_ALIGN) * PARAM_ALIGN
        slots.append(Slot(pos, pos + n, len(buckets)))
        open_bucket = True
        pos += n
        if pos - bucket_start >= bucket_size:
            pos = bucket_start = close(pos)
            open_bucket = False
    if open_bucket:
        pos = close(pos)
    return slots, buckets, pos
