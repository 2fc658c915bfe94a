"""What ``inspect`` says about a checkpoint's integrity records, and ``inspect --stats``' per-key view.

Metadata only: the records are read from ``gtp_chunks.json`` (a side file, like ``.metadata``),
never from the data files, so the statistics of a multi-TB checkpoint print in the time of one
small JSON read.
"""

from __future__ import annotations

from typing import Any

from gtp_format.integrity.hash import CHUNK_HASH
from gtp_format.integrity.records import NO_RECORDS, Records
from gtp_format.integrity.stats import ChunkStats
from gtp_format.model import Checkpoint
from gtp_format.names import CHUNK_RECORDS_FILE
from gtp_format.names import CHUNK_RECORDS_SECTION as SECTION


def integrity_line(ckpt: Checkpoint, records: Records | None) -> str:
    """One line: which integrity records the checkpoint carries (``records``: read, or None to use the
    manifest's announcement alone)."""
    head = ckpt.manifest.extra.get(SECTION) if ckpt.manifest is not None else None
    if head is None and ckpt.manifest is None and records is None:
        from gtp_format.reader.storage import is_regular_inside

        if is_regular_inside(ckpt.store, CHUNK_RECORDS_FILE) is not None:  # Megatron's layout, written by ckpt export
            return f"{CHUNK_HASH} per chunk ({CHUNK_RECORDS_FILE}, no manifest)"
    if head is None and records is None:
        return NO_RECORDS if ckpt.manifest is not None and ckpt.manifest.files else "no manifest checksums"
    if records is None:
        assert head is not None
        count = head.get("count") if isinstance(head, dict) else None
        return f"{head.get('hash') if isinstance(head, dict) else '?'} per chunk ({count} chunk records)"
    if records.problems and not records.by_chunk:
        return f"chunk records unusable: {records.problems[0].message}"
    with_stats = sum(r.stats is not None for r in records.by_chunk.values())
    return f"{CHUNK_HASH} per chunk ({len(records.by_chunk)} chunks, statistics for {with_stats})"


def key_stats(records: Records, selected: set[str] | None = None) -> dict[str, ChunkStats]:
    """The statistics of each key, its chunks' merged (keys whose chunks have none are left out)."""
    out: dict[str, ChunkStats] = {}
    for (key, _), rec in sorted(records.by_chunk.items()):
        if rec.stats is None or (selected is not None and key not in selected):
            continue
        out[key] = out[key].merge(rec.stats) if key in out else rec.stats
    return out


def chunk_stats_rows(ckpt: Checkpoint, records: Records, selected: set[str]) -> list[dict[str, Any]]:
    """Per chunk (``--format json``): key, chunk index, offsets, file, bytes, hash and statistics."""
    rows = []
    for key in sorted(selected):
        for c in ckpt.entries[key].chunks:
            rec = records.get(key, c.offsets)
            if rec is not None:
                rows.append({"key": key, "chunk": c.index, "offsets": list(c.offsets), "file": rec.file,
                             "byte_offset": rec.offset, "length": rec.length, CHUNK_HASH: rec.digest,
                             "stats": None if rec.stats is None else rec.stats.to_json()})
    return rows
