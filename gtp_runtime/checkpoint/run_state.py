"""The run state a checkpoint carries beside the tensors: lr schedule and data position.

Megatron keeps both in ``common.pt`` (``opt_param_scheduler``, ``args.consumed_train_samples``);
we keep them in ``gtp_manifest.json`` so that ``ckpt inspect`` shows them without pickle or
torch. One function, :func:`run_state`, defines every field with its getter and setter, so save
and load can never disagree on a name; every value is an int, a string or a float, which JSON
writes and reads back bit for bit.

Checkpoints written before this state existed have neither field: a load then starts the
schedule at the loaded iteration and the data at ``iteration x global batch``, which is where
the old fixed batches were.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gtp_runtime.checkpoint.format import CONSUMED_SAMPLES, DATA_POSITION_KEY, SCHEDULER_KEY
from gtp_runtime.config import ConfigError
from gtp_runtime.training import Trainer


@dataclass(frozen=True)
class Field:
    get: Callable[[], dict[str, Any]]
    put: Callable[[dict[str, Any] | None, str], None]


def run_state(trainer: Trainer) -> dict[str, Field]:
    def put_scheduler(saved: dict[str, Any] | None, where: str) -> None:
        if saved is None:
            trainer.scheduler.num_steps = trainer.iteration
        else:
            trainer.scheduler.load_state_dict(saved, where)

    def get_data() -> dict[str, Any]:
        return {CONSUMED_SAMPLES: trainer.consumed_train_samples, "dataset": trainer.data.fingerprint()}

    def put_data(saved: dict[str, Any] | None, where: str) -> None:
        if saved is None:
            trainer.consumed_train_samples = trainer.iteration * trainer.cfg.global_batch_size
            return
        now = trainer.data.fingerprint()
        if saved.get("dataset") != now:
            diff = [f"{k} saved {saved.get('dataset', {}).get(k)!r} now {v!r}" for k, v in now.items()
                    if saved.get("dataset", {}).get(k) != v]
            raise ConfigError(f"{where}: the checkpoint was trained on other data or order ({'; '.join(diff)}); "
                              "pass the saved --data-path, --split and --data-seed")
        n = saved.get(CONSUMED_SAMPLES)
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ConfigError(f"{where}: {CONSUMED_SAMPLES} {n!r} is not a non-negative integer")
        trainer.consumed_train_samples = n

    return {SCHEDULER_KEY: Field(trainer.scheduler.state_dict, put_scheduler),
            DATA_POSITION_KEY: Field(get_data, put_data)}


def save_run_state(trainer: Trainer) -> dict[str, Any]:
    return {k: f.get() for k, f in run_state(trainer).items()}


def load_run_state(trainer: Trainer, manifest: dict[str, Any], folder: Path) -> None:
    for key, f in run_state(trainer).items():
        value = manifest.get(key)
        if value is not None and not isinstance(value, dict):
            raise ConfigError(f"{folder}: manifest field {key} is {type(value).__name__}, expected an object")
        f.put(value, str(folder))
