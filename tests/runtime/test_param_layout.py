"""The torch-free layout (gtp_format.layout.params) equals what the runtime builds, for many topologies.

``ckpt reshard`` writes the bucket layout of a topology no process runs; if it differed from the
runtime's by one element, ``--load`` of the result would read state into the wrong params.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from fake_groups import fake_groups

from gtp_format.layout.config import ModelConfig, ParallelConfig
from gtp_format.layout.params import buffer_layouts, model_params
from gtp_runtime.buffers import build_buffers
from gtp_runtime.checkpoint.manifest import buffer_layout
from gtp_runtime.model import GPTModel

DENSE = ModelConfig(hidden=32, num_layers=2, num_heads=4, ffn_hidden=64, seq_length=16, vocab_size=100)
MOE = ModelConfig(hidden=32, num_layers=2, num_heads=4, ffn_hidden=48, seq_length=16, num_experts=2, vocab_size=96)
PARS = [ParallelConfig(), ParallelConfig(cp=2, gtp_remat=2, dp=2, fold_cp=True), ParallelConfig(tp=2, gtp_remat=2),
        ParallelConfig(cp=4, fold_cp=True), ParallelConfig(tp=2, cp=2, fold_cp=True, expert_gtp_remat=2),
        ParallelConfig(gtp_remat=3, dp=2), ParallelConfig(tp=2, cp=2, dp=2, expert_gtp_remat=4)]


@pytest.mark.parametrize("bucket_size", [1, 3000, 10**8])
@pytest.mark.parametrize("model", [DENSE, MOE], ids=["dense", "moe"])
@pytest.mark.parametrize("par", PARS, ids=[p.describe() + f"-eg{p.expert_gtp_remat}" for p in PARS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_offline_layout_equals_runtime(par: ParallelConfig, model: ModelConfig, bucket_size: int,
                                       dtype: torch.dtype) -> None:
    groups = fake_groups(par, 0)
    gpt = GPTModel(model, par, groups, dtype=dtype)
    assert [p.name for p in model_params(model)] == [n for n, _ in gpt.named_parameters()]
    runtime = buffer_layout(SimpleNamespace(buffers=build_buffers(gpt, groups, bucket_size)), groups)
    assert buffer_layouts(model, par, bucket_size, str(dtype)) == runtime
