"""Run a function on N real gloo ranks (spawned processes) and collect each rank's result."""

from __future__ import annotations

import os
import pickle
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from gtp_runtime.train import free_port


def _entry(rank: int, world: int, port: int, out_dir: str, fn: Callable[..., Any], args: tuple) -> None:
    import torch

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result: Any = ("ok", fn(*args))
    except BaseException as e:  # noqa: BLE001 - report every failure to the parent
        result = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
    with open(os.path.join(out_dir, f"{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
    dist.destroy_process_group()


def run_ranks(world: int, fn: Callable[..., Any], *args: Any) -> list[Any]:
    """``fn(*args)`` on every rank; returns the results in rank order, raising on any failure."""
    with tempfile.TemporaryDirectory() as out:
        # A fork server that imported torch once: each rank is a fresh process, without 8 torch imports.
        mp.set_forkserver_preload(["torch", "torch.distributed", "gtp_runtime.training"])
        mp.start_processes(_entry, args=(world, free_port(), out, fn, args), nprocs=world, start_method="forkserver")
        results = []
        for r in range(world):
            with open(os.path.join(out, f"{r}.pkl"), "rb") as f:
                status, value = pickle.load(f)  # our own child's output, in our own temp folder
            if status != "ok":
                raise AssertionError(f"rank {r} failed: {value}")
            results.append(value)
        return results
