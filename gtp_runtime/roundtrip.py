"""Checkpoint round trips, checked bit for bit, on ranks whose process group already exists.

A round trip asks the one question a checkpoint format must answer: does every rank get back
exactly what it held? :func:`save_phase` trains, saves, takes a :func:`snapshot` of every rank's
model shards and optimizer slices (plain tensors, written with ``torch.save`` to a file of our
own), keeps training as the uninterrupted reference and snapshots again. :func:`resume_phase`
runs in *fresh* processes: it loads the checkpoint, compares each rank's state with what that
rank held at save time, resumes, and compares losses and final state with the reference.
:func:`config_from_manifest` rebuilds the training config of a saved checkpoint so that it can
be loaded and saved again anywhere.

Nothing here spawns processes: the caller (``ckpt verify-roundtrip``, a test, a user's own job)
initialises the ranks. Comparisons are on the bits (``-0.0 != 0.0``, a NaN equals only the same
NaN), never within a tolerance.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gtp_format.compare import BITWISE, Tally, TensorSource, compare
from gtp_format.dtypes import from_repr
from gtp_format.layout.buckets import DEFAULT_BUCKET_SIZE
from gtp_format.layout.config import ConfigError, ModelConfig, ParallelConfig
from gtp_format.layout.schema import derive_bucket_size
from gtp_format.manifest import Manifest
from gtp_format.names import dtype_tag, optimizer_key
from gtp_runtime.checkpoint.io import load_checkpoint, save_checkpoint
from gtp_runtime.checkpoint.run_state import run_configs
from gtp_runtime.checkpoint.state import dp_group_idx, owned_pieces
from gtp_runtime.muon import MuonConfig
from gtp_runtime.optimizer import AdamConfig
from gtp_runtime.training import TrainConfig, Trainer

MODEL_PREFIX = "model."
OPTIMIZER_PREFIX = "optimizer."
META_PREFIX = "meta."

# -- snapshots and bitwise comparison ---------------------------------------------------------------


def snapshot(trainer: Trainer) -> dict[str, torch.Tensor]:
    """This rank's whole training state as plain tensors (clones), keyed by name.

    ``model.{param}``: the local shard of every parameter. ``{optimizer key}``: the owned slice
    of every bucket and state (``param``, ``exp_avg``, ``exp_avg_sq``), named by its
    ``dp_reshardable`` checkpoint key, bucket padding included. ``meta.*``: iteration and
    optimizer step.
    """
    out: dict[str, torch.Tensor] = {
        META_PREFIX + "iteration": torch.tensor(trainer.iteration, dtype=torch.int64),
        META_PREFIX + "optimizer_step": torch.tensor(trainer.optimizer.step_count, dtype=torch.int64),
    }
    for name, p in trainer.model.named_parameters():
        out[MODEL_PREFIX + name] = p.detach().cpu().clone()
    opt, groups = trainer.optimizer, trainer.groups
    for buf, states in zip(opt.buffers, opt.state):
        n = dp_group_idx(buf, groups)
        tag = dtype_tag(buf.key.param_dtype, buf.key.grad_dtype)
        cp_rank = groups.coords.cp if buf.key.excludes_cp else None
        for b, st in zip(buf.buckets, states):
            for state, t in st.tensors().items():
                out[optimizer_key(n, buf.gbuf_idx, tag, b.index, state, cp_rank)] = t.detach().cpu().clone()
    return out


def compare_snapshots(want: dict[str, torch.Tensor], got: dict[str, torch.Tensor],
                      select: Callable[[str], bool] = lambda k: True) -> Tally:
    """Compare the selected keys of two snapshots bit for bit, keys missing on either side included
    (the comparison engine of ``ckpt diff`` and ``verify-roundtrip PATH``, on tensors in memory)."""
    return compare(TensorSource(want, "the saved state"), TensorSource(got, "the loaded state"), BITWISE,
                   select=select).tally()


def is_model_key(key: str) -> bool:
    return key.startswith(MODEL_PREFIX)


def is_optimizer_key(key: str) -> bool:
    return key.startswith(OPTIMIZER_PREFIX) or key.startswith(META_PREFIX)


# -- the two phases of a training round trip -------------------------------------------------------


def dump_path(folder: str | os.PathLike, rank: int) -> Path:
    return Path(folder) / f"rank{rank}.pt"


def save_phase(trainer: Trainer, root: str | os.PathLike, steps: int, more_steps: int, layout: str,
               dump_dir: str | os.PathLike) -> Path:
    """Train to iteration ``steps``, save under ``root``, then keep training ``more_steps`` as the
    uninterrupted reference. Writes this rank's snapshots and the reference losses to ``dump_dir``
    and returns the checkpoint folder. Saving only reads the trainer, so continuing here is the
    same as an uninterrupted run of ``steps + more_steps``.
    """
    while trainer.iteration < steps:
        trainer.train_step()
    folder = save_checkpoint(trainer, root, layout)
    saved = snapshot(trainer)
    results = [trainer.train_step() for _ in range(more_steps)]
    torch.save({"saved": saved, "final": snapshot(trainer), "losses": [r.loss for r in results],
                "grad_norms": [r.grad_norm for r in results]}, dump_path(dump_dir, dist.get_rank()))
    return folder


def _float_list_diff(what: str, want: list[float], got: list[float]) -> Tally:
    """Per-step floats (losses, grad norms) of the reference run against the resumed run, bitwise."""
    t = compare_snapshots({what: torch.tensor(want, dtype=torch.float64)},
                          {what: torch.tensor(got, dtype=torch.float64)})
    d = t.differences[0] if t.differences else None
    if d is not None and d.first_index:
        step = d.first_index[0]
        t.differences[0] = dataclasses.replace(d, detail=f"{d.differing} of {d.numel} steps differ, first at step "
                                                         f"{step + 1} after resume: {want[step]!r} vs {got[step]!r}")
    return t


def resume_phase(trainer: Trainer, root: str | os.PathLike, dump_dir: str | os.PathLike,
                 after_load: Callable[[Trainer], None] | None = None) -> dict[str, Any]:
    """Load ``root`` into a fresh ``trainer``, compare with what this rank saved, resume as many
    steps as the reference ran, and compare losses, grad norms and final state with it.

    ``after_load`` runs right after the load (tests use it to prove a difference is caught).
    Returns plain data: ``{"rank", "loaded": {"model", "optimizer"}, "resume": {"losses",
    "grad_norms", "model", "optimizer"}}`` with :meth:`gtp_format.compare.Tally.to_dict` values.
    """
    rank = dist.get_rank()
    ref = torch.load(dump_path(dump_dir, rank), map_location="cpu", weights_only=True)  # our own file
    load_checkpoint(trainer, root)
    if after_load is not None:
        after_load(trainer)
    now = snapshot(trainer)
    loaded = {"model": compare_snapshots(ref["saved"], now, is_model_key).to_dict(),
              "optimizer": compare_snapshots(ref["saved"], now, is_optimizer_key).to_dict()}
    results = [trainer.train_step() for _ in range(len(ref["losses"]))]
    final = snapshot(trainer)
    resume = {}
    for what, got in (("losses", [r.loss for r in results]), ("grad_norms", [r.grad_norm for r in results])):
        resume[what] = _float_list_diff(what, ref[what], got).to_dict()
    resume["model"] = compare_snapshots(ref["final"], final, is_model_key).to_dict()
    resume["optimizer"] = compare_snapshots(ref["final"], final, is_optimizer_key).to_dict()
    return {"rank": rank, "coords": asdict(trainer.groups.coords), "loaded": loaded, "resume": resume,
            "losses": [r.loss for r in results]}


# -- a saved checkpoint's config -------------------------------------------------------------------

# Parameter dtypes the runtime trains in (the format's table knows every dtype; these are the ones it runs).
PARAM_DTYPES = ("torch.float32", "torch.bfloat16", "torch.float16", "torch.float64")


MAX_WORLD_ENV, MAX_PARAMS_ENV = "GTP_ROUNDTRIP_MAX_WORLD", "GTP_ROUNDTRIP_MAX_PARAMS"
DEFAULT_MAX_WORLD = 8  # local gloo ranks: one process each
DEFAULT_MAX_PARAMS = 50_000_000  # ~16 bytes per parameter (weight, grad, two Adam moments) over all ranks: 800 MB


def _limit(env: str, default: int) -> int:
    from gtp_format.numbers import NumberError, env_int

    try:
        return env_int(env, default, 1)
    except NumberError as e:
        raise ConfigError(f"{e}; set it to a positive integer") from None


def approx_params(model: ModelConfig) -> int:
    """Parameters of the GPT a manifest describes, exactly (:func:`gtp_format.layout.params.param_count`)."""
    from gtp_format.layout.params import param_count

    return param_count(model)


def check_roundtrip_limits(world: int, model: ModelConfig) -> None:
    """What a manifest may ask ``verify-roundtrip PATH`` to start: at most ``GTP_ROUNDTRIP_MAX_WORLD``
    processes (default 8) and a model of at most ``GTP_ROUNDTRIP_MAX_PARAMS`` parameters (default
    50 M). The manifest is input like any other: a crafted one asked for 17 processes and GBs."""
    max_world, max_params = _limit(MAX_WORLD_ENV, DEFAULT_MAX_WORLD), _limit(MAX_PARAMS_ENV, DEFAULT_MAX_PARAMS)
    if world > max_world:
        raise ConfigError(f"the manifest's topology needs {world} processes, over the limit of {max_world}; set "
                          f"{MAX_WORLD_ENV} to allow more")
    n = approx_params(model)
    if n > max_params:
        raise ConfigError(f"the manifest describes a model of {n} parameters, over the limit of {max_params}; "
                          f"set {MAX_PARAMS_ENV} to allow more")


def config_from_manifest(manifest: Manifest, dp: int | None = None) -> TrainConfig:
    """The training config of a saved checkpoint (``dp`` may be changed: dp_reshardable reshards
    over DP). ``manifest`` comes from a strict :func:`gtp_format.manifest.parse_manifest`; what the
    runtime would refuse (a topology, a model, an optimizer field it does not know) raises
    :class:`ConfigError` naming it."""
    par, model, opt = manifest.topology, manifest.model, manifest.optimizer
    if par is None or model is None or opt is None or manifest.buffers is None:
        raise ConfigError("manifest lacks topology, model, optimizer or buffers; it is not a complete gtp_runtime "
                          "manifest")
    known = {f.name for f in dataclasses.fields(AdamConfig)}
    if opt.type == "muon":
        known |= {f"muon_{f.name}" for f in dataclasses.fields(MuonConfig)}
    unknown = sorted(set(opt.hyper) - known)
    if opt.type not in ("adamw", "muon") or unknown:
        what = f"type {opt.type!r}" if opt.type not in ("adamw", "muon") else f"field {unknown[0]!r}"
        raise ConfigError(f"manifest optimizer has {what}, unknown to this version; upgrade gtp-ckpt")
    adam = AdamConfig(**{k: float(v) for k, v in opt.hyper.items() if not k.startswith("muon_")})
    muon = MuonConfig(**{k[5:]: (int(v) if k == "muon_ns_steps" else float(v))
                         for k, v in opt.hyper.items() if k.startswith("muon_")})
    if manifest.param_dtype not in PARAM_DTYPES:
        raise ConfigError(f"manifest param_dtype {manifest.param_dtype!r} is not one of {PARAM_DTYPES}")
    par.validate(None, model.num_experts)
    if dp is not None and dp != par.dp:
        par = ParallelConfig(**{**par.to_dict(), "dp": dp})
        par.validate(None, model.num_experts)
    model.validate(par)
    lr, data = run_configs(manifest)
    check_roundtrip_limits(par.world_size, model)
    try:
        bucket_size = manifest.bucket_size or derive_bucket_size(manifest.buffers, DEFAULT_BUCKET_SIZE)
    except ValueError as e:
        raise ConfigError(f"{e}; cannot recover --bucket-size") from None
    return TrainConfig(par=par, model=model, adam=adam, optimizer="muon" if opt.type == "muon" else "adam", muon=muon,
                       bucket_size=bucket_size, param_dtype=from_repr(manifest.param_dtype).torch, lr=lr, data=data)


def resave(trainer: Trainer, src: str | os.PathLike, root: str | os.PathLike, layout: str,
           after_load: Callable[[Trainer], None] | None = None) -> Path:
    """Load ``src`` into ``trainer`` and save it again under ``root``; returns the new folder."""
    load_checkpoint(trainer, src)
    if after_load is not None:
        after_load(trainer)
    return save_checkpoint(trainer, root, layout)


def first_param_element(trainer: Trainer, state: str = "exp_avg") -> tuple[str, torch.Tensor, int]:
    """Key, tensor and index of the first owned optimizer element that is real data (not padding):
    the element a deliberate corruption must hit for a checkpoint to show it."""
    opt, groups = trainer.optimizer, trainer.groups
    for buf, states in zip(opt.buffers, opt.state):
        for b, st in zip(buf.buckets, states):
            base = buf.owned_range(b)[0] - b.start
            for piece in owned_pieces(buf, b):
                if piece.param is not None and piece.end > piece.start:
                    cp_rank = groups.coords.cp if buf.key.excludes_cp else None
                    key = optimizer_key(dp_group_idx(buf, groups), buf.gbuf_idx,
                                        dtype_tag(buf.key.param_dtype, buf.key.grad_dtype), b.index, state, cp_rank)
                    return key, st.tensors()[state], piece.start - base
    raise ValueError("this rank owns no optimizer element")

