"""``gtp_manifest.json``: the typed schema, its one writer and its one parser.

The manifest says what a checkpoint is without pickle or torch: format version, layout, optimizer
sharding, iteration, topology, model config, optimizer hyperparameters and step, the bucket layout
of every buffer (which parameter sits where in which bucket, with its shard spec), and the size and
checksum of every data file. The bucket layout is position-independent: every (tp, weight-group)
rank has the same parameter shapes, so one layout per buffer plus the shard rules of
:mod:`gtp_format.layout.shard` place any rank's slice. That is what lets ``ckpt`` verify data and
rebuild per-parameter state offline.

Why one parser: the manifest used to be a plain dict that five consumers read five ways, some
strict and some lenient, so the same damaged file was refused by one command and half-used by
another. :func:`parse_manifest` is the only reader. ``strict=True`` (``--load``, ``migrate``,
``verify-roundtrip``, ``reshard``) refuses the first missing or ill-typed field with a one-line
message naming its path; ``strict=False`` (``inspect``, ``verify``, foreign checkpoints) keeps every
section it can type-check and records the rest in :attr:`Manifest.problems`. Fields this version
does not know are kept in :attr:`Manifest.extra` and written back unchanged, so an older tool that
rewrites a newer manifest loses nothing.

Checksums: CRC-32C (Castagnoli), one per file, named in ``hash_algorithm`` and in each entry.
It is the checksum object stores keep (GCS, and S3 on request) and, through the CPU's CRC32
instruction, about 8x zlib's CRC-32 per core (``docs/performance.md``). Manifests written before it
name ``crc32`` (zlib); ``ckpt verify --data`` checks either, and ``sha256``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gtp_format.commit import write_durable
from gtp_format.errors import FormatError
from gtp_format.layout.config import ConfigError, ModelConfig, ParallelConfig
from gtp_format.layout.schema import BucketLayout, BufferLayout, ParamLayout
from gtp_format.layout.topology import ALL_GROUP_KINDS
from gtp_format.names import LATEST_FILE, LAYOUTS, MANIFEST_FILE, MAX_ITERATION, OPTIMIZER_SHARDINGS

FORMAT_TAG = "gtp-ckpt"
MANIFEST_VERSION = 2  # the newest version this tool reads; 2 added ``optimizer.param_optimizers``
PARAM_OPTIMIZERS = ("adamw", "muon")  # which optimizer updates a param (``optimizer.param_optimizers``)
HASH_ALGORITHM = "crc32c"
LEGACY_HASH_ALGORITHM = "crc32"  # what manifests that name none used (zlib)
MAX_COUNT = 1 << 62  # no size, numel or index in a real checkpoint comes near; bigger is a crafted file
MAX_DIMS = 64

_KNOWN = ("format", "format_version", "layout", "optimizer_sharding", "iteration", "topology", "model",
          "param_dtype", "optimizer", "bucket_size", "buffers", "hash_algorithm", "files", "notes")


class ManifestError(FormatError):
    """A manifest field is missing or of the wrong type (``path`` names it, e.g. ``buffers[0].dtype``)."""


# -- the schema -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class FileEntry:
    size: int
    checksums: dict[str, str]  # algorithm name -> hex digest


@dataclass(frozen=True)
class OptimizerInfo:
    """The optimizer: ``type`` ``adamw`` or ``muon``, its step and hyperparameters.

    ``param_optimizers`` (version 2) names the optimizer that owns each param when they differ
    (``muon``: Muon for the linears, ``adamw`` for the rest). For a Muon param, the bucket state
    ``exp_avg`` is Muon's momentum and ``exp_avg_sq`` is unused (zero). Empty means every param is
    AdamW's, as in every version-1 manifest.
    """

    type: str
    step: int
    hyper: dict[str, float]  # lr, betas, eps, weight decay, clip... as the optimizer records them
    param_optimizers: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.type, **self.hyper, "step": self.step}
        if self.param_optimizers:
            out["param_optimizers"] = dict(self.param_optimizers)
        return out

    def owner(self, param: str) -> str:
        """The optimizer that updates ``param`` (``adamw`` when the manifest names none)."""
        return self.param_optimizers.get(param, "adamw")


def format_version_for(optimizer: OptimizerInfo | None) -> int:
    """The version a manifest is written with: 2 only when it records per-param optimizers, so
    that tools from before version 2 keep reading AdamW checkpoints and refuse Muon ones by
    version ("newer than this tool; upgrade") rather than by a field they cannot type."""
    return 2 if optimizer is not None and optimizer.param_optimizers else 1


@dataclass
class Manifest:
    format_version: int
    layout: str
    optimizer_sharding: str
    iteration: int
    topology: ParallelConfig | None
    model: ModelConfig | None
    param_dtype: str | None
    optimizer: OptimizerInfo | None
    bucket_size: int | None
    buffers: tuple[BufferLayout, ...] | None
    hash_algorithm: str
    files: dict[str, FileEntry] | None
    notes: list[Any] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)  # fields this version does not know, kept verbatim
    problems: list[str] = field(default_factory=list)  # lenient parse: what was ill-formed and dropped
    # The strict verdict of the same parse: the line strict=True would have raised, or None. One
    # parse serves both (open_checkpoint's lenient read, then gtp_format.check.gate's strict refusal).
    strict_error: str | None = field(default=None, repr=False, compare=False)

    def strict(self) -> Manifest:
        """This manifest, when a strict parse would have accepted it; else its strict line (exit 2)."""
        if self.strict_error is not None:
            raise ManifestError(self.strict_error)
        return self

    @property
    def world_size(self) -> int | None:
        return None if self.topology is None else self.topology.world_size

    def buffer(self, gbuf_idx: int) -> BufferLayout | None:
        return next((b for b in self.buffers or () if b.gbuf_idx == gbuf_idx), None)

    def to_json(self) -> dict[str, Any]:
        """The JSON object, fields in the order the writer has always used."""
        par = self.topology
        out: dict[str, Any] = {
            "format": FORMAT_TAG, "format_version": self.format_version, "layout": self.layout,
            "optimizer_sharding": self.optimizer_sharding, "iteration": self.iteration,
            "topology": None if par is None else {**par.to_dict(), "world_size": par.world_size,
                                                  "expert_dp": par.expert_dp},
            "model": None if self.model is None else self.model.to_dict(),
            "param_dtype": self.param_dtype,
            "optimizer": None if self.optimizer is None else self.optimizer.to_json(),
            "bucket_size": self.bucket_size,
            "buffers": None if self.buffers is None else [_buffer_json(b) for b in self.buffers],
            "hash_algorithm": self.hash_algorithm,
            "files": None if self.files is None else {
                name: {"size": e.size, **e.checksums} for name, e in self.files.items()},
            "notes": self.notes,
        }
        out.update(self.extra)
        return out


def _buffer_json(b: BufferLayout) -> dict[str, Any]:
    def plain(v: Any) -> Any:  # tuples (frozen dataclasses) become JSON lists
        return [plain(x) for x in v] if isinstance(v, (tuple, list)) else v

    out = {f.name: plain(getattr(b, f.name)) for f in dataclasses.fields(b) if f.name != "buckets"}
    out["buckets"] = [{"bucket_idx": k.bucket_idx, "numel": k.numel, "numel_unpadded": k.numel_unpadded,
                       "params": [{f.name: plain(getattr(p, f.name)) for f in dataclasses.fields(p)}
                                  for p in k.params]} for k in b.buckets]
    return out


def write_manifest(folder: Path, manifest: Manifest) -> None:
    """Write ``gtp_manifest.json`` into a folder being built (fsynced; the folder commit follows)."""
    import json

    write_durable(folder / MANIFEST_FILE, json.dumps(manifest.to_json(), indent=1))


# -- the parser -----------------------------------------------------------------------------------

class _Bad(Exception):
    def __init__(self, path: str, what: str) -> None:
        super().__init__(f"{path} {what}")
        self.path = path


def _int(v: Any, path: str, low: int = 0) -> int:
    if type(v) is not int or not low <= v <= MAX_COUNT:
        raise _Bad(path, f"is {_short(v)}, not an integer in [{low}, 2**62]")
    return v


def _iteration(v: Any) -> int:
    n = _int(v, "iteration")
    if n > MAX_ITERATION:
        raise _Bad("iteration", f"is {n}, which cannot be named by {LATEST_FILE} (at most {MAX_ITERATION})")
    return n


def _str(v: Any, path: str) -> str:
    if not isinstance(v, str) or len(v) > 4096:
        raise _Bad(path, f"is {_short(v)}, not a string")
    return v


def _opt_str(v: Any, path: str) -> str | None:
    return None if v is None else _str(v, path)


def _bool(v: Any, path: str) -> bool:
    if type(v) is not bool:
        raise _Bad(path, f"is {_short(v)}, not true/false")
    return v


def _num(v: Any, path: str) -> float:
    if type(v) not in (int, float) or (type(v) is float and not math.isfinite(v)) or abs(v) > 1e300:
        raise _Bad(path, f"is {_short(v)}, not a finite number")
    return v


def _obj(v: Any, path: str) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise _Bad(path, f"is {_short(v)}, not an object")
    return v


def _list(v: Any, path: str) -> list[Any]:
    if not isinstance(v, list):
        raise _Bad(path, f"is {_short(v)}, not a list")
    return v


def _shape(v: Any, path: str) -> tuple[int, ...]:
    dims = _list(v, path)
    if len(dims) > MAX_DIMS:
        raise _Bad(path, f"has {len(dims)} dimensions (at most {MAX_DIMS})")
    return tuple(_int(d, f"{path}[{i}]") for i, d in enumerate(dims))


def _req(d: dict[str, Any], name: str, path: str) -> Any:
    if name not in d:
        raise _Bad(f"{path}.{name}" if path else name, "is missing")
    return d[name]


def _short(v: Any) -> str:
    text = repr(v) if not isinstance(v, (dict, list)) else type(v).__name__
    return text if len(text) <= 40 else text[:37] + "..."


def _config(cls: type, raw: Any, path: str, derived: tuple[str, ...] = ()) -> Any:
    d = _obj(raw, path)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name not in d:
            continue  # older manifests lack newer fields; the dataclass default applies
        v, p = d[f.name], f"{path}.{f.name}"
        if f.type in ("bool", bool):
            kwargs[f.name] = _bool(v, p)
        elif f.type in ("float", float):
            kwargs[f.name] = _num(v, p)
        else:
            kwargs[f.name] = _int(v, p)
    unknown = sorted(set(d) - {f.name for f in dataclasses.fields(cls)} - set(derived))
    if unknown:
        raise _Bad(f"{path}.{unknown[0]}", "is a field this version does not know; upgrade gtp-ckpt")
    return cls(**kwargs)


def _topology(raw: Any) -> ParallelConfig:
    par = _config(ParallelConfig, raw, "topology", derived=("world_size", "expert_dp"))
    try:
        par.validate()
    except ConfigError as e:
        raise _Bad("topology", f"is not a valid topology ({e})") from None
    for name in ("world_size", "expert_dp"):
        if name in raw and raw[name] != getattr(par, name):
            raise _Bad(f"topology.{name}", f"is {_short(raw[name])} but the sizes give {getattr(par, name)}")
    return par


def _param(raw: Any, path: str) -> ParamLayout:
    d = _obj(raw, path)
    g = lambda n: _req(d, n, path)  # noqa: E731
    p = ParamLayout(
        name=_str(g("name"), f"{path}.name"), start=_int(g("start"), f"{path}.start"),
        end=_int(g("end"), f"{path}.end"),
        valid_numel=_int(d.get("valid_numel", 0), f"{path}.valid_numel"),
        local_shape=_shape(g("local_shape"), f"{path}.local_shape"),
        full_shape=_shape(g("full_shape"), f"{path}.full_shape"),
        global_shape=_shape(g("global_shape"), f"{path}.global_shape"),
        tp_mode=_opt_str(d.get("tp_mode"), f"{path}.tp_mode"),
        shard_kind=_opt_str(d.get("shard_kind"), f"{path}.shard_kind"),
        shard_size=_int(g("shard_size"), f"{path}.shard_size", low=1), align=_int(g("align"), f"{path}.align", low=1))
    if p.tp_mode not in TP_MODES or p.shard_kind not in SHARD_KINDS:  # anything else was read as "replicated"
        raise _Bad(path, f"has tp_mode {_short(p.tp_mode)} / shard_kind {_short(p.shard_kind)}, not one of "
                         f"{TP_MODES} / {SHARD_KINDS}")
    shapes = (p.local_shape, p.full_shape, p.global_shape)
    if not p.full_shape or len({len(x) for x in shapes}) != 1:  # a bucket holds tensors of one rank, never scalars
        raise _Bad(path, f"has local/full/global shapes {list(p.local_shape)} / {list(p.full_shape)} / "
                         f"{list(p.global_shape)}; a bucket's parameter has one or more dimensions, the same in all "
                         "three")
    if p.start > p.end or p.end - p.start != math.prod(p.local_shape):
        raise _Bad(path, f"has range [{p.start}, {p.end}) for local shape {list(p.local_shape)}")
    return p


def _bucket(raw: Any, path: str) -> BucketLayout:
    d = _obj(raw, path)
    params = tuple(_param(p, f"{path}.params[{i}]") for i, p in enumerate(_list(_req(d, "params", path),
                                                                                f"{path}.params")))
    b = BucketLayout(bucket_idx=_int(_req(d, "bucket_idx", path), f"{path}.bucket_idx"),
                     numel=_int(_req(d, "numel", path), f"{path}.numel"),
                     numel_unpadded=_int(_req(d, "numel_unpadded", path), f"{path}.numel_unpadded"), params=params)
    if b.numel_unpadded > b.numel or any(p.end > b.numel for p in params):
        raise _Bad(path, f"has params past its numel {b.numel} (unpadded {b.numel_unpadded})")
    return b


def _buffer(raw: Any, path: str) -> BufferLayout:
    d = _obj(raw, path)
    g = lambda n: _req(d, n, path)  # noqa: E731
    buckets = tuple(_bucket(b, f"{path}.buckets[{i}]") for i, b in enumerate(_list(g("buckets"), f"{path}.buckets")))
    if len({b.bucket_idx for b in buckets}) != len(buckets):
        raise _Bad(f"{path}.buckets", "repeats a bucket_idx")
    return BufferLayout(
        gbuf_idx=_int(g("gbuf_idx"), f"{path}.gbuf_idx"), dtype=_str(g("dtype"), f"{path}.dtype"),
        param_dtype=_str(g("param_dtype"), f"{path}.param_dtype"),
        grad_dtype=_str(d.get("grad_dtype", d.get("param_dtype")), f"{path}.grad_dtype"),
        is_expert=_bool(g("is_expert"), f"{path}.is_expert"),
        excludes_cp=_bool(g("excludes_cp"), f"{path}.excludes_cp"),
        dp_group_kind=_group_kind(g("dp_group_kind"), f"{path}.dp_group_kind"),
        dp_size=_int(g("dp_size"), f"{path}.dp_size", low=1),
        grad_divisor=_int(d.get("grad_divisor", 1), f"{path}.grad_divisor", low=1),
        example_dp_group_idx=_int(d.get("example_dp_group_idx", 0), f"{path}.example_dp_group_idx"),
        buckets=buckets)


TP_MODES = (None, "column", "row", "vocab")  # layout/shard.py: ShardSpec
SHARD_KINDS = (None, "weight", "expert_gtp_remat")  # topology.WEIGHT, topology.EXPERT_GTP


def _group_kind(v: Any, path: str) -> str:
    """A group kind the rank generator knows: an unknown one reached ``Topology.groups`` as a
    KeyError, the CLI's last-resort "unexpected" line."""
    kind = _str(v, path)
    if kind not in ALL_GROUP_KINDS:
        raise _Bad(path, f"is {_short(kind)}, not a group kind ({', '.join(ALL_GROUP_KINDS)})")
    return kind


def _buffers(raw: Any) -> tuple[BufferLayout, ...]:
    out = tuple(_buffer(b, f"buffers[{i}]") for i, b in enumerate(_list(raw, "buffers")))
    if len({b.gbuf_idx for b in out}) != len(out):
        raise _Bad("buffers", "repeats a gbuf_idx")
    return out


def _files(raw: Any) -> dict[str, FileEntry]:
    out = {}
    for name, entry in _obj(raw, "files").items():
        path = f"files[{name!r}]"
        d = _obj(entry, path)
        sums = {k: _str(v, f"{path}.{k}") for k, v in d.items() if k != "size"}
        out[name] = FileEntry(size=_int(_req(d, "size", path), f"{path}.size"), checksums=sums)
    return out


def _optimizer(raw: Any) -> OptimizerInfo:
    d = _obj(raw, "optimizer")
    hyper = {k: _num(v, f"optimizer.{k}") for k, v in d.items() if k not in ("type", "step", "param_optimizers")}
    owners: dict[str, str] = {}
    for name, which in _obj(d.get("param_optimizers", {}), "optimizer.param_optimizers").items():
        path = f"optimizer.param_optimizers[{_short(name)}]"
        if _str(which, path) not in PARAM_OPTIMIZERS:
            raise _Bad(path, f"is {_short(which)}, not one of {PARAM_OPTIMIZERS}")
        owners[_str(name, path)] = which
    return OptimizerInfo(type=_str(_req(d, "type", "optimizer"), "optimizer.type"),
                         step=_int(_req(d, "step", "optimizer"), "optimizer.step"), hyper=hyper,
                         param_optimizers=owners)


def parse_optimizer(raw: Any, where: str) -> OptimizerInfo:
    """The manifest's ``optimizer`` section parsed on its own (``ckpt import`` reads one that
    ``ckpt export --optimizer`` carried in a safetensors header), with the manifest's own checks."""
    try:
        return _optimizer(raw)
    except _Bad as e:
        raise FormatError(f"{where}: {e}") from None


# name -> (parser, required when strict). Sections parse independently, so a lenient read keeps
# every good one.
_SECTIONS: dict[str, Any] = {
    "topology": _topology,
    "model": lambda raw: _config(ModelConfig, raw, "model"),
    "param_dtype": lambda raw: _str(raw, "param_dtype"),
    "optimizer": _optimizer,
    "bucket_size": lambda raw: None if raw is None else _int(raw, "bucket_size", low=1),
    "buffers": _buffers,
    "files": _files,
}


def parse_manifest(obj: Any, source: str, strict: bool = True) -> Manifest:
    """Type-check a decoded ``gtp_manifest.json``; see the module docstring for ``strict``."""
    fix = "restore gtp_manifest.json from the run that wrote the checkpoint"
    try:
        d = _obj(obj, "the manifest")
        if d.get("format") != FORMAT_TAG:
            raise _Bad("format", f"is {_short(d.get('format'))}, not {FORMAT_TAG!r}: not a gtp-ckpt manifest")
        version = _int(_req(d, "format_version", ""), "format_version")
        if version > MANIFEST_VERSION:
            raise ManifestError(f"{source}: manifest version {version} is newer than this tool ({MANIFEST_VERSION}); "
                                "upgrade gtp-ckpt")
        layout = _str(d.get("layout", LAYOUTS[0]), "layout")
        sharding = _str(d.get("optimizer_sharding", OPTIMIZER_SHARDINGS[0]), "optimizer_sharding")
        if layout not in LAYOUTS:
            raise _Bad("layout", f"is {layout!r}, not one of {LAYOUTS}")
        if sharding not in OPTIMIZER_SHARDINGS:
            raise _Bad("optimizer_sharding", f"is {sharding!r}, not one of {OPTIMIZER_SHARDINGS}")
        head = dict(format_version=version, layout=layout, optimizer_sharding=sharding,
                    iteration=_iteration(_req(d, "iteration", "")),
                    hash_algorithm=_str(d.get("hash_algorithm") or LEGACY_HASH_ALGORITHM, "hash_algorithm"),
                    notes=_list(d.get("notes", []), "notes"))
    except _Bad as e:
        raise ManifestError(f"{source}: {e}; {fix}") from None
    parsed: dict[str, Any] = {}
    problems: list[str] = []
    strict_error = None
    for name, parse in _SECTIONS.items():
        try:
            if name not in d and name != "bucket_size":
                strict_error = strict_error or f"{source}: {_Bad(name, 'is missing')}; {fix}"
            parsed[name] = parse(d[name]) if name in d else None
        except _Bad as e:
            strict_error = strict_error or f"{source}: {e}; {fix}"
            problems.append(str(e))
            parsed[name] = None
        if strict and strict_error is not None:
            raise ManifestError(strict_error)
    extra = {k: v for k, v in d.items() if k not in _KNOWN}
    return Manifest(**head, **parsed, extra=extra, problems=problems, strict_error=strict_error)


def read_manifest(folder: Path, strict: bool = True) -> Manifest:
    """Read and parse ``folder/gtp_manifest.json`` through the confined, bounded JSON reader."""
    from gtp_format.safe_json import load_json_object

    path = folder / MANIFEST_FILE
    return parse_manifest(load_json_object(path, "the manifest"), str(path), strict=strict)
