"""verify --data catches silent corruption: record CRC-32s, consistent zip structure, known checksums."""

from __future__ import annotations

import io
import json
import shutil
import struct
from pathlib import Path

import pytest
import torch

from gtp_format.check import data as data_check
from gtp_format.check.verify import verify
from gtp_format.model import TENSOR
from gtp_format.reader.blob import parse_blob
from gtp_format.reader.checkpoint import open_checkpoint
from gtp_format.reader.chunks import chunk_bytes
from gtp_format.reader.zip_blob import BlobError, ViewReader, zip_records

REPO = Path(__file__).resolve().parents[2]
MEGATRON = REPO / "fixtures/megatron/tp2_dp2_dp_reshardable/iter_0000002"


def _flip_payload_bit(folder: Path) -> str:
    """Flip one bit in the middle of the largest tensor chunk's elements; returns its key."""
    ckpt = open_checkpoint(folder)
    entry, chunk = max(((e, c) for e in ckpt.entries.values() if e.kind == TENSOR for c in e.chunks),
                       key=lambda ec: ec[1].storage.length)
    layout = parse_blob(ViewReader(memoryview(bytes(chunk_bytes(ckpt, entry, chunk)))))
    path = folder / chunk.storage.file
    raw = bytearray(path.read_bytes())
    raw[chunk.storage.offset + layout.payload_offset + layout.payload_bytes // 2] ^= 0x10
    path.write_bytes(bytes(raw))
    return entry.key


@pytest.mark.parametrize("window", [None, 4096])
def test_one_flipped_bit_without_a_manifest_fails_verify_data(tmp_path, monkeypatch, window):
    folder = tmp_path / "iter_0000002"
    shutil.copytree(MEGATRON, folder)
    assert not (folder / "gtp_manifest.json").exists()  # genuine Megatron: no manifest checksums to lean on
    if window:
        monkeypatch.setattr(data_check, "WINDOW", window)  # the chunk is streamed in pieces
    assert verify(open_checkpoint(folder), data=True).ok
    key = _flip_payload_bit(folder)
    res = verify(open_checkpoint(folder), data=True)
    assert not res.ok
    assert any(p.key == key and "CRC-32" in p.message for p in res.problems), res.problems


def _blob() -> bytes:
    buf = io.BytesIO()
    torch.save(torch.arange(16.0), buf)
    return buf.getvalue()


def test_directory_entry_pointing_at_another_record_is_refused():
    raw = bytearray(_blob())
    recs = zip_records(ViewReader(memoryview(bytes(raw))))
    payload = next(r for r in recs.values() if "/data/" in r.name)
    pkl = next(r for r in recs.values() if r.name.endswith("data.pkl"))
    # rewrite the payload's central-directory offset to point at data.pkl's local header
    at = raw.rindex(payload.name.encode()) - 46  # the central header whose name is the payload's
    assert struct.unpack_from("<I", raw, at)[0] == 0x02014B50
    struct.pack_into("<I", raw, at + 42, pkl.header_offset)
    with pytest.raises(BlobError, match="where record|overlaps"):
        zip_records(ViewReader(memoryview(bytes(raw))))


def test_flipped_bit_in_a_small_record_is_refused():
    raw = bytearray(_blob())
    recs = zip_records(ViewReader(memoryview(bytes(raw))))
    version = next(r for r in recs.values() if r.name.endswith("/version"))
    extra = struct.unpack_from("<H", raw, version.header_offset + 28)[0]
    start = version.header_offset + 30 + len(version.name) + extra
    raw[start] ^= 0x01
    with pytest.raises(BlobError, match="CRC-32"):
        parse_blob(ViewReader(memoryview(bytes(raw))))


def test_unknown_checksum_algorithm_is_an_error(tmp_path):
    src = REPO / "fixtures/gtp/fold_cp2_g2_dp2/iter_0000002"
    folder = tmp_path / "iter_0000002"
    shutil.copytree(src, folder)
    doc = json.loads((folder / "gtp_manifest.json").read_text())
    rel, spec = next((r, s) for r, s in doc["files"].items() if r.endswith(".distcp"))
    for a in [k for k in spec if k != "size"]:
        spec.pop(a)
    spec["md5"] = "0" * 32
    (folder / "gtp_manifest.json").write_text(json.dumps(doc))
    res = verify(open_checkpoint(folder), data=True)
    errors = [p for p in res.problems if p.severity == "error" and p.check == "checksum" and p.file == rel]
    assert errors and "md5" in errors[0].message and not res.ok
