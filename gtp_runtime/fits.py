"""Refuse, before any rank builds a model, model and world sizes this machine cannot hold.

The launcher's sizes are declared numbers: ``--num-layers 100000`` with a tiny hidden size built
layer after layer for minutes (3 GB over the process tree, no error line) before anything failed.
:func:`fit_problem` compares a *lower bound* of what the run needs with what the machine has, so
it never refuses a run that could fit:

* every local rank is a process that imports torch (240 MB resident at start on the CPU test
  machine; counted as :data:`RANK_BYTES`, about half) and builds every layer's modules, parameters,
  gradients and optimizer state objects (146 KB a layer and rank, measured with ``--hidden 8`` from
  50 to 1000 layers; counted as :data:`LAYER_BYTES`, under half);
* the weights are held at least once over the ranks, in the parameter dtype: this host's share
  (``local / world`` of them) must fit in its memory, host and GPU together.

Besides, ``--num-layers`` is at most :data:`MAX_LAYERS`: a build and a step walk the layers in
Python one by one (6 s a CPU step at 1000 layers), so a depth past every published model is time
without bound, whatever the memory.
"""

from __future__ import annotations

import os

from gtp_format.layout.config import ModelConfig
from gtp_format.layout.params import param_count

RANK_BYTES = 128 << 20
LAYER_BYTES = 64 << 10
MAX_LAYERS = 4096
"""32 times the deepest published GPT runs (96-128 layers)."""


def host_memory() -> int:
    """Physical memory of this host in bytes (0 when the system does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB"


def fit_problem(model: ModelConfig, world: int, local: int, param_bytes: int, host: int, gpu: int = 0) -> str | None:
    """Why ``local`` ranks (of ``world``) of ``model`` cannot run on a host of ``host`` bytes of
    memory and ``gpu`` bytes of GPU memory, or None. One line, naming the flags."""
    if model.num_layers > MAX_LAYERS:
        return (f"--num-layers {model.num_layers} is over {MAX_LAYERS} (32 times the deepest published GPTs; every "
                "layer is built and stepped one by one); pick fewer layers")
    params = param_count(model)
    share = params * param_bytes * local // max(1, world)
    per_rank = RANK_BYTES + model.num_layers * LAYER_BYTES
    if host and (local * per_rank > host or share > host + gpu):
        need = max(local * per_rank, share)
        return (f"--num-layers {model.num_layers}, --hidden {model.hidden}, --ffn-hidden {model.ffn_hidden}, "
                f"--vocab-size {model.vocab_size} on {local} local ranks (--nproc-per-node): {params} parameters "
                f"need at least "
                f"{_gib(need)} of memory, and this machine has {_gib(host)}"
                + (f" and {_gib(gpu)} of GPU memory" if gpu else "") + "; pick smaller sizes or fewer ranks")
    return None
