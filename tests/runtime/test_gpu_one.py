"""One CUDA device: the optimizer's CUDA-only paths on a single NCCL rank. Skipped without CUDA
(CI has none); run on the lent GPU machine with ``pytest -m gpu``.

The two-GPU file (test_gpu.py) covers these paths too, but a one-GPU machine is lent more often;
here they are checked wherever one GPU is."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

REPO = Path(__file__).resolve().parents[2]
SMALL = ["--hidden", "128", "--ffn-hidden", "256", "--num-heads", "4", "--seq-length", "128", "--vocab-size", "512",
         "--num-layers", "2"]


def _stats_rank() -> tuple[list[float], list[float]]:
    """Grad statistics of one step, bucket-interleaved (the CUDA step) and in one pass (the CPU path)."""
    from gtp_format.layout.config import ModelConfig, ParallelConfig
    from gtp_runtime.training import TrainConfig, Trainer

    model = ModelConfig(vocab_size=512, hidden=128, num_layers=2, num_heads=4, ffn_hidden=256, seq_length=128)
    t = Trainer(TrainConfig(par=ParallelConfig(), model=model, micro_batch=2, bucket_size=20_000),
                device=torch.device("cuda", 0))
    t._forward_backward(1)
    assert sum(len(b.buckets) for b in t.optimizer.buffers) > 3  # several buckets are interleaved
    interleaved = t.optimizer._reduce_and_stats_cuda()
    one_pass = t.optimizer._grad_stats_tensor()
    return interleaved.tolist(), one_pass.tolist()


def test_interleaved_grad_stats_equal_one_pass_bit_for_bit() -> None:
    from gtp_runtime.launch import run_local_ranks

    [(interleaved, one_pass)] = run_local_ranks(1, _stats_rank, (), tag="stats", backend="nccl")
    assert interleaved == one_pass
    assert interleaved[0] > 0


def _train(args: list[str], log: Path) -> list[float]:
    r = subprocess.run([sys.executable, "-m", "gtp_runtime.train", "--nproc-per-node", "1", "--device", "cuda",
                        "--bf16", "--steps", "4", *SMALL, *args, "--log-json", str(log)], cwd=REPO, capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return [row["loss"] for row in json.loads(log.read_text())["rows"]]


def test_muon_train_step_updates_with_muon_one_gpu(tmp_path: Path) -> None:
    """As test_gpu.py's two-GPU case: a plain Muon run follows the parity path (which calls
    ``step_after_reduce``), not AdamW's fused device-side update."""
    muon = _train(["--optimizer", "muon"], tmp_path / "muon.json")
    parity = _train(["--optimizer", "muon", "--check-reference", "--reference-tol", "3e-2", "--reference-param-tol",
                     "0.25"], tmp_path / "parity.json")
    adam = _train([], tmp_path / "adam.json")
    same = max(abs(a - b) for a, b in zip(muon, parity, strict=True))
    other = max(abs(a - b) for a, b in zip(adam, parity, strict=True))
    assert same <= 1e-4 * abs(muon[0])
    assert other > 10 * max(same, 1e-7)


# As test_gpu.py's two-GPU parity (its tolerances and their reasons): bf16 gradients and losses within
# 3e-2 of each tensor's scale of the fp32 reference, params after Adam within 0.15. One GPU checks the
# fused regions' numerics; the collectives around them need test_gpu.py's two GPUs.
BF16_PARITY = ["--check-reference", "--reference-tol", "3e-2", "--reference-param-tol", "0.15"]


@pytest.mark.parametrize("fused", ["none", "compile"])
def test_bf16_parity_one_gpu(tmp_path: Path, fused: str) -> None:
    log = tmp_path / "log.json"
    _train([*BF16_PARITY, "--fused", fused], log)
    rows = json.loads(log.read_text())["rows"]
    assert rows and all(abs(x["loss"] - x["ref_loss"]) <= 3e-2 * x["ref_loss"] for x in rows)
    assert all(abs(x["zeros"] - x["ref_zeros"]) <= 0.01 * max(x["ref_zeros"], 1) for x in rows)


def test_compiled_regions_match_unfused_bf16_one_gpu(tmp_path: Path) -> None:
    """The compiled path (the CUDA default) trains like the unfused one, step by step; a wrong fused
    gradient shows in the losses from step 2 on."""
    logs = {}
    for name in ("none", "compile"):
        _train(["--fused", name], tmp_path / f"{name}.json")
        logs[name] = json.loads((tmp_path / f"{name}.json").read_text())["rows"]
    for a, b in zip(logs["none"], logs["compile"], strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-2 * abs(a["loss"])
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 5e-2 * abs(a["grad_norm"])


def test_default_on_cuda_is_compiled(tmp_path: Path) -> None:
    """No --fused on CUDA gives the compiled path: its losses equal an explicit --fused compile run's."""
    default = _train([], tmp_path / "default.json")
    compiled = _train(["--fused", "compile"], tmp_path / "compile.json")
    assert default == compiled
