"""Small checkpoints saved by the runtime with chunk records, for the integrity tests (runtime and CLI).

Saved on 2 gloo ranks (GTP_remat 2; ``ffn_hidden`` 48 gives fc1 16 tail-padding rows per TP part):
``dist`` (torch_dist), ``st`` (safetensors), ``nan`` (torch_dist, from a state holding a NaN in one
weight on rank 0 and an Inf in every rank's first ``exp_avg_sq`` element).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from dist_harness import run_ranks

from gtp_format.layout.config import ModelConfig, ParallelConfig
from gtp_runtime.checkpoint.io import save_checkpoint
from gtp_runtime.training import TrainConfig, Trainer

MODEL = ModelConfig(hidden=32, num_layers=1, num_heads=4, ffn_hidden=48, seq_length=16)
PAR = ParallelConfig(gtp_remat=2)
NAN_WEIGHT = "decoder.layers.0.mlp.linear_fc2.weight"


def save_one(root: str, layout: str, poison: bool) -> None:
    """One rank's part of a save (run by :func:`dist_harness.run_ranks`)."""
    t = Trainer(TrainConfig(par=PAR, model=MODEL, micro_batch=1, bucket_size=100000))
    t.iteration = 1
    if poison:  # a diverged run: NaN in a weight on rank 0, Inf in an Adam moment on every rank
        with torch.no_grad():
            if torch.distributed.get_rank() == 0:
                dict(t.model.named_parameters())[NAN_WEIGHT].view(-1)[3] = math.nan
            for states in t.optimizer.state:
                for st in states:
                    st.tensors()["exp_avg_sq"].view(-1)[0] = math.inf
    save_checkpoint(t, root, layout=layout)


def save_all(base: Path) -> dict[str, Path]:
    out = {}
    for name, layout, poison in (("dist", "torch_dist", False), ("st", "safetensors", False),
                                 ("nan", "torch_dist", True)):
        run_ranks(PAR.world_size, save_one, str(base / name), layout, poison)
        out[name] = base / name / "iter_0000001"
    return out
