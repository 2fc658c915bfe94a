"""``verify --data``'s steps after the structural checks: what to hash, the one data pass, what it found.

Kept apart from :mod:`gtp_format.check.verify` (which lists the steps) because this is where the
three sources of expected digests meet: the manifest's file checksums (less the files whose every
byte a chunk hash covers, :func:`gtp_format.check.hashes.covered_files`), megatron-core's
``integrity.json`` SHA-256 (:mod:`gtp_format.check.megatron_integrity`) and the chunk records.
All of them are computed from one read of each data file (:func:`gtp_format.check.data.check_data`);
then the NaN/Inf counts get their severity by kind of state, and GTP tail padding is read.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gtp_format.check.analysis import KeyClass
from gtp_format.check.data import DataReport, check_data
from gtp_format.check.hashes import match_records
from gtp_format.check.megatron_integrity import integrity_algorithms
from gtp_format.check.padding import find_megatron_padding
from gtp_format.check.values import check_padding, nonfinite_problem
from gtp_format.hashing import HASHERS
from gtp_format.integrity.records import ChunkRecord, read_records
from gtp_format.model import Checkpoint, Problem
from gtp_format.reader.storage import unsafe_reason

Progress = Callable[[int], None]


def _counts(report: DataReport, key: str) -> tuple[int, int, None]:
    """(NaN, Inf, None) of a key the data pass counted: it does not tell the signs of Inf apart."""
    got = report.nonfinite.get(key, {})
    return got.get("nan", 0), got.get("inf", 0), None


def manifest_algorithms(ckpt: Checkpoint) -> dict[str, list[str]]:
    """Data file -> the known checksum algorithms the manifest lists for it (hashed by the data pass)."""
    files = ckpt.manifest.files if ckpt.manifest is not None else None
    if not files:
        return {}
    return {rel: [a for a in spec.checksums if a in HASHERS] for rel, spec in files.items()
            if rel in ckpt.data_files and unsafe_reason(rel) is None}


def data_steps(ckpt: Checkpoint, result: Any, classes: dict[str, KeyClass],
               matched: dict[tuple[str, int], ChunkRecord], covered: set[str], listing: dict[str, str] | None,
               progress: Progress | None, workers: int | None) -> dict[str, dict[str, str]]:
    """Run the data pass and the tail-padding check into ``result``; return the files' digests."""

    unknown = find_megatron_padding(ckpt)
    algorithms = {rel: algos for rel, algos in manifest_algorithms(ckpt).items() if rel not in covered}
    for rel, extra in integrity_algorithms(ckpt, listing).items():
        algorithms[rel] = [*algorithms.get(rel, []), *extra]
    report = check_data(ckpt, algorithms, progress, workers, matched)
    known = ckpt.manifest is not None or ckpt.megatron_metadata is not None
    result.problems += [nonfinite_problem(p.key, *_counts(report, p.key), classes.get(p.key), "counted now", known,
                                          unknown) if p.check == "nonfinite" and p.key else p
                        for p in report.problems]
    result.checks.append("tail_padding")
    result.problems += check_padding(ckpt)
    result.stats["nonfinite"] = report.nonfinite
    result.stats["bytes_read"] = report.bytes_read
    return report.digests


def verify_written(ckpt: Checkpoint, files: frozenset[str]) -> list[Problem]:
    """``verify --data``'s own pass over the data files a writer wrote, before it commits them.

    Every chunk stored in ``files`` is decoded and checked against its chunk record, and each file
    is hashed against the manifest's checksums, under the readers' rules (holes and all). A writer
    whose other files are links to a source it did not change (``migrate-aliased``) checks only what
    it wrote: re-reading terabytes of linked data would make the migration cost a full read.
    """
    want = {rel: algos for rel, algos in manifest_algorithms(ckpt).items() if rel in files}
    records = read_records(ckpt)
    matched = match_records(ckpt, records)[0] if records is not None else {}
    report = check_data(ckpt, want, records=matched, files=files)
    problems = [p for p in report.problems if p.severity == "error"]
    specs = ckpt.manifest.files if ckpt.manifest is not None and ckpt.manifest.files else {}
    for rel, algos in sorted(want.items()):
        got = report.digests.get(rel, {})
        for a in algos:
            expected = specs[rel].checksums[a].lower()
            if rel in got and got[a] != expected:
                problems.append(Problem("error", "checksum", f"{a} is {got[a]} but the manifest says {expected}",
                                        file=rel))
    return problems
