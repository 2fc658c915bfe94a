"""Rank bodies for tests/runtime/test_launch.py (module-level, so the launcher can pickle them)."""

from __future__ import annotations

import os
import time

import torch.distributed as dist


def whoami(extra: str) -> tuple[int, int, str, str | None]:
    t = __import__("torch").ones(1) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    print("rank output that must stay off the console", flush=True)
    return dist.get_rank(), int(t.item()), extra, os.environ.get("LAUNCH_TEST_VAR")


def fail_on(rank: int, how: str) -> int:
    """Rank ``rank`` fails ``how``; the others wait in a collective it never joins."""
    if dist.get_rank() == rank:
        if how == "raise":
            raise RuntimeError("boom on purpose\nsecond line")
        if how == "config":
            from gtp_format.layout.config import ConfigError

            raise ConfigError("--cp 3 does not divide the world; pass --dp")
        if how == "exit":
            print("last words before dying", flush=True)
            os._exit(17)
        if how == "hang":
            time.sleep(3600)
    dist.barrier()
    return dist.get_rank()


def sleep_forever() -> None:
    time.sleep(3600)


def tensors(n: int) -> dict:
    """A result made of many tensors, returned by a rank that exits right after (as every rank does)."""
    import torch

    base = torch.arange(n, dtype=torch.float32) + dist.get_rank()
    return {"rank": dist.get_rank(), "t": [base[i:i + 100].clone() for i in range(0, n, 100)]}


def train_with_gather_batch(batch: int, steps: int, keep_last: int = 0,
                            evaluate: bool = False) -> tuple[list[float], list[list[float]], list[tuple[str, int]]]:
    """Folded cp2 training with ``sharding.GATHER_BATCH = batch`` and ``KEEP_LAST = keep_last``
    (and an evaluation after each step): the losses, every param's values, and the weight
    gathers' starts and uses in order."""
    import torch

    from gtp_format.layout.config import ModelConfig, ParallelConfig
    from gtp_runtime import sharding
    from gtp_runtime.training import TrainConfig, Trainer

    sharding.GATHER_BATCH, sharding.KEEP_LAST = batch, keep_last
    model = ModelConfig(vocab_size=64, hidden=32, num_layers=3, num_heads=4, ffn_hidden=64, seq_length=16)
    t = Trainer(TrainConfig(par=ParallelConfig(cp=2, fold_cp=True), model=model, micro_batch=2))
    comm = t.model.gtp_comm
    events: list[tuple[str, int]] = []
    start, gather = comm._start_gather, comm.gather

    def logged_start(shard: torch.Tensor, async_op: bool):  # noqa: ANN202 - the wrapped method's result
        events.append(("start", shard.gtp_index))
        return start(shard, async_op)

    def logged_gather(shard: torch.Tensor, step: int, keep: bool = False) -> torch.Tensor:
        out = gather(shard, step, keep)  # waits for its own gather and starts those ahead
        events.append(("use", shard.gtp_index))
        return out

    comm._start_gather, comm.gather = logged_start, logged_gather
    losses = []
    for _ in range(steps):
        losses.append(t.train_step().loss)
        if evaluate:
            losses.append(t.evaluate(1))
            with torch.no_grad():  # shards change after the evaluation (as a checkpoint load would)
                for p in t.model.parameters():
                    p.mul_(0.999)
    params = [p.detach().double().flatten().tolist() for p in t.model.parameters()]
    return losses, params, events
