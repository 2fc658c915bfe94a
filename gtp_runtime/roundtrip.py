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
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gtp_runtime.checkpoint.format import dtype_tag, optimizer_key
from gtp_runtime.checkpoint.io import load_checkpoint, save_checkpoint
from gtp_runtime.checkpoint.run_state import run_configs
from gtp_runtime.checkpoint.state import dp_group_idx, owned_pieces
from gtp_runtime.config import ConfigError, ModelConfig, ParallelConfig
from gtp_runtime.optimizer import AdamConfig
from gtp_runtime.training import TrainConfig, Trainer

MODEL_PREFIX = "model."
OPTIMIZER_PREFIX = "optimizer."
META_PREFIX = "meta."
DEFAULT_BUCKET_SIZE = TrainConfig.bucket_size

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


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous().reshape(-1)
    if t.dtype == torch.bool:
        return t.to(torch.uint8)
    if t.is_complex():
        t = torch.view_as_real(t).reshape(-1)
    return t.view(_INT_OF_SIZE[t.element_size()])


@dataclass
class KeyDiff:
    """How one tensor differs: ``problem`` is ``values``, ``shape``, ``dtype``, ``missing`` or ``unexpected``."""

    key: str
    problem: str
    numel: int = 0
    differing: int = 0
    max_abs_diff: float | None = None
    first_index: int | None = None
    detail: str = ""


def bitwise_diff(a: torch.Tensor, b: torch.Tensor) -> tuple[int, float | None, int | None]:
    """Elements of same-shape, same-dtype ``a`` and ``b`` whose bits differ: count, max ``|a-b|``
    over those with a finite difference, and the first differing flat index."""
    bad = _bits(a) != _bits(b)
    count = int(bad.sum())
    if not count:
        return 0, None, None
    first = int(bad.nonzero()[0, 0])
    fa, fb = a.detach().reshape(-1)[bad], b.detach().reshape(-1)[bad]
    if fa.is_complex():
        d = (fa.to(torch.complex128) - fb.to(torch.complex128)).abs()
    else:
        d = (fa.to(torch.float64) - fb.to(torch.float64)).abs()
    d = d[torch.isfinite(d)]
    return count, (float(d.max()) if d.numel() else None), first


def diff_tensors(key: str, want: torch.Tensor, got: torch.Tensor) -> KeyDiff | None:
    """``None`` when ``got`` is bit-identical to ``want`` (shape and dtype included)."""
    if want.dtype != got.dtype:
        return KeyDiff(key, "dtype", want.numel(), want.numel(), detail=f"{want.dtype} vs {got.dtype}")
    if tuple(want.shape) != tuple(got.shape):
        return KeyDiff(key, "shape", want.numel(), want.numel(),
                       detail=f"{tuple(want.shape)} vs {tuple(got.shape)}")
    count, max_abs, first = bitwise_diff(want, got)
    return KeyDiff(key, "values", want.numel(), count, max_abs, first) if count else None


@dataclass
class DiffSummary:
    """The comparison of two snapshots (or a subset of their keys)."""

    keys: int = 0
    elements: int = 0
    differing: int = 0
    max_abs_diff: float | None = None
    diffs: list[KeyDiff] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.diffs

    def add(self, numel: int, d: KeyDiff | None) -> None:
        self.keys += 1
        self.elements += numel
        if d is None:
            return
        self.diffs.append(d)
        self.differing += d.differing
        if d.max_abs_diff is not None:
            self.max_abs_diff = max(self.max_abs_diff or 0.0, d.max_abs_diff)

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "keys": self.keys, "elements": self.elements, "differing": self.differing,
                "max_abs_diff": self.max_abs_diff, "diffs": [asdict(d) for d in self.diffs]}


def compare_snapshots(want: dict[str, torch.Tensor], got: dict[str, torch.Tensor],
                      select: Callable[[str], bool] = lambda k: True) -> DiffSummary:
    """Compare the selected keys of two snapshots bit for bit, keys missing on either side included."""
    out = DiffSummary()
    for key in sorted(k for k in want.keys() | got.keys() if select(k)):
        if key not in got:
            out.add(want[key].numel(), KeyDiff(key, "missing", want[key].numel(), want[key].numel()))
        elif key not in want:
            out.add(0, KeyDiff(key, "unexpected", got[key].numel(), got[key].numel()))
        else:
            out.add(want[key].numel(), diff_tensors(key, want[key], got[key]))
    return out


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


def _float_list_diff(what: str, want: list[float], got: list[float]) -> KeyDiff | None:
    if len(want) != len(got):
        return KeyDiff(what, "shape", len(want), len(want), detail=f"{len(want)} vs {len(got)} steps")
    count, max_abs, first = bitwise_diff(torch.tensor(want, dtype=torch.float64),
                                         torch.tensor(got, dtype=torch.float64))
    if not count:
        return None
    return KeyDiff(what, "values", len(want), count, max_abs, first,
                   detail=f"step {first + 1} after resume: {want[first]!r} vs {got[first]!r}")


def resume_phase(trainer: Trainer, root: str | os.PathLike, dump_dir: str | os.PathLike,
                 after_load: Callable[[Trainer], None] | None = None) -> dict[str, Any]:
    """Load ``root`` into a fresh ``trainer``, compare with what this rank saved, resume as many
    steps as the reference ran, and compare losses, grad norms and final state with it.

    ``after_load`` runs right after the load (tests use it to prove a difference is caught).
    Returns plain data: ``{"rank", "loaded": {"model", "optimizer"}, "resume": {"losses",
    "grad_norms", "model", "optimizer"}}`` with :meth:`DiffSummary.to_dict` values.
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
        s = DiffSummary()
        s.add(len(ref[what]), _float_list_diff(what, ref[what], got))
        resume[what] = s.to_dict()
    resume["model"] = compare_snapshots(ref["final"], final, is_model_key).to_dict()
    resume["optimizer"] = compare_snapshots(ref["final"], final, is_optimizer_key).to_dict()
    return {"rank": rank, "coords": asdict(trainer.groups.coords), "loaded": loaded, "resume": resume,
            "losses": [r.loss for r in results]}


# -- a saved checkpoint's config -------------------------------------------------------------------

_DTYPES = {str(d): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64)}


def bucket_size_from_manifest(manifest: dict[str, Any]) -> int:
    """The ``bucket_size`` a checkpoint was saved with, or one that rebuilds the same buckets.

    Manifests written since ``bucket_size`` was recorded carry it. For older ones it is derived
    from the bucket layout: :class:`gtp_runtime.buffers.GradBuffer` closes a bucket after the first
    param whose end reaches ``bucket_size`` elements from the bucket start, so every param end
    before the last one of a bucket lies below it and the last end of every bucket but a buffer's
    final one lies at or above it. Any value in that interval lays the buffers out identically.
    """
    if type(manifest.get("bucket_size")) is int and manifest["bucket_size"] > 0:
        return manifest["bucket_size"]
    below, at_or_above = 0, None  # bucket_size > below, bucket_size <= at_or_above
    try:
        for buf in manifest["buffers"]:
            buckets = buf["buckets"]
            for i, b in enumerate(buckets):
                ends = [p["end"] for p in b["params"]]
                if any(type(e) is not int for e in ends):
                    raise TypeError("a param end is not an int")
                if not ends:
                    continue
                below = max([below, *ends[:-1]])
                if i < len(buckets) - 1:
                    at_or_above = ends[-1] if at_or_above is None else min(at_or_above, ends[-1])
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"manifest bucket layout is incomplete ({type(e).__name__}: {e}); "
                          "cannot recover --bucket-size") from None
    if at_or_above is None:
        return max(DEFAULT_BUCKET_SIZE, below + 1)
    if at_or_above <= below:
        raise ConfigError(f"manifest bucket layout fits no bucket size (needs > {below} and <= {at_or_above}); "
                          "it was not written by gtp_runtime's bucketing")
    return at_or_above


def _fields(cls: type, raw: Any, where: str, ignore: tuple[str, ...] = ()) -> dict[str, Any]:
    """``raw`` checked against the fields of dataclass ``cls``: known names, the defaults' types."""
    if not isinstance(raw, dict):
        raise ConfigError(f"manifest {where} is a {type(raw).__name__}, expected an object")
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    out = {}
    for k, v in raw.items():
        if k in ignore:
            continue
        if k not in defaults:
            raise ConfigError(f"manifest {where} has field {k!r}, unknown to this version; upgrade gtp-ckpt")
        want = type(defaults[k])
        ok = type(v) is want or (want is float and type(v) is int)
        if not ok:
            raise ConfigError(f"manifest {where}.{k} is {v!r}, expected {want.__name__}")
        out[k] = v
    return out


def config_from_manifest(manifest: dict[str, Any], dp: int | None = None) -> TrainConfig:
    """The training config of a saved checkpoint (``dp`` may be changed: dp_reshardable reshards
    over DP). The manifest is input, not trusted: a missing or ill-typed field raises
    :class:`ConfigError` naming it, as does a topology or model the runtime would refuse."""
    for name in ("topology", "model", "optimizer", "param_dtype", "buffers"):
        if name not in manifest:
            raise ConfigError(f"manifest lacks {name!r}; it is not a complete gtp_runtime manifest")
    par = ParallelConfig(**_fields(ParallelConfig, manifest["topology"], "topology",
                                   ignore=("world_size", "expert_dp")))
    model = ModelConfig(**_fields(ModelConfig, manifest["model"], "model"))
    adam = AdamConfig(**_fields(AdamConfig, manifest["optimizer"], "optimizer", ignore=("type", "step")))
    dtype_name = manifest["param_dtype"]
    if not isinstance(dtype_name, str) or dtype_name not in _DTYPES:
        raise ConfigError(f"manifest param_dtype {dtype_name!r} is not one of {sorted(_DTYPES)}")
    world = manifest["topology"].get("world_size", par.world_size)
    if type(world) is not int:
        raise ConfigError(f"manifest topology.world_size is {world!r}, expected an int")
    par.validate(world, model.num_experts)
    if dp is not None and dp != par.dp:
        par = ParallelConfig(**{**par.to_dict(), "dp": dp})
        par.validate(None, model.num_experts)
    model.validate(par)
    lr, data = run_configs(manifest)
    return TrainConfig(par=par, model=model, adam=adam, bucket_size=bucket_size_from_manifest(manifest),
                       param_dtype=_DTYPES[dtype_name], lr=lr, data=data)


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

