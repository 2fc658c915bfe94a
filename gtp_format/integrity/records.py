"""Chunk records: one per stored chunk, in the side file ``gtp_chunks.json`` that the manifest checksums.

Why a side file and not the manifest: a large checkpoint has millions of chunks, and every command
reads the manifest (``inspect`` on every start); the records are read only by ``verify``,
``inspect --stats`` and ``diff``. The manifest says the records exist (section ``chunk_records``:
format version, hash name, count) and lists ``gtp_chunks.json`` in ``files`` with its CRC-32C like
any other file, so damage to it is caught the way damage to ``.metadata`` is. The file name is
fixed here, never read from a file. Checkpoints written before the records have neither; they
still load and verify on their file checksums, and ``inspect`` says so.

An output in Megatron's own layout (``ckpt export --to fully_reshardable``) has no manifest, since
megatron-core would not know one: its records are found by the fixed name alone, and the side file
then checks itself (its JSON and every field are validated, and a damaged record names its chunk
as a mismatch, never a pass).

A record names its chunk by key and global offsets (what the metadata's chunk index is built from,
stable across readers), and its bytes by file and byte range, so a mismatch can be reported as
"key, chunk, file, [start, stop)" without the metadata.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from gtp_format.commit import write_durable
from gtp_format.errors import FormatError
from gtp_format.integrity.hash import CHUNK_HASH, DIGEST_CHARS
from gtp_format.integrity.stats import ChunkStats
from gtp_format.manifest import Manifest
from gtp_format.model import BYTES, Checkpoint, Problem, ProblemCap
from gtp_format.names import CHUNK_RECORDS_FILE
from gtp_format.names import CHUNK_RECORDS_SECTION as SECTION

RECORDS_VERSION = 1  # the newest side-file version this tool reads
BYTES_PER_RECORD = 1024  # read limit: a generous bound on one record's JSON, times the chunk count
VALUES_PER_RECORD = 96  # parsed values: 6 fields, up to 64 offsets, 8 statistics, their containers
NO_RECORDS = "file-level checksums, no chunk hashes"
STATS_CODE = "chunk_stats"  # a record's statistics cannot be true (Problem code)


class ChunkRecord(NamedTuple):
    key: str
    offsets: tuple[int, ...]
    file: str
    offset: int  # byte range [offset, offset + length) of the chunk's stored bytes in ``file``
    length: int
    digest: str  # CHUNK_HASH of those bytes, lowercase hex
    stats: ChunkStats | None

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "offsets": list(self.offsets), "file": self.file, "offset": self.offset,
                "length": self.length, CHUNK_HASH: self.digest,
                "stats": None if self.stats is None else self.stats.to_json()}

    def where(self) -> str:
        return f"{self.file} bytes [{self.offset}, {self.offset + self.length})"


@dataclass
class Records:
    """The records of one checkpoint, by (key, offsets); ``problems`` for what could not be used."""

    by_chunk: dict[tuple[str, tuple[int, ...]], ChunkRecord] = field(default_factory=dict)
    problems: list[Problem] = field(default_factory=list)

    def get(self, key: str, offsets: tuple[int, ...]) -> ChunkRecord | None:
        return self.by_chunk.get((key, tuple(offsets)))


def section(count: int) -> dict[str, Any]:
    """The manifest's ``chunk_records`` section for ``count`` records (goes into ``Manifest.extra``)."""
    return {"version": RECORDS_VERSION, "hash": CHUNK_HASH, "count": count}


def write_records(folder: Path, records: list[ChunkRecord]) -> None:
    """Write ``gtp_chunks.json`` into a folder being built (fsynced; listed in the manifest by the caller)."""
    body = {"version": RECORDS_VERSION, "hash": CHUNK_HASH,
            "chunks": [r.to_json() for r in sorted(records, key=lambda r: (r.key, r.offsets))]}
    write_durable(folder / CHUNK_RECORDS_FILE, json.dumps(body, separators=(",", ":"), allow_nan=False))


def has_records(manifest: Manifest | None) -> bool:
    return manifest is not None and SECTION in manifest.extra


def _unannounced(ckpt: Checkpoint) -> dict[str, Any] | None:
    """The section a manifest-less folder's side file stands for (Megatron's layout), or None."""
    from gtp_format.reader.storage import is_regular_inside

    if ckpt.manifest is not None or is_regular_inside(ckpt.store, CHUNK_RECORDS_FILE) is None:
        return None
    return {"version": RECORDS_VERSION, "hash": CHUNK_HASH, "count": None}


def read_records(ckpt: Checkpoint) -> Records | None:
    """The checkpoint's records, or None when its manifest announces none (written before them, or foreign)
    and, without a manifest, the folder has no side file.

    Untrusted input: every field is type-checked; a damaged file is one ``error`` problem naming it,
    and a record that fails its checks is left out with a problem (its chunk then goes unhashed).
    """
    head = _unannounced(ckpt)
    if head is None and not has_records(ckpt.manifest):
        return None
    out = Records()
    capped = {c: ProblemCap(c) for c in ("chunk_records", STATS_CODE)}

    def note(message: str) -> None:
        capped["chunk_records"].add(Problem("error", "chunk_records", f"{message}; restore {CHUNK_RECORDS_FILE} from "
                                            "the run that wrote the checkpoint", file=CHUNK_RECORDS_FILE))

    def bad(message: str) -> Records:
        note(message)
        out.problems = [p for c in capped.values() for p in c.done(CHUNK_RECORDS_FILE)]
        return out

    if head is None:
        assert ckpt.manifest is not None
        head = ckpt.manifest.extra[SECTION]
        if not isinstance(head, dict) or type(head.get("version")) is not int or type(head.get("count")) is not int:
            return bad(f"the manifest's {SECTION} section is not {{version, hash, count}}")
    if head["version"] > RECORDS_VERSION:
        out.problems.append(Problem("warning", "chunk_records", f"chunk records version {head['version']} is newer "
                                    f"than this tool ({RECORDS_VERSION}); chunk hashes are not checked: upgrade "
                                    "gtp-ckpt", file=CHUNK_RECORDS_FILE))
        return out
    if head.get("hash") != CHUNK_HASH:
        return bad(f"chunk hash {head.get('hash')!r} is not one this tool computes ({CHUNK_HASH})")
    from gtp_format.safe_json import Budget, load_json_object

    chunks_here = ckpt.chunk_count()
    budget = Budget.per_item(max(head["count"] or 0, chunks_here), BYTES_PER_RECORD, VALUES_PER_RECORD,
                             f"one record per each of the {chunks_here:,} chunks", ceiling=1 << 62)
    try:
        body = load_json_object(ckpt.root / CHUNK_RECORDS_FILE, "the chunk records", budget=budget)
    except FormatError as e:
        return bad(e.message)
    chunks = body.get("chunks")
    if body.get("version") != head["version"] or body.get("hash") != CHUNK_HASH or not isinstance(chunks, list):
        return bad(f"{CHUNK_RECORDS_FILE} does not match the manifest's {SECTION} section" if head["count"] is not None
                   else f"{CHUNK_RECORDS_FILE} is not version {RECORDS_VERSION} {CHUNK_HASH} chunk records")
    if head["count"] is not None and len(chunks) != head["count"]:
        return bad(f"{CHUNK_RECORDS_FILE} holds {len(chunks)} records, the manifest says {head['count']}")
    numels = {(k, c.offsets): c.numel for k, e in ckpt.entries.items() for c in e.chunks if e.kind != BYTES}
    for i, raw in enumerate(chunks):
        rec = _record(raw)
        why = None if rec is None or rec.stats is None else impossible(rec.stats, numels.get((rec.key, rec.offsets)))
        if rec is None:
            note(f"record {i} of {CHUNK_RECORDS_FILE} is ill-formed")
        elif why is not None:
            capped[STATS_CODE].add(Problem(
                "error", STATS_CODE, f"record {i} of {CHUNK_RECORDS_FILE} ({rec.key} at {list(rec.offsets)}) {why}, "
                f"which no stored chunk can have; restore {CHUNK_RECORDS_FILE} from the run that wrote the checkpoint",
                key=rec.key, file=CHUNK_RECORDS_FILE))
        elif (rec.key, rec.offsets) in out.by_chunk:
            note(f"record {i} of {CHUNK_RECORDS_FILE} repeats {rec.key} at {list(rec.offsets)}")
        else:
            out.by_chunk[(rec.key, rec.offsets)] = rec
    out.problems = [p for c in capped.values() for p in c.done(CHUNK_RECORDS_FILE)]
    return out


def _count(v: Any) -> bool:
    return type(v) is int and 0 <= v <= 1 << 62


def _number(v: Any) -> bool:
    return type(v) in (int, float) and math.isfinite(v)


def _stats(raw: Any) -> ChunkStats | None | bool:
    """Parsed statistics, None when the record has none, False when ill-formed."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        return False
    counts = [raw.get(k) for k in ("numel", "nan", "posinf", "neginf", "zeros")]
    lo, hi, sumsq = raw.get("min"), raw.get("max"), raw.get("sumsq")
    if not all(_count(c) for c in counts) or not (sumsq is None or _number(sumsq)):
        return False
    if (lo is None) != (hi is None) or (lo is not None and not (_number(lo) and _number(hi))):
        return False
    return ChunkStats(*counts, None if lo is None else float(lo), None if hi is None else float(hi),
                      math.inf if sumsq is None else float(sumsq))


SLACK = 1e-6  # relative: the fp64 sum of squares is rounded once per element, far below this


def impossible(st: ChunkStats, numel: int | None = None) -> str | None:
    """Why a record's statistics cannot describe any chunk (or this one, of ``numel`` elements), or None.

    Records are untrusted: statistics that no tensor could have (more NaN than elements, min above
    max, a negative sum of squares) are refused before ``inspect --stats`` prints them or ``verify``
    uses them. The checks are the ones every true set of statistics passes, whatever the dtype.
    """
    finite = st.numel - st.nonfinite - st.zeros
    if numel is not None and st.numel != numel:
        return f"counts {st.numel} elements where the chunk has {numel}"
    if finite < 0:
        return (f"counts {st.nan} NaN, {st.posinf + st.neginf} infinities and {st.zeros} zeros in {st.numel} "
                "elements")
    if (st.min is None) != (finite + st.zeros == 0):
        return "gives a min and max without finite values" if st.min is not None else "has finite values but no min"
    if st.min is None or st.max is None:
        return None if st.sumsq in (0.0, math.inf) else "has a sum of squares without finite values"
    if st.min > st.max:
        return f"has min {st.min} above max {st.max}"
    if st.zeros and not st.min <= 0.0 <= st.max:
        return f"counts {st.zeros} zeros outside its range [{st.min}, {st.max}]"
    if st.sumsq < 0.0:
        return f"has a negative sum of squares ({st.sumsq})"
    top = max(st.min * st.min, st.max * st.max)
    if math.isfinite(st.sumsq) and math.isfinite(top):
        if st.sumsq < top * (1 - SLACK) or st.sumsq > top * (finite + st.zeros) * (1 + SLACK):
            return f"has a sum of squares {st.sumsq} that its range and counts cannot give"
    return None


def _record(raw: Any) -> ChunkRecord | None:
    if not isinstance(raw, dict):
        return None
    key, offsets, file, digest = raw.get("key"), raw.get("offsets"), raw.get("file"), raw.get(CHUNK_HASH)
    if not (isinstance(key, str) and isinstance(file, str) and isinstance(offsets, list) and len(offsets) <= 64
            and all(_count(o) for o in offsets) and _count(raw.get("offset")) and _count(raw.get("length"))):
        return None
    if not (isinstance(digest, str) and len(digest) == DIGEST_CHARS
            and all(c in "0123456789abcdef" for c in digest)):
        return None
    stats = _stats(raw.get("stats"))
    if stats is False:
        return None
    return ChunkRecord(key, tuple(offsets), file, raw["offset"], raw["length"], digest, stats or None)
