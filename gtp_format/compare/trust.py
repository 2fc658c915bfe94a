"""When a comparison may skip a chunk pair on equal recorded hashes, and what its verdict then rests on.

Equal chunk hashes (``gtp_chunks.json``) let ``diff`` skip reading a pair, so two copies compare
in milliseconds. But a hash in a side file is a claim, not a reading: a folder whose records (and
the manifest's line for them) were replaced by another run's claims "equal" for chunks whose bytes
differ. What this module adds, without reading a data byte:

* records are trusted only where a manifest checksums them: a folder without one (Megatron's
  layout) has a side file that vouches for itself, so its chunks are read;
* the records are checked against the manifests' own file checksums: two data files whose
  CRC-32C (or size) differ must differ in some byte, so when every chunk pair the records put in
  those two files claims "equal", the records contradict the manifests and those pairs are read.
  A pair of files that holds a pair the records say differs explains its checksums, and the
  others are trusted (a forged record beside a genuine difference is left to ``verify --data``
  and ``--read-all``);
* :class:`Basis` counts what every verdict rests on: pairs read, pairs taken on records, pairs
  read because the records were contradicted. ``diff`` prints it beside the verdict and in its
  JSON, so "identical" never stands without saying whether bytes were read.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from gtp_format.model import BYTES, Chunk, Entry

READ = "bytes read"
RECORDS = "recorded hashes (not re-read)"
MIXED = "bytes read and recorded hashes (not re-read)"


def digest(src: Any, e: Entry, c: Chunk) -> str | None:
    """A source's recorded hash of a chunk; sources without ``digest`` have none."""
    get = getattr(src, "digest", None)
    return get(e, c) if get is not None else None


def _file(c: Chunk) -> str | None:
    return c.storage.file if c.storage is not None else None


def _pairs(a: Any, b: Any) -> Iterable[tuple[Entry, Chunk, Entry, Chunk]]:
    """Chunk pairs the engine would compare chunk by chunk, over every common key (selection aside:
    a pair outside ``--keys`` still explains, or fails to explain, its files' checksums)."""
    for key, ea in a.entries.items():
        eb = b.entries.get(key)
        if eb is None or ea.kind != eb.kind:
            continue
        if ea.kind == BYTES:
            if len(ea.chunks) == len(eb.chunks):
                yield from ((ea, x, eb, y) for x, y in zip(ea.chunks, eb.chunks))
            continue
        boxes = {(c.offsets, c.sizes): c for c in eb.chunks}
        for c in ea.chunks:
            cb = boxes.get((c.offsets, c.sizes))
            if cb is not None:
                yield ea, c, eb, cb


def _checksums(src: Any, name: str) -> tuple[int, dict[str, str]] | None:
    get = getattr(src, "file_checksums", None)
    return get(name) if get is not None else None


def _disagree(a: Any, fa: str, b: Any, fb: str) -> bool:
    """Both manifests describe the two files and the descriptions differ (size or a common checksum)."""
    ca, cb = _checksums(a, fa), _checksums(b, fb)
    if ca is None or cb is None:
        return False
    if ca[0] != cb[0]:
        return True
    return any(ca[1][alg] != cb[1][alg] for alg in ca[1].keys() & cb[1].keys())


def contradicted(a: Any, b: Any) -> frozenset[tuple[str, str]]:
    """File pairs (A's file, B's file) whose recorded chunk hashes the manifests' file checksums contradict."""
    claims: dict[tuple[str, str], bool] = {}  # file pair -> some pair there is recorded as different
    for ea, ca, eb, cb in _pairs(a, b):
        fa, fb = _file(ca), _file(cb)
        da, db = digest(a, ea, ca), digest(b, eb, cb)
        if fa is None or fb is None or da is None or db is None:
            continue
        claims[(fa, fb)] = claims.get((fa, fb), False) or da != db
    return frozenset(p for p, differs in claims.items() if not differs and _disagree(a, p[0], b, p[1]))


@dataclass
class Basis:
    """What a comparison's verdict rests on, counted per chunk pair."""

    distrusted: frozenset[tuple[str, str]] = frozenset()
    read: int = 0  # pairs whose bytes were read
    by_records: int = 0  # pairs skipped on equal recorded hashes
    contradicted: int = 0  # pairs read because the manifests' file checksums contradicted their records
    files: set[tuple[str, str]] = field(default_factory=set)

    def equal_by_records(self, a: Any, ea: Entry, ca: Chunk, b: Any, eb: Entry, cb: Chunk) -> bool:
        """True (and counted) when the pair may be skipped; False when it must be read."""
        da = digest(a, ea, ca)
        if da is None or da != digest(b, eb, cb):
            return False
        pair = (_file(ca), _file(cb))
        if pair in self.distrusted:
            self.contradicted += 1
            self.files.add(pair)  # type: ignore[arg-type]
            return False
        self.by_records += 1
        return True

    def describe(self) -> str:
        if self.by_records == 0:
            return READ
        return RECORDS if self.read == 0 else MIXED

    def to_dict(self) -> dict[str, Any]:
        return {"basis": self.describe(), "chunk_pairs_read": self.read, "chunk_pairs_by_records": self.by_records,
                "chunk_pairs_records_contradicted": self.contradicted,
                "files_records_contradicted": sorted([fa, fb] for fa, fb in self.files)}
