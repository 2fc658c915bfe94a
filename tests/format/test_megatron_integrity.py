"""Megatron's ``integrity.json`` (megatron-core ``verify_integrity``): checked by ``verify`` where present.

The file is written here the way megatron-core writes it (rank 0, after the save: SHA-256 of every
regular file at the top of the folder but itself, ``{"algorithm": "sha256", "files": {...}}``)
over a genuine megatron-core checkpoint from fixtures/megatron; the digests come from hashlib.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from gtp_format.check.verify import verify
from gtp_format.reader.checkpoint import open_checkpoint

GENUINE = Path(__file__).resolve().parents[2] / "fixtures" / "megatron" / "cp2_dp2_dp_reshardable"


def _with_integrity(tmp_path: Path) -> Path:
    folder = tmp_path / "ckpt"
    shutil.copytree(GENUINE, folder)
    inner = next((p for p in folder.iterdir() if p.is_dir() and p.name.startswith("iter_")), folder)
    files = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(inner.iterdir()) if p.is_file()}
    (inner / "integrity.json").write_text(json.dumps({"algorithm": "sha256", "files": files}, indent=2))
    return inner


def _problems(folder: Path, data: bool) -> list:
    return [p for p in verify(open_checkpoint(folder), data=data).problems if p.check == "megatron_integrity"]


def test_an_intact_checkpoint_passes_its_integrity_file(tmp_path: Path):
    folder = _with_integrity(tmp_path)
    res = verify(open_checkpoint(folder), data=True)
    assert "megatron_integrity" in res.checks and res.ok, [p for p in res.problems if p.severity == "error"]


def test_a_flipped_byte_fails_the_listed_sha256(tmp_path: Path):
    folder = _with_integrity(tmp_path)
    data = sorted(folder.glob("*.distcp"))[0]
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x04
    data.write_bytes(bytes(raw))
    (p,) = [p for p in _problems(folder, data=True) if p.severity == "error"]
    assert p.file == data.name and "sha256" in p.message and "integrity.json" in p.message


def test_missing_and_added_files_are_named_without_reading_data(tmp_path: Path):
    folder = _with_integrity(tmp_path)
    (folder / "common.pt").unlink() if (folder / "common.pt").exists() else (folder / "metadata.json").unlink()
    (folder / "notes.txt").write_text("added later")
    found = {(p.severity, p.file) for p in _problems(folder, data=False)}
    assert ("warning", "notes.txt") in found
    assert any(sev == "error" and f in ("common.pt", "metadata.json") for sev, f in found)


@pytest.mark.parametrize("name", ["../outside.txt", "/etc/passwd", "sub/x"])
def test_a_listed_path_outside_the_folder_is_refused_not_opened(tmp_path: Path, name: str):
    folder = _with_integrity(tmp_path)
    (tmp_path / "outside.txt").write_text("secret")
    body = json.loads((folder / "integrity.json").read_text())
    body["files"][name] = hashlib.sha256(b"secret").hexdigest()
    (folder / "integrity.json").write_text(json.dumps(body))
    errors = [p for p in _problems(folder, data=True) if p.severity == "error"]
    assert len(errors) == 1 and errors[0].file == "integrity.json"


def test_an_unknown_algorithm_is_an_error(tmp_path: Path):
    folder = _with_integrity(tmp_path)
    body = json.loads((folder / "integrity.json").read_text())
    (folder / "integrity.json").write_text(json.dumps({**body, "algorithm": "md5"}))
    (p,) = _problems(folder, data=False)
    assert p.severity == "error" and "md5" in p.message
