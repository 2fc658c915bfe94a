"""Lineage: which run wrote a checkpoint, from which checkpoint it descends, and a root hash of its content.

The failures users meet in practice are checkpoints that are complete, self-consistent and wrong: an
async save that wrote the first save's state again under later names, a resume that started fresh
optimizers, a marker naming the wrong step, another run's iterations in a reused folder. A checksum
of each file, or the chunk hashes checked inside one checkpoint, sees none of them; the same chunk
hashes compared *across* iterations do. So every checkpoint our writers produce carries, in its
manifest (section ``lineage``, a top-level field kept in :attr:`Manifest.extra` like the run state):

* ``run_id``: made at the run's first save (random, 32 hex digits), carried through ``--load``;
* ``iteration`` and ``consumed_samples`` as the writer knew them (checked against the folder name);
* ``topology``: a digest of the manifest's parallel sizes;
* ``root_hash``: SHA-256 over the sorted chunk records (key, offsets, chunk hash), computed by the one
  writer from the records it was handed: no extra read. ``digests`` splits it by what the chunks hold
  (weights, fp32 masters, moments, other), which is what ``ckpt log`` compares;
* ``parent``: the run id, root hash and iteration of the checkpoint this one descends from (``via``
  ``load`` for a resumed run; ``reshard``, ``export``, ``import``, ``migrate`` for a converted one),
  or null for a fresh run.

Why SHA-256 and not the chunk hash: the root names a whole checkpoint and is compared across runs and
tools, where a 128-bit non-cryptographic hash could be forged to collide; it is computed over one short
line per chunk, so its cost is that of the record list (1.8 s of CPU per million chunks, measured on
this machine; rank 0 pays it once per save, after every rank wrote).

Untrusted input: :func:`parse_lineage` checks every field and bounds every string (ids are lowercase
hex of a fixed length, so no control character or escape sequence reaches a terminal); a bad section
is one line naming the field. Checkpoints written before lineage have no section and stay readable.
"""

from __future__ import annotations

import hashlib
import json
import re
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from gtp_format.errors import FormatError
from gtp_format.names import (
    ATTESTATION_FILE,  # a conversion's record beside its output
    ATTESTATION_SUFFIX,
    OPT_PREFIX,
    parse_optimizer_key,
)

LINEAGE_KEY = "lineage"
LINEAGE_VERSION = 1  # the newest lineage section this tool reads

ATTESTATION_VERSION = 1
VIAS = ("load", "reshard", "export", "import", "migrate")
CATEGORIES = ("weights", "masters", "moments", "rng", "other")
RUN_ID_RE = re.compile(r"[0-9a-f]{32}")
ROOT_RE = re.compile(r"[0-9a-f]{64}")
TOPOLOGY_RE = re.compile(r"[0-9a-f]{16}")
_SECTION_KEYS = {"version", "run_id", "iteration", "consumed_samples", "topology", "root_hash", "digests",
                 "parent", "writer"}
_PARENT_KEYS = {"run_id", "root_hash", "iteration", "via"}
MAX_WRITER = 200


@dataclass(frozen=True)
class Parent:
    """The checkpoint a checkpoint descends from (any field may be unknown: an old source has no run id)."""

    run_id: str | None
    root_hash: str | None
    iteration: int | None
    via: str

    def to_json(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "root_hash": self.root_hash, "iteration": self.iteration, "via": self.via}


@dataclass(frozen=True)
class Lineage:
    run_id: str
    iteration: int
    consumed_samples: int | None
    topology: str | None
    root_hash: str | None = None  # None: the checkpoint has no chunk records to hash
    digests: dict[str, str] = field(default_factory=dict)
    parent: Parent | None = None
    writer: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"version": LINEAGE_VERSION, "run_id": self.run_id, "iteration": self.iteration,
                "consumed_samples": self.consumed_samples, "topology": self.topology, "root_hash": self.root_hash,
                "digests": dict(self.digests), "parent": None if self.parent is None else self.parent.to_json(),
                "writer": self.writer}


def new_run_id() -> str:
    return uuid.uuid4().hex


def topology_digest(topology: Any) -> str | None:
    """16 hex digits naming a parallel layout (the manifest's ``topology`` object, or None)."""
    if topology is None:
        return None
    if hasattr(topology, "to_dict"):
        topology = {**topology.to_dict(), "world_size": topology.world_size}
    text = json.dumps(topology, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def category(key: str) -> str:
    """What a chunk holds, by its key: ``weights``, fp32 ``masters``, ``moments``, ``rng`` or ``other``
    (bucket sizes, Megatron's common state). Megatron's per-parameter optimizer keys
    (``optimizer.state.exp_avg.*``, ``optimizer.state.fp32_param.*``) are read by name too."""
    opt = parse_optimizer_key(key)
    if opt is not None:
        return "masters" if opt.state == "param" else "moments" if opt.state.startswith("exp_avg") else "other"
    base = key.split("/", 1)[0]
    if base.startswith("rng_state"):
        return "rng"
    if base.startswith("optimizer") or OPT_PREFIX in base or base.startswith("common"):
        if ".exp_avg" in base:
            return "moments"
        return "masters" if "fp32_param" in base else "other"
    return "weights"


Triple = tuple[str, tuple[int, ...], str]  # (key, offsets, chunk hash)


def digests_of(chunks: Iterable[Triple]) -> tuple[str, dict[str, str]]:
    """The root hash over every chunk and one digest per category present, from (key, offsets, hash)
    triples in any order. Lines are ``key NUL offsets NUL hash LF``, sorted by (key, offsets)."""
    root = hashlib.sha256()
    parts: dict[str, Any] = {}
    kinds: dict[str, Any] = {}  # key -> its category's hasher: a key has many chunks, parsed once
    for key, offsets, digest in sorted(chunks):
        line = f"{key}\0{','.join(map(str, offsets))}\0{digest}\n".encode("utf-8", "surrogatepass")
        root.update(line)
        h = kinds.get(key)
        if h is None:
            cat = category(key)
            h = kinds[key] = parts.setdefault(cat, hashlib.sha256())
        h.update(line)
    return root.hexdigest(), {c: parts[c].hexdigest() for c in CATEGORIES if c in parts}


def with_hashes(section: dict[str, Any], chunks: Iterable[Triple]) -> dict[str, Any]:
    """A lineage section (as written) with its root hash and digests filled in from the records."""
    root, parts = digests_of(chunks)
    return {**section, "root_hash": root, "digests": parts}


class LineageError(FormatError):
    """A lineage section or attestation that fails its checks (exit 2, one line naming the field)."""


def _bad(where: str, path: str, what: str) -> LineageError:
    return LineageError(f"{where}: lineage {path} {what}; the checkpoint's lineage cannot be trusted (restore "
                        "gtp_manifest.json from the run that wrote it)")


def _short(v: Any) -> str:
    text = repr(v) if isinstance(v, (int, float, bool, type(None))) else type(v).__name__
    if isinstance(v, str):
        text = ascii(v[:24]) + ("..." if len(v) > 24 else "")
    return text


def _hex(v: Any, pattern: re.Pattern[str], where: str, path: str, optional: bool = True) -> str | None:
    if v is None and optional:
        return None
    if not isinstance(v, str) or not pattern.fullmatch(v):
        raise _bad(where, path, f"is {_short(v)}, not {'null or ' if optional else ''}a lowercase hex id")
    return v


def _count(v: Any, where: str, path: str, optional: bool = True) -> int | None:
    if v is None and optional:
        return None
    if type(v) is not int or not 0 <= v <= 1 << 62:
        raise _bad(where, path, f"is {_short(v)}, not an integer in [0, 2**62]")
    return v


def parse_parent(raw: Any, where: str, path: str = "parent") -> Parent | None:
    if raw is None:
        return None
    if not isinstance(raw, dict) or not set(raw) <= _PARENT_KEYS:
        raise _bad(where, path, f"is {_short(raw)}, not an object of {sorted(_PARENT_KEYS)}")
    via = raw.get("via")
    if via not in VIAS:
        raise _bad(where, f"{path}.via", f"is {_short(via)}, not one of {VIAS}")
    return Parent(run_id=_hex(raw.get("run_id"), RUN_ID_RE, where, f"{path}.run_id"),
                  root_hash=_hex(raw.get("root_hash"), ROOT_RE, where, f"{path}.root_hash"),
                  iteration=_count(raw.get("iteration"), where, f"{path}.iteration"), via=via)


def parse_lineage(raw: Any, where: str) -> Lineage:
    """Type-check a ``lineage`` section; :class:`LineageError` (one line naming the field) when it fails."""
    if not isinstance(raw, dict):
        raise _bad(where, "section", f"is {_short(raw)}, not an object")
    version = raw.get("version")
    if type(version) is not int or version < 1:
        raise _bad(where, "version", f"is {_short(version)}, not a positive integer")
    if version > LINEAGE_VERSION:
        raise LineageError(f"{where}: lineage version {version} is newer than this tool ({LINEAGE_VERSION}); "
                           "upgrade gtp-ckpt")
    unknown = sorted(set(raw) - _SECTION_KEYS)
    if unknown:
        raise _bad(where, ascii(unknown[0][:40]), "is a field this version does not know")
    digests = raw.get("digests") or {}
    if not isinstance(digests, dict) or not set(digests) <= set(CATEGORIES):
        raise _bad(where, "digests", f"is {_short(digests)}, not an object keyed by {CATEGORIES}")
    writer = raw.get("writer", "")
    if not isinstance(writer, str) or len(writer) > MAX_WRITER or not writer.isprintable():
        raise _bad(where, "writer", f"is {_short(writer)}, not a printable string of at most {MAX_WRITER} characters")
    run_id = _hex(raw.get("run_id"), RUN_ID_RE, where, "run_id", optional=False)
    assert run_id is not None
    parent = parse_parent(raw.get("parent"), where)
    root = _hex(raw.get("root_hash"), ROOT_RE, where, "root_hash")
    if parent is not None and root is not None and parent.root_hash == root and parent.run_id == run_id:
        raise _bad(where, "parent", "names the checkpoint itself (a loop)")
    iteration = _count(raw.get("iteration"), where, "iteration", optional=False)
    assert iteration is not None
    return Lineage(run_id=run_id, iteration=iteration,
                   consumed_samples=_count(raw.get("consumed_samples"), where, "consumed_samples"),
                   topology=_hex(raw.get("topology"), TOPOLOGY_RE, where, "topology"), root_hash=root,
                   digests={k: str(_hex(v, ROOT_RE, where, f"digests.{k}", optional=False))
                            for k, v in digests.items()},
                   parent=parent, writer=writer)


def lineage_of(extra: dict[str, Any], where: str) -> Lineage | None:
    """The manifest's lineage (``Manifest.extra``), None when it has none (written before lineage)."""
    raw = extra.get(LINEAGE_KEY)
    return None if raw is None else parse_lineage(raw, where)


def short(h: str | None, n: int = 12) -> str:
    return "-" if h is None else h[:n]


def _consumed(manifest: Any) -> int | None:
    from gtp_format.names import CONSUMED_SAMPLES, DATA_POSITION_KEY

    pos = manifest.extra.get(DATA_POSITION_KEY)
    n = pos.get(CONSUMED_SAMPLES) if isinstance(pos, dict) else None
    return n if type(n) is int and n >= 0 else None


def complete_lineage(raw: dict[str, Any], manifest: Any, records: list[Any] | None) -> dict[str, Any]:
    """The section a writer hands in (run id, parent, writer) completed from the manifest (iteration,
    consumed samples, topology) and the chunk records it was handed (root hash, digests; none: null)."""
    out = {"version": LINEAGE_VERSION, **raw, "iteration": manifest.iteration,
           "consumed_samples": _consumed(manifest), "topology": topology_digest(manifest.topology)}
    if records is None:
        return {**out, "root_hash": None, "digests": {}}
    return with_hashes(out, ((r.key, tuple(r.offsets), r.digest) for r in records))


def lineage_section(run_id: str, parent: Parent | None, writer: str) -> dict[str, Any]:
    """What a writer puts into ``Manifest.extra[LINEAGE_KEY]`` before ``CheckpointWriter.finish``."""
    return {"version": LINEAGE_VERSION, "run_id": run_id, "parent": None if parent is None else parent.to_json(),
            "writer": writer}


def target_of(manifest: Any, records: list[Any] | None) -> dict[str, Any]:
    """An attestation's ``target``: the output's root hash (from the records handed to the writer),
    iteration and run id."""
    root = None if records is None else digests_of((r.key, tuple(r.offsets), r.digest) for r in records)[0]
    lin = manifest.extra.get(LINEAGE_KEY) if manifest is not None else None
    return {"root_hash": root, "iteration": None if manifest is None else manifest.iteration,
            "run_id": lin.get("run_id") if isinstance(lin, dict) else None}


def source_identity(ckpt: Any) -> tuple[Lineage | None, str | None]:
    """A source checkpoint's lineage (None when it has none) and root hash: the recorded one, else computed
    from its chunk records (a metadata read), else None (no records)."""
    lin = lineage_of(ckpt.manifest.extra, str(ckpt.root)) if ckpt.manifest is not None else None
    if lin is not None and lin.root_hash is not None:
        return lin, lin.root_hash
    from gtp_format.integrity.records import read_records

    records = read_records(ckpt)
    if records is None or records.problems or not records.by_chunk:
        return lin, None
    return lin, digests_of((k, o, r.digest) for (k, o), r in records.by_chunk.items())[0]


def derived(ckpt: Any, via: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """For a conversion of ``ckpt`` (``via`` reshard, export, import, migrate): the output's lineage section
    (a new run id, the source as parent) and the attestation's ``source``."""
    from gtp_format import __version__

    lin, root = source_identity(ckpt)
    iteration = ckpt.manifest.iteration if ckpt.manifest is not None else ckpt.iteration
    parent = Parent(run_id=None if lin is None else lin.run_id, root_hash=root,
                    iteration=iteration if type(iteration) is int else None, via=via)
    source = {"path": str(ckpt.root), **parent.to_json()}
    source.pop("via")
    # the output continues the source's run (a run resumed from a resharded copy is the same run); a source
    # without lineage gets a new id, so the output still names one
    run_id = parent.run_id or new_run_id()
    return lineage_section(run_id, parent, f"ckpt {via} {__version__}"), source


def imported(folder: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """For ``ckpt import`` of the Hugging Face folder ``folder``: the output's lineage section and the
    attestation's ``source``. A folder ``ckpt export`` wrote carries its attestation, which names the
    original checkpoint: the import's parent is that (run id and iteration) with the folder's own root
    hash; any other folder has no known ancestry (a new run id, no parent)."""
    from gtp_format import __version__

    att = read_attestation(folder)
    writer = f"ckpt import {__version__}"
    if att is None:
        return lineage_section(new_run_id(), None, writer), {"path": str(folder), "run_id": None, "root_hash": None,
                                                             "iteration": None}
    parent = Parent(run_id=att.source["run_id"], root_hash=att.target["root_hash"],
                    iteration=att.source["iteration"], via="import")
    source = {"path": str(folder), **parent.to_json()}
    source.pop("via")
    return lineage_section(parent.run_id or new_run_id(), parent, writer), source


def attestation(command: str, source: dict[str, Any], tensors: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A conversion's record (``gtp_attestation.json``): what was converted from what, by which command and
    version; the writer adds ``target`` at finish. ``tensors``: per-tensor correspondence where cheap."""
    from gtp_format import __version__

    out: dict[str, Any] = {"version": ATTESTATION_VERSION, "command": command, "tool": f"gtp-ckpt {__version__}",
                           "source": source}
    if tensors is not None:
        out["tensors"] = tensors
    return out


MAX_ATTESTED_TENSORS = 1 << 20


@dataclass(frozen=True)
class Attestation:
    command: str
    tool: str
    source: dict[str, Any]
    target: dict[str, Any]
    tensors: int  # how many per-tensor rows it carries

    def to_json(self) -> dict[str, Any]:
        return {"command": self.command, "tool": self.tool, "source": self.source, "target": self.target,
                "tensors": self.tensors}


def parse_attestation(raw: Any, where: str) -> Attestation:
    """Type-check a ``gtp_attestation.json``; one line naming the field when it fails."""
    def bad(path: str, what: str) -> LineageError:
        return LineageError(f"{where}: attestation {path} {what}; it cannot be trusted")

    if not isinstance(raw, dict) or raw.get("version") != ATTESTATION_VERSION:
        raise bad("version", f"is {_short(raw.get('version') if isinstance(raw, dict) else raw)}, not "
                  f"{ATTESTATION_VERSION}")
    command, tool = raw.get("command"), raw.get("tool")
    for name, v in (("command", command), ("tool", tool)):
        if not isinstance(v, str) or len(v) > MAX_WRITER or not v.isprintable():
            raise bad(name, f"is {_short(v)}, not a printable string of at most {MAX_WRITER} characters")
    out: dict[str, dict[str, Any]] = {}
    for side in ("source", "target"):
        d = raw.get(side)
        if not isinstance(d, dict):
            raise bad(side, f"is {_short(d)}, not an object")
        path = d.get("path")
        if path is not None and (not isinstance(path, str) or len(path) > 4096 or not path.isprintable()):
            raise bad(f"{side}.path", "is not a printable path")
        out[side] = {"path": path, "run_id": _hex(d.get("run_id"), RUN_ID_RE, where, f"{side}.run_id"),
                     "root_hash": _hex(d.get("root_hash"), ROOT_RE, where, f"{side}.root_hash"),
                     "iteration": _count(d.get("iteration"), where, f"{side}.iteration")}
    tensors = raw.get("tensors", [])
    if not isinstance(tensors, list) or len(tensors) > MAX_ATTESTED_TENSORS:
        raise bad("tensors", f"is not a list of at most {MAX_ATTESTED_TENSORS} rows")
    assert isinstance(command, str) and isinstance(tool, str)
    return Attestation(command=command, tool=tool, source=out["source"], target=out["target"], tensors=len(tensors))


ATTESTATION_LIMIT = 64 << 20  # bytes read at most: 1M per-tensor rows of a few dozen bytes


def read_attestation(root: Any) -> Attestation | None:
    """The ``gtp_attestation.json`` beside a checkpoint (None when there is none); raises
    :class:`FormatError` (one line) when it is damaged or fails its checks."""
    from gtp_format.reader.storage import is_regular_inside
    from gtp_format.safe_json import load_json_object

    if is_regular_inside(root, ATTESTATION_FILE) is None:
        return None
    raw = load_json_object(root / ATTESTATION_FILE, "the attestation", limit=ATTESTATION_LIMIT)
    return parse_attestation(raw, str(root / ATTESTATION_FILE))


def attestation_beside(path: Any) -> Any:
    """Where a one-file output's attestation lies (``export --to torch``): ``<file>.gtp_attestation.json``
    in the same folder (or bucket prefix), since a file has no folder of its own to hold one."""
    return path.parent / (path.name + ATTESTATION_SUFFIX)


def read_file_attestation(path: Any) -> Attestation | None:
    """The attestation beside the one-file output ``path`` (None when there is none); one line when damaged."""
    from gtp_format.reader.storage import is_regular_inside
    from gtp_format.safe_json import load_json_object

    beside = attestation_beside(path)
    if is_regular_inside(path.parent, beside.name) is None:
        return None
    raw = load_json_object(beside, "the attestation", limit=ATTESTATION_LIMIT)
    return parse_attestation(raw, str(beside))


def identity_report(ckpt: Any) -> tuple[dict[str, Any] | None, dict[str, Any] | None, list[str]]:
    """``inspect``'s lineage and attestation (JSON-able, None when absent) and what could not be used
    (a line each: a damaged section is shown as a note, never trusted)."""
    notes: list[str] = []
    lin = att = None
    if ckpt.manifest is not None:
        try:
            parsed = lineage_of(ckpt.manifest.extra, str(ckpt.root))
            lin = None if parsed is None else parsed.to_json()
        except FormatError as e:
            notes.append(e.message)
    try:
        a = read_attestation(ckpt.root)
        att = None if a is None else a.to_json()
    except FormatError as e:
        notes.append(e.message)
    return lin, att, notes
