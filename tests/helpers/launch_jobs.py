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
