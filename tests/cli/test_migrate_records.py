"""Chunk records of ``ckpt migrate-aliased``'s output (fixtures/gtp/aliased_cp2_g2_dp2, copied).

Expectations are independent of the writer: digests are recomputed with ``xxhash`` over the byte
ranges the output's own metadata gives, and damage is one flipped byte in a copy (the output's data
files are hard links to SRC's, so a test never flips a byte in a linked file in place).
"""

from __future__ import annotations

import json
import shutil
from collections import defaultdict
from pathlib import Path

import pytest
import xxhash
from cli_helpers import assert_error_line, cli
from damage import flip_inside_a_chunk

from gtp_format.check.verify import verify
from gtp_format.integrity.record_file import Span, record_file
from gtp_format.integrity.records import read_records, section, write_records
from gtp_format.reader.checkpoint import open_checkpoint

ROOT = Path(__file__).resolve().parents[2]
ALIASED = ROOT / "fixtures" / "gtp" / "aliased_cp2_g2_dp2"
ITER = "iter_0000002"

pytestmark = pytest.mark.skipif(not (ALIASED / ITER).is_dir(),
                                reason="run python fixtures/make_fixtures.py to generate fixtures/gtp")


def _copy(dst: Path) -> Path:
    shutil.copytree(ALIASED, dst, symlinks=True)
    return dst


def _new_file(folder: Path) -> str:
    """The data file the migration wrote (the rest are SRC's, linked), as its manifest records it."""
    return json.loads((folder / "gtp_manifest.json").read_text())["migration"]["new_data_file"]


def _hash_errors(folder: Path) -> list:
    return [p for p in verify(open_checkpoint(folder), data=True).problems if p.check == "chunk_hash"]


def _check_records_are_the_bytes(folder: Path) -> dict:
    ckpt = open_checkpoint(folder)
    recs = read_records(ckpt)
    assert recs is not None and not recs.problems and len(recs.by_chunk) == ckpt.chunk_count()
    for e in ckpt.entries.values():
        for c in e.chunks:
            r, s = recs.get(e.key, c.offsets), c.storage
            assert (r.file, r.offset, r.length) == (s.file, s.offset, s.length)
            with open(folder / s.file, "rb") as f:
                f.seek(s.offset)
                assert r.digest == xxhash.xxh3_128_hexdigest(f.read(s.length)), (e.key, c.index)
    res = verify(ckpt, data=True)
    assert res.ok and "chunk_records" in res.checks, [p.message for p in res.problems if p.severity == "error"]
    return recs.by_chunk


def test_source_without_records_gets_them_and_verify_names_a_flipped_byte(tmp_path: Path) -> None:
    src = _copy(tmp_path / "src")
    assert read_records(open_checkpoint(src / ITER)) is None  # saved before the records
    r = cli("migrate-aliased", src, tmp_path / "dst", "--reset-lost-moments", "--format", "json")
    assert r.exit_code == 0, r.stderr
    out = tmp_path / "dst" / ITER
    _check_records_are_the_bytes(out)
    new_file = _new_file(out)
    for pred in (lambda f: f == new_file, lambda f: f != new_file):  # a written chunk, then a linked one
        copy = tmp_path / f"copy{len(list(tmp_path.iterdir()))}"
        shutil.copytree(out, copy)  # new inodes: SRC is never touched
        key, index, file, start, stop = flip_inside_a_chunk(copy, pred)
        (p,) = _hash_errors(copy)
        assert (p.key, p.chunk, p.file) == (key, index, file) and f"[{start}, {stop})" in p.message


def test_a_damaged_source_without_records_is_refused_and_nothing_is_written(tmp_path: Path) -> None:
    src = _copy(tmp_path / "src")
    _, _, file, _, _ = flip_inside_a_chunk(src / ITER)
    r = cli("migrate-aliased", src, tmp_path / "dst", "--reset-lost-moments")
    assert_error_line(r, 1, file, "damaged")
    assert not (tmp_path / "dst").exists()


def _add_records(folder: Path) -> None:
    """Give a copy of the fixture the records a save with them would have written (computed here from
    its own metadata), announced and checksummed in its manifest."""
    ckpt = open_checkpoint(folder)
    spans: dict[str, list[Span]] = defaultdict(list)
    for e in ckpt.entries.values():
        for c in e.chunks:
            s = c.storage
            spans[s.file].append(Span(e.key, c.offsets, s.offset, s.length, None))
    recs = [r for rel, todo in spans.items() for r in record_file(folder / rel, rel, todo)[1]]
    write_records(folder, recs)
    m = json.loads((folder / "gtp_manifest.json").read_text())
    crc = record_file(folder / "gtp_chunks.json", "gtp_chunks.json", [])[0]
    m["files"]["gtp_chunks.json"] = {"size": crc.size, **crc.checksums}
    m["chunk_records"] = section(len(recs))
    (folder / "gtp_manifest.json").write_text(json.dumps(m))


def test_source_records_are_carried_over_and_a_damaged_source_is_not_laundered(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import ckpt_tool.migrate.chunk_records as migrate_records

    src = _copy(tmp_path / "src")
    _add_records(src / ITER)
    res = verify(open_checkpoint(src / ITER), data=True)  # an error there: it is aliased, the point of migrating
    assert "chunk_records" in res.checks and not [p for p in res.problems if p.check.startswith("chunk_")]
    theirs = read_records(open_checkpoint(src / ITER))
    read: list[str] = []
    real = migrate_records.record_file
    monkeypatch.setattr(migrate_records, "record_file", lambda *a: (read.append(a[1]), real(*a))[1])
    r = cli("migrate-aliased", src, tmp_path / "dst", "--reset-lost-moments", "--format", "json")
    assert r.exit_code == 0, r.stderr
    new_file = _new_file(tmp_path / "dst" / ITER)
    assert read == [new_file]  # SRC's files are linked, not read
    mine = _check_records_are_the_bytes(tmp_path / "dst" / ITER)
    carried = {(rec.file, rec.offset, rec.length): rec for rec in theirs.by_chunk.values()}
    linked = [rec for rec in mine.values() if rec.file != new_file]
    assert linked and all(carried[(rec.file, rec.offset, rec.length)].digest == rec.digest for rec in linked)
    shutil.rmtree(tmp_path / "dst")
    _, _, file, start, stop = flip_inside_a_chunk(src / ITER)  # damaged after its save; its records say what was saved
    r = cli("migrate-aliased", src, tmp_path / "dst", "--reset-lost-moments")
    assert r.exit_code == 0, r.stderr
    found = _hash_errors(tmp_path / "dst" / ITER)
    assert [(p.file, f"[{start}, {stop})" in p.message) for p in found] == [(file, True)]
