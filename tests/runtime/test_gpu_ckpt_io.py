"""One CUDA device: the sync save and the load move bytes through the reused pinned buffers
(gtp_runtime/checkpoint/pinned.py) and stay bit-exact. Skipped without CUDA (CI has none); run on
the lent GPU machine with ``pytest -m gpu``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _state(t: object) -> dict[str, torch.Tensor]:
    from gtp_runtime.checkpoint.io import rank_state

    return {f"{k}@{o}": v.detach().cpu().clone() for k, c in rank_state(t, integrity=False).items()  # type: ignore[arg-type]
            for o, v in c.chunks.items()}


def _round_trip(root: str) -> dict[str, object]:
    from gtp_format.layout.config import ModelConfig, ParallelConfig
    from gtp_runtime.checkpoint import pinned
    from gtp_runtime.checkpoint.io import load_checkpoint, save_checkpoint
    from gtp_runtime.training import TrainConfig, Trainer

    torch.cuda.set_device(0)
    model = ModelConfig(vocab_size=512, hidden=128, num_layers=2, num_heads=4, ffn_hidden=256, seq_length=64)
    cfg = TrainConfig(par=ParallelConfig(), model=model, micro_batch=2, bucket_size=20_000, param_dtype=torch.bfloat16)
    a = Trainer(cfg, device=torch.device("cuda", 0))
    a.train_step()
    save_checkpoint(a, Path(root) / "one", writer_threads=3)
    after_first = pinned.POOL.nbytes
    a.train_step()
    save_checkpoint(a, Path(root) / "two", writer_threads=3)
    after_second = pinned.POOL.nbytes
    b = Trainer(cfg, device=torch.device("cuda", 0))
    load_checkpoint(b, Path(root) / "two")
    sa, sb = _state(a), _state(b)
    exact = sa.keys() == sb.keys() and all(torch.equal(sa[k].view(torch.uint8), sb[k].view(torch.uint8)) for k in sa)
    la, lb = a.train_step().loss, b.train_step().loss
    return {"exact": exact, "pool_grew": after_second > after_first, "pool_used": after_first > 0,
            "next_loss_equal": float(la) == float(lb), "buffers_pinned": all(
                buf.is_pinned() for buf in pinned.POOL._free)}


def test_sync_save_and_load_through_pinned_buffers_are_bit_exact(tmp_path: Path) -> None:
    from gtp_runtime.launch import RankFailure, log_path, run_local_ranks

    (tmp_path / "work").mkdir()
    try:
        [r] = run_local_ranks(1, _round_trip, (str(tmp_path),), tmp_path / "work", tag="pinned", backend="nccl")
    except RankFailure as e:
        log = log_path(tmp_path / "work", "pinned", 0).read_text(errors="replace")[-5000:]
        raise AssertionError(f"{e}\n{log}") from None
    assert r == {"exact": True, "pool_grew": False, "pool_used": True, "next_loss_equal": True,
                 "buffers_pinned": True}
