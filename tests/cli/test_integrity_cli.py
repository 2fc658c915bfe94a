"""``inspect --stats``, ``diff`` by hashes first, and ``verify``'s exit on saved NaN, through the CLI.

The checkpoints are saved by the runtime (tests/helpers/integrity_ckpts.py). What ``diff`` reads is
checked against the chunk byte lengths the metadata gives, so "reads less than 1%" is a count of
bytes, not a timing.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
from cli_helpers import assert_error_line, cli
from integrity_ckpts import NAN_WEIGHT, save_all

from gtp_format.integrity.records import NO_RECORDS, read_records
from gtp_format.reader.checkpoint import open_checkpoint

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return save_all(tmp_path_factory.mktemp("integrity_cli"))


def _json(*args: object) -> dict:
    r = cli(*args, "--format", "json")
    return json.loads(r.stdout)


def test_diff_of_two_copies_reads_less_than_one_percent(saved: dict[str, Path], tmp_path: Path):
    copy = tmp_path / "copy"
    shutil.copytree(saved["dist"], copy)
    doc = _json("diff", saved["dist"], copy)
    assert doc["equal"] and doc["chunk_hashes"]
    assert doc["data_bytes"] > 0 and doc["data_bytes_read"] < 0.01 * doc["data_bytes"]
    full = _json("diff", saved["dist"], copy, "--read-all")
    assert full["equal"] and full["data_bytes_read"] == full["data_bytes"]


def _changed_chunks(a: Path, b: Path) -> int:
    """Bytes of the chunk pairs whose recorded hashes differ (what a hash-first diff must read)."""
    ra, rb = read_records(open_checkpoint(a)), read_records(open_checkpoint(b))
    return sum(r.length + rb.by_chunk[k].length for k, r in ra.by_chunk.items() if rb.by_chunk[k].digest != r.digest)


def test_diff_reads_only_chunks_whose_hashes_differ(saved: dict[str, Path]):
    doc = _json("diff", saved["dist"], saved["nan"])
    assert not doc["equal"]
    assert {d["key"] for d in doc["differences"]} >= {NAN_WEIGHT}
    assert 0 < doc["data_bytes_read"] == _changed_chunks(saved["dist"], saved["nan"]) < doc["data_bytes"] / 4


def test_diff_first_stops_at_the_first_element_and_prints_both_values(saved: dict[str, Path]):
    r = cli("diff", saved["dist"], saved["nan"], "--first", "--format", "json")
    assert r.exit_code == 1
    doc = json.loads(r.stdout)
    (d,) = doc["differences"]
    assert d["key"] == NAN_WEIGHT and math.isfinite(d["a"]) and math.isnan(float(d["b"]))  # JSON spells NaN "nan"
    ckpt = open_checkpoint(saved["dist"])
    c = next(c for c in ckpt.entries[NAN_WEIGHT].chunks if c.offsets == (0, 0))  # rank 0's rows
    assert d["first_mismatch"] == [0, 3] and doc["data_bytes_read"] == 2 * c.storage.length
    table = cli("diff", saved["dist"], saved["nan"], "--first")
    assert "first difference at [0, 3]" in table.stdout and "nan" in table.stdout


def test_diff_without_records_reads_everything():
    doc = _json("diff", FIXTURES / "gtp" / "fold_cp2_g2_dp2", FIXTURES / "gtp" / "fold_cp2_g2_dp2")
    assert doc["equal"] and not doc["chunk_hashes"] and doc["data_bytes_read"] == doc["data_bytes"]


def test_inspect_says_old_checkpoints_have_file_checksums_only():
    for name in ("fold_cp2_g2_dp2", "fold_cp2_g2_dp2_st"):
        doc = _json("inspect", FIXTURES / "gtp" / name)
        assert doc["integrity"] == NO_RECORDS
        assert cli("verify", FIXTURES / "gtp" / name, "--data").exit_code == 0  # still verify, on file checksums
    assert NO_RECORDS in cli("inspect", FIXTURES / "gtp" / "nofold_cp2_g2_dp2").stdout


def test_inspect_stats_per_key_and_per_chunk_without_reading_data(saved: dict[str, Path], tmp_path: Path):
    folder = tmp_path / "nan"
    shutil.copytree(saved["nan"], folder)
    for f in folder.glob("*.distcp"):  # no data file is read: blank them all
        f.write_bytes(b"\0" * f.stat().st_size)
    doc = _json("inspect", folder, "--stats")
    assert doc["integrity"].startswith("xxh3_128 per chunk")
    assert doc["stats"][NAN_WEIGHT]["nan"] == 1
    rows = [r for r in doc["chunk_stats"] if r["key"] == NAN_WEIGHT]
    assert sorted(r["stats"]["nan"] for r in rows) == [0, 1]
    shape = next(w["shape"] for w in doc["weights"] if w["key"] == NAN_WEIGHT)
    assert sum(r["stats"]["numel"] for r in rows) == math.prod(shape) == doc["stats"][NAN_WEIGHT]["numel"]
    table = cli("inspect", folder, "--stats", "--keys", NAN_WEIGHT).stdout
    assert "Statistics recorded at save" in table and NAN_WEIGHT in table


def test_verify_fails_on_a_saved_nan_in_one_line_naming_the_weight(saved: dict[str, Path]):
    assert_error_line(cli("verify", saved["nan"]), 1, NAN_WEIGHT)


@pytest.mark.parametrize("layout", ["torch_dist", "safetensors"])
def test_reshard_records_every_chunk_through_the_writer(saved: dict[str, Path], tmp_path: Path, layout: str):
    out = tmp_path / "resharded"
    assert cli("reshard", saved["dist"], out, "--gtp-remat", "1", "--dp", "2", "--layout", layout).exit_code == 0
    folder = next(out.glob("iter_*"))
    ckpt = open_checkpoint(folder)
    records = read_records(ckpt)
    assert records is not None and not records.problems and len(records.by_chunk) == ckpt.chunk_count()
    assert cli("verify", folder, "--data").exit_code == 0
    rec = max(records.by_chunk.values(), key=lambda r: r.length)
    with open(folder / rec.file, "r+b") as f:
        f.seek(rec.offset + rec.length - 8)
        b = f.read(1)
        f.seek(rec.offset + rec.length - 8)
        f.write(bytes([b[0] ^ 0x80]))
    doc = json.loads(cli("verify", folder, "--data", "--format", "json").stdout)
    named = [p for p in doc["problems"] if p["check"] == "chunk_hash"]
    assert [(p["key"], p["file"]) for p in named] == [(rec.key, rec.file)]
