"""Real checkpoints for the reshard tests: trained and saved by the runtime on gloo ranks.

Each source trains two steps (so Adam moments are non-zero and differ per element) and saves.
:func:`live_state` loads a checkpoint into a trainer at its own topology and reports every
parameter slot's state straight from the optimizer: the brute-force reference the offline
per-parameter view must reproduce.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
from dist_harness import run_ranks

from gtp_format.layout.config import ModelConfig, ParallelConfig
from gtp_runtime.checkpoint.io import load_checkpoint, save_checkpoint
from gtp_runtime.collectives import all_gather_dim0
from gtp_runtime.training import TrainConfig, Trainer

DENSE = ModelConfig(vocab_size=96, hidden=32, num_layers=2, num_heads=4, ffn_hidden=48, seq_length=16)
MOE = ModelConfig(vocab_size=96, hidden=32, num_layers=2, num_heads=4, ffn_hidden=48, seq_length=16, num_experts=2)
BUCKET = 3000


def config(par: ParallelConfig, model: ModelConfig, bf16: bool, bucket: int = BUCKET) -> TrainConfig:
    return TrainConfig(par=par, model=model, micro_batch=1, bucket_size=bucket,
                       param_dtype=torch.bfloat16 if bf16 else torch.float32)


def _train_and_save(par: ParallelConfig, model: ModelConfig, bf16: bool, root: str, layout: str) -> None:
    t = Trainer(config(par, model, bf16))
    for _ in range(2):
        t.train_step()
    save_checkpoint(t, root, layout=layout)


def make_source(root: Path, par: ParallelConfig, model: ModelConfig = DENSE, bf16: bool = False,
                layout: str = "torch_dist") -> Path:
    run_ranks(par.world_size, _train_and_save, par, model, bf16, str(root), layout)
    return root


def _live(par: ParallelConfig, model: ModelConfig, bf16: bool, root: str, bucket: int) -> list[tuple]:
    t = Trainer(config(par, model, bf16, bucket))
    load_checkpoint(t, root)
    out = []
    for buf, states in zip(t.optimizer.buffers, t.optimizer.state):
        for b, st in zip(buf.buckets, states):
            full = {k: all_gather_dim0(v.clone(), buf.dp_group) for k, v in st.tensors().items()}
            for s in b.slots:
                spec = s.param.spec
                rows = spec.valid_rows
                tail = spec.local_shape[1:]
                n = rows * math.prod(tail)
                vals = {k: v[s.start - b.start: s.start - b.start + n].reshape(rows, *tail).numpy().copy()
                        for k, v in full.items()}
                vals["weight"] = s.param.data[:rows].float().numpy().copy() if not bf16 else \
                    s.param.data[:rows].view(torch.int16).numpy().copy()
                out.append((s.name, spec.tp_rank if spec.tp_mode else 0, spec.shard_rank, vals))
    return out


def live_state(root: Path, par: ParallelConfig, model: ModelConfig = DENSE, bf16: bool = False,
               bucket: int = BUCKET) -> list[tuple]:
    """(name, tp_rank, shard_rank, {state: valid rows}) for every slot of every rank."""
    return [x for r in run_ranks(par.world_size, _live, par, model, bf16, str(root), bucket) for x in r]


def bits(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint8)
