"""An embedded deterministic corpus and the global batch of every step.

No download: the corpus is generated from a fixed text so every run, rank and machine sees the
same bytes. Tokens are bytes (vocab 256). The global batch of step ``s`` has
``lanes x micro_batch`` sequences; every (gtp_remat, dp) pair is one data lane, CP splits each
sequence inside a lane.
"""

from __future__ import annotations

import functools
import math

import torch

_TEXT = (
    "Context parallel ranks split every sequence; GTP ranks split every weight. "
    "Folding the CP axis into the weight group lets CP peers shard dense weights too, "
    "so each rank keeps a smaller shard and its gradient. The checkpoint must then keep "
    "every peer's optimizer state under its own key, or all but one of them are lost. "
    "A careful engineer proves it: save, load, compare, bit for bit, on every topology. "
)


@functools.lru_cache(maxsize=8)
def corpus(vocab_size: int = 256, repeats: int = 64) -> torch.Tensor:
    """The corpus as token ids; cached (building it from a Python list cost ~2 ms of every GPU step).
    Callers only slice it, never write to it."""
    data = torch.tensor(list((_TEXT * repeats).encode()), dtype=torch.long)
    return data % vocab_size


def global_batch(step: int, num_seqs: int, seq_length: int, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and next-token labels, each [num_seqs, seq_length], for one step."""
    # 64 repeats (25.8k tokens) serve every sequence shorter than that, as always; longer ones get
    # a corpus of twice their length (a shorter one silently gave truncated windows at 32768).
    repeats = 64 if 64 * len(_TEXT) > seq_length + 1 else math.ceil(2 * (seq_length + 1) / len(_TEXT))
    data = corpus(vocab_size, repeats)
    n = data.numel() - seq_length - 1
    # A fixed stride walks the corpus without randomness and rarely repeats a window.
    starts = [((step * num_seqs + i) * 97) % n for i in range(num_seqs)]
    windows = torch.stack([data[s : s + seq_length + 1] for s in starts])
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


def lane_slice(lane: int, micro_batch: int) -> slice:
    return slice(lane * micro_batch, (lane + 1) * micro_batch)
