"""Writer election and key layout, proven offline for many topologies: every chunk of every key
has exactly one writer (no gap, no duplicate), and the pre-fix key scheme really collides."""

from __future__ import annotations

import itertools
import math

import pytest

from gtp_format.layout.config import ModelConfig, ParallelConfig
from gtp_runtime.checkpoint.state import bucket_numel_state, model_state, optimizer_state
from gtp_runtime.groups import offline_groups
from gtp_runtime.model import GPTModel
from gtp_runtime.optimizer import DistributedAdam

MODEL = ModelConfig(hidden=32, num_layers=2, num_heads=4, ffn_hidden=64, seq_length=16, vocab_size=64)
MOE = ModelConfig(hidden=32, num_layers=2, num_heads=4, ffn_hidden=64, seq_length=16, vocab_size=64,
                  num_experts=2)

TOPOLOGIES = [
    ParallelConfig(cp=2, fold_cp=True),
    ParallelConfig(cp=2, dp=2, fold_cp=True),
    ParallelConfig(cp=2, gtp_remat=2, dp=2, fold_cp=True),
    ParallelConfig(cp=2, gtp_remat=2, dp=2),
    ParallelConfig(tp=2, cp=2, fold_cp=True),
    ParallelConfig(tp=2, cp=2, gtp_remat=2, fold_cp=True),
    ParallelConfig(cp=4, dp=2, fold_cp=True),
    ParallelConfig(tp=2, gtp_remat=2, dp=2),
    ParallelConfig(gtp_remat=3, dp=2),
]


def _all_chunks(par: ParallelConfig, model_cfg: ModelConfig, aliased: bool = False) -> dict[str, list]:
    """key -> [(offsets, sizes, writer rank)] over every rank, as DCP would receive them."""
    out: dict[str, list] = {}
    for rank in range(par.world_size):
        groups = offline_groups(par, rank)
        model = GPTModel(model_cfg, par, groups)
        opt = DistributedAdam(model, groups, bucket_size=2500)
        sd = {**model_state(model, groups, for_load=False), **optimizer_state(opt, groups, aliased=aliased),
              **bucket_numel_state(opt, groups, for_load=False)}
        for key, chunks in sd.items():
            entry = out.setdefault(key, [])
            entry.append(("shape", chunks.global_shape))
            for off, t in chunks.chunks.items():
                entry.append((off, tuple(t.shape), rank))
    return out


def _coverage_problems(key: str, entries: list) -> list[str]:
    shapes = {e[1] for e in entries if e[0] == "shape"}
    assert len(shapes) == 1, f"{key}: ranks disagree on the global shape {shapes}"
    shape = shapes.pop()
    boxes = [e for e in entries if e[0] != "shape"]
    problems = []
    volume = sum(math.prod(s) for _, s, _ in boxes)
    if volume != math.prod(shape):
        problems.append(f"{key}: chunks cover {volume} of {math.prod(shape)} elements")
    for (o1, s1, r1), (o2, s2, r2) in itertools.combinations(boxes, 2):
        if all(a < c + d and c < a + b for a, b, c, d in zip(o1, s1, o2, s2)):
            problems.append(f"{key}: chunk {o1} of rank {r1} overlaps chunk {o2} of rank {r2}")
            break
    return problems


@pytest.mark.parametrize("par", TOPOLOGIES, ids=lambda p: p.describe())
def test_every_chunk_has_exactly_one_writer(par: ParallelConfig) -> None:
    chunks = _all_chunks(par, MODEL)
    problems = [p for key, entries in chunks.items() for p in _coverage_problems(key, entries)]
    assert not problems, problems[:5]
    folded = [k for k in chunks if ".cp_rank_" in k]
    assert bool(folded) == par.fold_cp


def test_moe_expert_keys_do_not_alias() -> None:
    """Expert shards vary with the expert-GTP rank; their keys must keep them apart."""
    par = ParallelConfig(cp=2, dp=2, fold_cp=True, expert_gtp_remat=2)
    chunks = _all_chunks(par, MOE)
    problems = [p for key, entries in chunks.items() for p in _coverage_problems(key, entries)]
    assert not problems, problems[:5]


def test_prefix_keys_collide_between_cp_peers() -> None:
    """Without .cp_rank_{i}, both CP peers offer the same key and offset: DCP keeps one."""
    par = ParallelConfig(cp=2, gtp_remat=2, dp=2, fold_cp=True)
    chunks = _all_chunks(par, MODEL, aliased=True)
    dupes = [k for k, entries in chunks.items() if k.startswith("optimizer.") and
             any("overlaps" in p for p in _coverage_problems(k, entries))]
    assert dupes, "the pre-fix key scheme should alias CP peers"
