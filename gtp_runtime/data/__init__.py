"""Training data: Megatron indexed datasets, GPT sampling, the embedded stdlib corpus.

The global batch of step ``s`` has ``lanes x micro_batch`` sequences; every (gtp_remat, dp) pair is
one data lane, CP splits each sequence inside a lane. Modules: :mod:`.indexed` (read and validate
``.idx``/``.bin``), :mod:`.sampler` (Megatron-like samples), :mod:`.corpus` (the default corpus),
:mod:`.source` (what a trainer reads), :mod:`.writer` and :mod:`.prepare` (text to a dataset).
"""

from __future__ import annotations


def lane_slice(lane: int, micro_batch: int) -> slice:
    return slice(lane * micro_batch, (lane + 1) * micro_batch)
