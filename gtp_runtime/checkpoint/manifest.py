"""Build the typed manifest (:mod:`gtp_format.manifest`) from a running trainer.

Only what needs the live optimizer lives here: reading the bucket layout off the buffers. The
schema, the JSON writer and the parser are the format package's, so the runtime and ``ckpt`` can
not disagree about a field.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from gtp_format.layout.config import ModelConfig, ParallelConfig
from gtp_format.layout.schema import BucketLayout, BufferLayout, ParamLayout
from gtp_format.manifest import HASH_ALGORITHM, FileEntry, Manifest, OptimizerInfo, format_version_for
from gtp_format.names import dtype_tag


def buffer_layout(opt: Any, groups: Any) -> tuple[BufferLayout, ...]:
    """The bucket layout of every buffer, identical on every rank of the same (tp, shard) shape."""
    from gtp_runtime.checkpoint.state import dp_group_idx  # local: state imports the optimizer

    return tuple(BufferLayout(
        gbuf_idx=buf.gbuf_idx, dtype=dtype_tag(buf.key.param_dtype, buf.key.grad_dtype),
        param_dtype=str(buf.key.param_dtype), grad_dtype=str(buf.key.grad_dtype), is_expert=buf.key.is_expert,
        excludes_cp=buf.key.excludes_cp, dp_group_kind=buf.dp_kind, dp_size=buf.dp_group.size,
        grad_divisor=buf.divisor, example_dp_group_idx=dp_group_idx(buf, groups),
        buckets=tuple(BucketLayout(
            bucket_idx=b.index, numel=b.numel, numel_unpadded=b.numel_unpadded,
            params=tuple(ParamLayout(
                name=s.name, start=s.start - b.start, end=s.end - b.start, valid_numel=s.valid_numel,
                local_shape=tuple(s.param.shape), full_shape=tuple(s.param.spec.full_shape),
                global_shape=tuple(s.param.spec.global_shape), tp_mode=s.param.spec.tp_mode,
                shard_kind=s.param.spec.shard_kind, shard_size=s.param.spec.shard_size, align=s.param.spec.align,
            ) for s in b.slots),
        ) for b in buf.buckets),
    ) for buf in opt.buffers)


def optimizer_info(opt: Any, adam: Any, muon: Any, step: int) -> OptimizerInfo:
    """The manifest's optimizer section. Muon's own hyperparameters carry a ``muon_`` prefix
    (the rest are AdamW's, which updates the non-Muon params), and every param's owner is named."""
    owners = getattr(opt, "param_optimizers", None)
    if owners is None:
        return OptimizerInfo(type="adamw", step=step, hyper=dataclasses.asdict(adam))
    hyper = {**dataclasses.asdict(adam), **{f"muon_{k}": v for k, v in dataclasses.asdict(muon).items()}}
    return OptimizerInfo(type="muon", step=step, hyper=hyper, param_optimizers=owners())


def build_manifest(*, layout: str, sharding: str, iteration: int, par: ParallelConfig, model: ModelConfig,
                   optimizer: OptimizerInfo, buffers: tuple[BufferLayout, ...], files: dict[str, FileEntry],
                   param_dtype: str, bucket_size: int | None = None) -> Manifest:
    return Manifest(
        format_version=format_version_for(optimizer), layout=layout, optimizer_sharding=sharding,
        iteration=iteration, topology=par, model=model, param_dtype=param_dtype, optimizer=optimizer,
        bucket_size=bucket_size, buffers=buffers, hash_algorithm=HASH_ALGORITHM, files=files)
