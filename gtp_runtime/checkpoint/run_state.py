"""The run state a checkpoint carries beside the tensors: lr schedule and data position.

Megatron keeps both in ``common.pt`` (``opt_param_scheduler``, ``args.consumed_train_samples``);
we keep them in ``gtp_manifest.json`` so that ``ckpt inspect`` shows them without pickle or
torch, as top-level fields the typed schema keeps in :attr:`Manifest.extra` (written back
verbatim by tools that do not know them; this module is the one place that gives them types).
One function, :func:`run_state`, defines every field with its getter and setter, so save
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

from gtp_format.layout.config import ConfigError
from gtp_format.manifest import Manifest
from gtp_format.names import CONSUMED_SAMPLES, DATA_POSITION_KEY, SCHEDULER_KEY
from gtp_runtime.data.indexed import FLAT_DTYPES
from gtp_runtime.data.source import DataConfig
from gtp_runtime.lr_schedule import LRConfig
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
        # "path" is where the data was (Megatron keeps args.data_path); it may move, so only the
        # fingerprint is compared on load.
        return {CONSUMED_SAMPLES: trainer.consumed_train_samples, "path": trainer.cfg.data.path,
                "dataset": trainer.data.fingerprint()}

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


def load_run_state(trainer: Trainer, manifest: Manifest, folder: Path) -> None:
    for key, f in run_state(trainer).items():
        value = manifest.extra.get(key)
        if value is not None and not isinstance(value, dict):
            raise ConfigError(f"{folder}: manifest field {key} is {type(value).__name__}, expected an object")
        f.put(value, str(folder))


MAX_FINGERPRINT_FIELDS = 16  # the runtime writes 7 (name, dtype, sequences, documents, tokens, split, seed)


def run_configs(manifest: Manifest) -> tuple[LRConfig | None, DataConfig]:
    """The schedule and data a checkpoint was trained with, to load and save it again without its
    flags (``ckpt verify-roundtrip PATH``); defaults where the manifest predates them. The data is
    the recorded fingerprint, not the recorded path: no file the checkpoint names is opened.
    Untrusted input: a bad field raises :class:`ConfigError` naming it."""
    lr = None
    sched = manifest.extra.get(SCHEDULER_KEY)
    if sched is not None:
        try:
            lr = LRConfig(max_lr=float(sched["max_lr"]), min_lr=float(sched["min_lr"]),
                          warmup_iters=int(sched["lr_warmup_steps"]), decay_style=str(sched["lr_decay_style"]),
                          decay_iters=int(sched["lr_decay_steps"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"manifest {SCHEDULER_KEY} is incomplete or ill-typed ({e!r})") from None
        lr.validate()
    data = DataConfig()
    pos = manifest.extra.get(DATA_POSITION_KEY)
    if isinstance(pos, dict) and isinstance(pos.get("dataset"), dict):
        ds, path = pos["dataset"], pos.get("path")
        if not (path is None or isinstance(path, str)) or not isinstance(ds.get("split", ""), str):
            raise ConfigError(f"manifest {DATA_POSITION_KEY} has an ill-typed path or split")
        if len(ds) > MAX_FINGERPRINT_FIELDS or not all(
                isinstance(k, str) and (v is None or type(v) in (int, float, str, bool)) for k, v in ds.items()):
            raise ConfigError(f"manifest {DATA_POSITION_KEY}.dataset is not a flat object of at most "
                              f"{MAX_FINGERPRINT_FIELDS} numbers and strings")
        seed = ds.get("seed")
        # The recorded fingerprint stands in for the data: the path is information, never opened
        # (gtp_runtime.data.source.RecordedData says why).
        data = DataConfig(path=path, split=ds.get("split", data.split), seed=seed if isinstance(seed, int) else None,
                          flat_dtype=ds["dtype"] if ds.get("dtype") in FLAT_DTYPES else data.flat_dtype,
                          recorded=tuple(sorted(ds.items())))
    return lr, data
