"""Run a function on N real gloo ranks and collect each rank's result, through the project's launcher.

A failure becomes an ``AssertionError`` naming the rank, with that rank's traceback from its log
(the launcher keeps tracebacks off the console; a test report is where they belong).
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from typing import Any

from gtp_runtime.launch import RankFailure, log_path, run_local_ranks

PRELOAD = ("torch", "torch.distributed", "torch.distributed.checkpoint", "gtp_runtime.training",
           "gtp_runtime.checkpoint.io", "torch.nn.attention.bias",  # CP attention on CPU (torch._dynamo)
           "warm_stats")  # the save's statistics loop (numba)


def run_ranks(world: int, fn: Callable[..., Any], *args: Any) -> list[Any]:
    """``fn(*args)`` on every rank; returns the results in rank order, raising on any failure."""
    work = tempfile.mkdtemp(prefix="dist-harness-")
    try:
        return run_local_ranks(world, fn, args, work, "rank", preload=PRELOAD)
    except RankFailure as e:
        try:
            log = log_path(work, "rank", e.rank).read_text(errors="replace")[-6000:]
        except OSError:
            log = ""
        raise AssertionError(f"rank {e.rank} failed: {e}\n--- its log\n{log}") from None
    finally:
        shutil.rmtree(work, ignore_errors=True)
