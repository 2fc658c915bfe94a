"""Chunk records of a migrated folder: carried over from SRC's where its bytes are SRC's, hashed otherwise.

A migration links SRC's data files and writes one new file. Every chunk of the output is either
bytes of a linked file (a surviving chunk, renamed to its writer's ``.cp_rank_{i}`` key, at the
same file and range) or a chunk of the new file (a rebuilt master, a zeroed moment).

* SRC has records (a checkpoint saved with them): a linked chunk keeps SRC's hash and statistics
  for that file and range, renamed to its new key. Nothing is re-hashed: a fresh hash of SRC's
  bytes would bless them even if they were damaged (the red team's "laundering"), where SRC's own
  hash lets ``verify --data`` of the output find the damage. The new file is hashed.
* SRC has none (saved before the records, which an aliased checkpoint usually was): each linked
  file is read once (:func:`gtp_format.integrity.record_file.record_file`), and its CRC-32C from that
  same read must equal SRC's manifest entry before its hashes are trusted; a mismatch refuses the
  migration (exit 1), as ``reshard`` and ``export`` refuse a damaged source. A file whose manifest
  names no CRC-32C (older manifests: CRC-32) cannot be checked that way, so the output then gets no
  records at all: records that cover part of a checkpoint are reported as incomplete.

The new file is read back once for its hashes (it holds only the lost state); its CRC-32C from that
read must equal the one computed as it was written.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from gtp_format.errors import EXIT_CHECK_FAILED, FormatError
from gtp_format.integrity.record_file import Span, record_file
from gtp_format.integrity.records import ChunkRecord, read_records
from gtp_format.manifest import HASH_ALGORITHM, FileEntry
from gtp_format.model import Checkpoint


def migrated_records(src: Checkpoint, out: Path, metadata: Any, files: dict[str, FileEntry], new_file: str | None
                     ) -> list[ChunkRecord] | None:
    """The records of the folder ``out`` (its data files written; ``metadata`` the DCP ``Metadata`` its
    ``.metadata`` holds, ``files`` its manifest entries), or None when SRC's files cannot vouch for their
    bytes (see the module docstring)."""
    have = read_records(src)
    if have is not None and (have.problems or not have.by_chunk):
        have = None  # unusable records: hash and check the files instead, as for a source without them
    by_bytes = {(r.file, r.offset, r.length): r for r in have.by_chunk.values()} if have is not None else {}
    spans: dict[str, list[Span]] = defaultdict(list)
    records: list[ChunkRecord] = []
    for index, info in metadata.storage_data.items():
        key, offsets = index.fqn, tuple(index.offset or ())
        rec = by_bytes.get((info.relative_path, info.offset, info.length)) if info.relative_path != new_file else None
        if rec is not None:
            records.append(rec._replace(key=key, offsets=offsets))
        else:
            spans[info.relative_path].append(Span(key, offsets, info.offset, info.length, None))
    for rel, todo in sorted(spans.items()):
        want = files.get(rel)
        if want is None or HASH_ALGORITHM not in want.checksums:
            return None
        entry, recs = record_file(out / rel, rel, todo)
        if entry != FileEntry(want.size, {HASH_ALGORITHM: want.checksums[HASH_ALGORITHM]}):
            raise FormatError(f"{src.root / rel if rel != new_file else out / rel}: its {HASH_ALGORITHM} is "
                              f"{entry.checksums[HASH_ALGORITHM]} ({entry.size} bytes) but the manifest says "
                              f"{want.checksums[HASH_ALGORITHM]} ({want.size} bytes): its bytes are damaged; nothing "
                              "was written; restore it from a good copy", EXIT_CHECK_FAILED)
        records += recs
    return records



