"""Claims about data that nobody read: ``diff`` on chunk records, and records that cannot be true.

A checkpoint whose chunk records were replaced by another run's (with the manifest's line for the
records) claims "equal" for chunks whose bytes differ. ``diff`` must either read those chunks or
say, in the table and the JSON, that its verdict rests on records; records whose statistics no
chunk can have are a problem with a stable code, never printed as truth.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "helpers"))

from cli_helpers import cli  # noqa: E402
from damage import flip  # noqa: E402

from gtp_format.hashing import file_digests  # noqa: E402
from gtp_format.integrity.records import STATS_CODE, read_records  # noqa: E402
from gtp_format.names import CHUNK_RECORDS_FILE  # noqa: E402
from gtp_format.reader.checkpoint import open_checkpoint  # noqa: E402

FOLD = HERE.parents[1] / "fixtures" / "gtp" / "fold_cp2_g2_dp2"
MANIFEST = "gtp_manifest.json"


@pytest.fixture(scope="module")
def resharded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint with chunk records and a manifest (written by ``reshard``, safetensors: a changed
    element is a different value, not a damaged zip record)."""
    out = tmp_path_factory.mktemp("records") / "a"
    r = cli("reshard", FOLD, out, "--dp", "2", "--layout", "safetensors")  # raw bytes: no zip CRC inside
    assert r.exit_code == 0, r.stderr
    return next(out.glob("iter_*"))


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _refresh_file_checksum(folder: Path, name: str) -> None:
    """Make the manifest describe ``name`` as it now is (another run's data under the first run's records)."""
    doc = json.loads((folder / MANIFEST).read_text())
    entry = doc["files"][name]
    with open(folder / name, "rb") as f:
        entry.update(file_digests(f, [k for k in entry if k != "size"]))
    (folder / MANIFEST).write_text(json.dumps(doc))


def flip_inside_a_chunk(folder: Path) -> tuple[str, str]:
    """Flip a bit of an element of the largest tensor chunk (found by its values inside the stored blob,
    so a zip header is never what changes); return (key, file)."""
    from gtp_format.reader.chunks import load_chunk

    ckpt = open_checkpoint(folder)
    e, c = max(((e, c) for e in ckpt.entries.values() if e.kind != "bytes" for c in e.chunks),
               key=lambda ec: ec[1].numel)
    values = load_chunk(ckpt, e, c).contiguous().numpy().tobytes()
    s = c.storage
    with open(folder / s.file, "rb") as f:
        f.seek(s.offset)
        where = f.read(s.length).find(values)
    assert where >= 0, e.key
    flip(folder / s.file, s.offset + where + len(values) // 2 + 3, 0x10)  # an exponent bit
    return e.key, s.file


def _json(*args: object) -> tuple[int, dict]:
    r = cli(*args, "--format", "json")
    return r.exit_code, json.loads(r.stdout) if r.stdout.strip().startswith("{") else {}


def test_records_of_another_run_are_contradicted_by_the_file_checksums(resharded: Path, tmp_path: Path):
    """B's bytes differ and its manifest says so (its file checksum), but its records are A's: read, DIFFERENT."""
    b = _copy(resharded, tmp_path / "b")
    key, file = flip_inside_a_chunk(b)
    _refresh_file_checksum(b, file)
    code, doc = _json("diff", resharded, b)
    assert code == 1 and not doc["equal"] and key in {d["key"] for d in doc["differences"]}
    assert doc["chunk_pairs_records_contradicted"] > 0 and [file, file] in doc["files_records_contradicted"]
    r = cli("diff", resharded, b)
    assert r.exit_code == 1 and "DIFFERENT" in r.stdout and "contradict" in r.stdout


def test_a_verdict_on_records_says_so_and_read_all_reads(resharded: Path, tmp_path: Path):
    """Records and manifest both A's, bytes B's: nothing cheap can tell; the verdict says what it rests on."""
    b = _copy(resharded, tmp_path / "b")
    key = flip_inside_a_chunk(b)[0]
    code, doc = _json("diff", resharded, b)
    assert code == 0 and doc["basis"] == "recorded hashes (not re-read)" and doc["chunk_pairs_read"] == 0
    assert doc["chunk_pairs_by_records"] > 0
    table = cli("diff", resharded, b)
    assert table.exit_code == 0 and "identical by recorded hashes (not re-read)" in table.stdout
    assert "basis: recorded hashes (not re-read)" in table.stdout
    for flag in ("--read-all", "--read-data"):
        code, doc = _json("diff", resharded, b, flag)
        assert code == 1 and doc["basis"] == "bytes read" and key in {d["key"] for d in doc["differences"]}
    code, doc = _json("diff", resharded, resharded, "--read-all")
    assert code == 0 and doc["basis"] == "bytes read" and doc["chunk_pairs_by_records"] == 0


def test_megatron_layout_records_vouch_for_nothing(tmp_path: Path):
    """Without a manifest the side file checksums itself: ``diff`` reads, one changed chunk is found."""
    assert cli("export", FOLD, tmp_path / "fr", "--to", "fully_reshardable").exit_code == 0
    a = next((tmp_path / "fr").glob("iter_*"))
    b = _copy(a, tmp_path / "b")
    key = flip_inside_a_chunk(b)[0]
    shutil.copy(a / CHUNK_RECORDS_FILE, b / CHUNK_RECORDS_FILE)
    r = cli("diff", a, b)  # the changed element fails its zip record's CRC-32 once read: exit 2, named
    assert r.exit_code == 2 and key in r.stderr and "identical" not in r.stdout, (r.stdout, r.stderr)
    code, doc = _json("diff", a, a)
    assert code == 0 and doc["basis"] == "bytes read" and doc["chunk_pairs_by_records"] == 0


def _edit_stats(folder: Path, edit) -> None:
    """Rewrite one record's statistics and the manifest's checksum of the side file (a consistent forgery)."""
    path = folder / CHUNK_RECORDS_FILE
    doc = json.loads(path.read_text())
    rec = next(r for r in doc["chunks"] if r["stats"] is not None and r["stats"]["numel"] > 4)
    edit(rec["stats"])
    path.write_text(json.dumps(doc))
    _refresh_file_checksum(folder, CHUNK_RECORDS_FILE)
    m = json.loads((folder / MANIFEST).read_text())
    m["files"][CHUNK_RECORDS_FILE]["size"] = path.stat().st_size
    (folder / MANIFEST).write_text(json.dumps(m))


IMPOSSIBLE = {
    "min_above_max": lambda s: s.update(min=5.0, max=-5.0),
    "more_nan_than_numel": lambda s: s.update(nan=s["numel"] + 1),
    "nan_and_inf_over_numel": lambda s: s.update(nan=s["numel"] // 2 + 1, posinf=s["numel"] // 2 + 1),
    "negative_sumsq": lambda s: s.update(sumsq=-1.0),
    "numel_not_the_chunks": lambda s: s.update(numel=s["numel"] * 2),
    "sumsq_beyond_range": lambda s: s.update(sumsq=1e30),
}


@pytest.mark.parametrize("case", sorted(IMPOSSIBLE))
def test_statistics_that_cannot_be_true_are_a_problem_not_a_fact(resharded: Path, tmp_path: Path, case: str):
    b = _copy(resharded, tmp_path / "b")
    _edit_stats(b, IMPOSSIBLE[case])
    records = read_records(open_checkpoint(b))
    assert [p.check for p in records.problems] == [STATS_CODE], [p.message for p in records.problems]
    code, doc = _json("inspect", b, "--stats")
    assert code == 0 and any(n["check"] == STATS_CODE for n in doc["notes"])
    assert len(doc["chunk_stats"]) == len(records.by_chunk)  # the impossible record is not shown
    r = cli("verify", b)
    assert r.exit_code == 1 and "which no stored chunk can have" in r.stdout + r.stderr, (r.stdout, r.stderr)
    code, doc = _json("diff", resharded, b)  # records with problems are not trusted: everything read
    assert code == 0 and doc["basis"] == "bytes read"
