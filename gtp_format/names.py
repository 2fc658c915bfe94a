"""The on-disk vocabulary of a ``dp_reshardable`` checkpoint: key names and file names.

This module is the single definition of the format. The runtime writes with it and the ``ckpt``
CLI parses with it, so the two can never drift apart. It imports nothing from torch.distributed.

Optimizer keys (Megatron's ``dp_reshardable``)::

    optimizer.distributed.dp_group_idx_{N}.gbuf_idx_{G}.dtype_{D}.bucket_idx_{B}.{state}

``N`` is the rank in the tp x gtp_remat model-parallel group and holds no CP coordinate, which is
exactly why CP peers of a folded buffer used to collide. Keys of folded buffers, and only those,
carry the CP rank: canonically as the suffix ``.cp_rank_{i}``; readers also accept the infix form
``...bucket_idx_{B}.cp_rank_{i}.{state}``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import PurePath, PurePosixPath
from typing import Any

FORMAT_NAME = "dp_reshardable"
OPTIMIZER_SHARDINGS = ("dp_reshardable", "fully_reshardable", "dp_zero_gather_scatter")
LAYOUTS = ("torch_dist", "safetensors")

OPT_PREFIX = "optimizer.distributed"
STATES = ("param", "exp_avg", "exp_avg_sq")

# The ownership token a writer puts in its hidden work folder (gtp_format/work.py); never committed.
WORK_TOKEN_FILE = ".gtp-work-token"

# Files of a checkpoint folder.
DCP_METADATA_FILE = ".metadata"
MEGATRON_METADATA_FILE = "metadata.json"
MANIFEST_FILE = "gtp_manifest.json"
CHUNK_RECORDS_FILE = "gtp_chunks.json"  # per-chunk hashes and statistics (gtp_format/integrity/records.py)
CHUNK_RECORDS_SECTION = "chunk_records"  # the manifest section that announces it
MEGATRON_INTEGRITY_FILE = "integrity.json"  # megatron-core's opt-in SHA-256 per file (verify_integrity)
COMMON_FILE = "common.pt"
LATEST_FILE = "latest_checkpointed_iteration.txt"
DISTCP_RE = re.compile(r"^__(\d+)_(\d+)\.distcp$")
# The pickle-free safetensors layout (gtp_runtime.checkpoint.safetensors_storage).
GTP_INDEX_FILE = "index.json"
GTP_INDEX_VERSION = 1
GTP_SAFETENSORS_RE = re.compile(r"^__(\d+)_(\d+)\.safetensors$")
# Iteration folders and the latest marker: one writer rule, one reader rule, the same numbers.
# ``iter_dir_name`` pads to 7 digits and grows past them; the marker holds 1-12 ASCII digits, so every
# iteration a writer may record is 0..MAX_ITERATION (a 13-digit iteration was written by reshard from a
# manifest's value and then refused by the reader).
MAX_ITERATION = 10**12 - 1
ITER_DIR_RE = re.compile(r"^iter_([0-9]{7}|[1-9][0-9]{7,11})$")
LATEST_RE = re.compile(r"[0-9]{1,12}")

# Run state beside the tensors, in the manifest (Megatron keeps it in common.pt): the learning-rate
# schedule under Megatron's name, and the data position with what it indexes.
SCHEDULER_KEY = "opt_param_scheduler"
DATA_POSITION_KEY = "data_position"
CONSUMED_SAMPLES = "consumed_train_samples"

# Byte objects: Megatron names a ShardedObject ``{key}/shard_{offset}_{shape}`` in DCP.
SHARDED_OBJECT_RE = re.compile(r"^(?P<key>.+)/shard_(?P<offset>[\d.]+)_(?P<shape>[\d.]+)$")


def iter_dir_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def parse_latest(text: str) -> int | None:
    """The iteration a marker's (stripped) text names, or None: ASCII digits only (``\\d`` took Arabic-Indic)."""
    return int(text) if LATEST_RE.fullmatch(text) else None


def dtype_tag(param_dtype: Any, grad_dtype: Any) -> str:
    """The ``D`` of a key: the repr of the (param_dtype, grad_dtype) tuple, as Megatron writes it.

    Takes ``torch.dtype`` (the runtime) or :class:`~gtp_format.dtypes.DType` (the CLI):
    both print as ``torch.bfloat16``.
    """
    return repr((param_dtype, grad_dtype))


def optimizer_key(
    dp_group_idx: int, gbuf_idx: int, dtag: str, bucket_idx: int, state: str, cp_rank: int | None
) -> str:
    """Canonical key of one bucket state. ``cp_rank`` is given for folded buffers only."""
    if state not in STATES:
        raise ValueError(f"unknown optimizer state {state!r}; expected one of {STATES}")
    key = f"{OPT_PREFIX}.dp_group_idx_{dp_group_idx}.gbuf_idx_{gbuf_idx}.dtype_{dtag}.bucket_idx_{bucket_idx}.{state}"
    return key if cp_rank is None else f"{key}.cp_rank_{cp_rank}"


def per_bucket_numel_key(dp_group_idx: int, unpadded: bool) -> str:
    name = "per_bucket_numel_unpadded" if unpadded else "per_bucket_numel"
    return f"{OPT_PREFIX}.dp_group_idx_{dp_group_idx}.{name}"


_OPT_RE = re.compile(
    r"^(?P<prefix>(?:.*\.)?optimizer\.distributed)\.dp_group_idx_(?P<n>\d+)\.gbuf_idx_(?P<g>\d+)"
    r"\.dtype_(?P<dtype>\(.*?\))\.bucket_idx_(?P<b>\d+)"
    r"(?:\.cp_rank_(?P<cp_infix>\d+))?\.(?P<state>[A-Za-z_]+?)(?:\.cp_rank_(?P<cp_suffix>\d+))?$"
)
_PBN_RE = re.compile(
    r"^(?P<prefix>(?:.*\.)?optimizer\.distributed)\.dp_group_idx_(?P<n>\d+)"
    r"\.(?P<which>per_bucket_numel|per_bucket_numel_unpadded)$"
)


@dataclass(frozen=True)
class OptimizerKey:
    """A parsed ``dp_reshardable`` optimizer key."""

    prefix: str
    dp_group_idx: int
    gbuf_idx: int
    dtype: str
    bucket_idx: int
    state: str
    cp_rank: int | None
    cp_form: str | None  # "suffix", "infix" or None

    @property
    def bucket_id(self) -> tuple[str, int, int, str, int]:
        """Identity of the bucket across states and CP ranks."""
        return (self.prefix, self.dp_group_idx, self.gbuf_idx, self.dtype, self.bucket_idx)

    def with_cp_rank(self, cp_rank: int) -> str:
        """Canonical (suffix) key of the same bucket state for ``cp_rank``."""
        base = (
            f"{self.prefix}.dp_group_idx_{self.dp_group_idx}.gbuf_idx_{self.gbuf_idx}.dtype_{self.dtype}"
            f".bucket_idx_{self.bucket_idx}.{self.state}"
        )
        return f"{base}.cp_rank_{cp_rank}"


def parse_optimizer_key(key: str) -> OptimizerKey | None:
    """Parse an optimizer bucket key (either CP form, or none); ``None`` if it is not one."""
    m = _OPT_RE.match(key)
    if not m:
        return None
    infix, suffix = m.group("cp_infix"), m.group("cp_suffix")
    if infix is not None and suffix is not None:
        return None
    cp = infix if infix is not None else suffix
    form = "infix" if infix is not None else ("suffix" if suffix is not None else None)
    return OptimizerKey(
        prefix=m.group("prefix"),
        dp_group_idx=int(m.group("n")),
        gbuf_idx=int(m.group("g")),
        dtype=m.group("dtype"),
        bucket_idx=int(m.group("b")),
        state=m.group("state"),
        cp_rank=None if cp is None else int(cp),
        cp_form=form,
    )


def parse_per_bucket_numel_key(key: str) -> tuple[str, int, bool] | None:
    """``(prefix, dp_group_idx, unpadded)`` for a per_bucket_numel key (ShardedObject form ok)."""
    m = SHARDED_OBJECT_RE.match(key)
    m2 = _PBN_RE.match(m.group("key") if m else key)
    if not m2:
        return None
    return m2.group("prefix"), int(m2.group("n")), m2.group("which").endswith("unpadded")


def distcp_writer_rank(file_name: str) -> int | None:
    """The global rank that wrote ``__{rank}_{k}.distcp`` or ``__{rank}_{k}.safetensors``."""
    m = DISTCP_RE.match(file_name) or GTP_SAFETENSORS_RE.match(file_name)
    return int(m.group(1)) if m else None


# DCP's HuggingFaceStorageWriter names files shard-{rank+1:05d}-model-...; ours (.distcp and
# __{rank}_{k}.safetensors) are parsed by distcp_writer_rank.
_HF_SHARD_RE = re.compile(r"^shard-(\d+)-model-\d+-of-\d+\.safetensors$")


def writer_rank(file: str | None) -> int | None:
    """Global rank that wrote a data file, from its DCP file name."""
    if file is None:
        return None
    name = PurePosixPath(file).name
    rank = distcp_writer_rank(name)
    if rank is not None:
        return rank
    m = _HF_SHARD_RE.match(name)
    return int(m.group(1)) - 1 if m else None


def chunk_tensor_name(fqn: str, offsets: tuple[int, ...]) -> str:
    """Name of one chunk inside a safetensors data file of our layout: ``{key}@{offsets}``."""
    return f"{fqn}@{','.join(map(str, offsets))}"


def folded_refusal(sharding: str) -> str:
    """The one error text for a refused optimizer sharding with folded buffers."""
    return (
        f"optimizer sharding {sharding!r} is refused with CP-folded GTP buffers: it gathers every buffer "
        "over the DP x CP group and would mix different CP peers' shards; use 'dp_reshardable'"
    )


def iteration_from_name(folder: PurePath) -> int | None:
    """The iteration an ``iter_XXXXXXX`` folder name encodes."""
    m = ITER_DIR_RE.match(folder.name)
    return int(m.group(1)) if m else None

ATTESTATION_FILE = "gtp_attestation.json"  # a conversion's record beside its output (reshard, export, import)
ATTESTATION_SUFFIX = ".gtp_attestation.json"  # beside a one-file output: model.pt.gtp_attestation.json
