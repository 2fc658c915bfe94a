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


def _one_gpu_rank(fn: object, tmp_path: Path, tag: str) -> dict[str, object]:
    """``fn(str(tmp_path))`` on one NCCL rank; a rank's failure shows the end of its log."""
    from gtp_runtime.launch import RankFailure, log_path, run_local_ranks

    (tmp_path / "work").mkdir()
    try:
        [r] = run_local_ranks(1, fn, (str(tmp_path),), tmp_path / "work", tag=tag, backend="nccl")
    except RankFailure as e:
        log = log_path(tmp_path / "work", tag, 0).read_text(errors="replace")[-5000:]
        raise AssertionError(f"{e}\n{log}") from None
    return r


def test_sync_save_and_load_through_pinned_buffers_are_bit_exact(tmp_path: Path) -> None:
    r = _one_gpu_rank(_round_trip, tmp_path, "pinned")
    assert r == {"exact": True, "pool_grew": False, "pool_used": True, "next_loss_equal": True,
                 "buffers_pinned": True}


def _async_vs_sync(root: str) -> dict[str, object]:
    """An async save of CUDA state takes its statistics on the device, from the live chunks (numpy sees
    only host tensors), and records exactly what a sync save of the same state records."""
    import gtp_runtime.checkpoint.chunk_records as chunk_records
    from gtp_format.check.verify import verify
    from gtp_format.integrity.records import read_records
    from gtp_format.layout.config import ModelConfig, ParallelConfig
    from gtp_format.reader.checkpoint import open_checkpoint
    from gtp_runtime.checkpoint.async_save import AsyncCheckpointer
    from gtp_runtime.checkpoint.io import load_checkpoint, save_checkpoint
    from gtp_runtime.training import TrainConfig, Trainer

    torch.cuda.set_device(0)
    model = ModelConfig(vocab_size=512, hidden=128, num_layers=2, num_heads=4, ffn_hidden=256, seq_length=64)
    cfg = TrainConfig(par=ParallelConfig(), model=model, micro_batch=2, bucket_size=20_000, param_dtype=torch.bfloat16)
    a = Trainer(cfg, device=torch.device("cuda", 0))
    a.train_step()
    numpy_bytes: list[int] = []
    real = chunk_records.element_stats

    def spy(elements, dtype):  # type: ignore[no-untyped-def]
        numpy_bytes.append(int(elements.nbytes))
        return real(elements, dtype)

    chunk_records.element_stats = spy
    try:
        saver = AsyncCheckpointer()
        saver.prepare(a)
        saver.save(a, Path(root) / "async")
        async_numpy = sum(numpy_bytes)
        expect = _state(a)
        a.train_step()  # the step runs while the write is in flight
        saver.close()
        numpy_bytes.clear()
        b = Trainer(cfg, device=torch.device("cuda", 0))
        load_checkpoint(b, Path(root) / "async")
        save_checkpoint(b, Path(root) / "sync")  # the same state, saved sync
    finally:
        chunk_records.element_stats = real
    got = _state(b)
    exact = expect.keys() == got.keys() and all(torch.equal(expect[k].view(torch.uint8), got[k].view(torch.uint8))
                                                for k in expect)
    recs = []
    for kind in ("async", "sync"):
        ckpt = open_checkpoint(Path(root) / kind)
        problems = [p for p in verify(ckpt, data=True).problems if p.severity == "error"]
        r = read_records(ckpt)
        assert r is not None
        recs.append(({k: (v.digest, v.stats) for k, v in r.by_chunk.items()}, problems))
    total = sum(v.numel() * v.element_size() for v in expect.values())
    return {"exact": exact, "async_numpy_small": async_numpy < total // 100, "records_equal": recs[0][0] == recs[1][0],
            "records": len(recs[0][0]) > 0, "verify_async": [p.message for p in recs[0][1]],
            "verify_sync": [p.message for p in recs[1][1]]}


def test_async_save_takes_statistics_on_the_device_and_records_what_sync_does(tmp_path: Path) -> None:
    r = _one_gpu_rank(_async_vs_sync, tmp_path, "async")
    assert r == {"exact": True, "async_numpy_small": True, "records_equal": True, "records": True,
                 "verify_async": [], "verify_sync": []}
