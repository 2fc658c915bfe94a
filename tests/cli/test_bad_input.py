"""Damaged and hostile checkpoints: one error line, exit 1 or 2, nothing written or changed.

Each test damages a copy, snapshots the whole run folder (and its parent for escapes), runs the
commands, and compares the snapshot afterwards.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import struct
from pathlib import Path

import ckpt_factory as F
import pytest
import torch
from cli_helpers import assert_error_line, cli, rewrite_metadata, snapshot

from gtp_format.reader.checkpoint import open_checkpoint
from gtp_format.storage import local

ITER = "iter_0000010"


def _storage_items(md, key: str):
    return [(idx, info) for idx, info in md.storage_data.items() if idx.fqn == key]


def _unchanged(root: Path):
    """Context: the folder tree under ``root`` is byte-identical afterwards."""

    class _Check:
        def __enter__(self):
            self.before = snapshot(root)

        def __exit__(self, *exc):
            assert snapshot(root) == self.before
            return False

    return _Check()


def test_truncated_distcp(copy_ckpt):
    run = copy_ckpt("good")
    victim = run / ITER / "__0_0.distcp"
    ref = next(c.storage for c in open_checkpoint(run).entries[F.QKV].chunks if c.storage.file == victim.name)
    victim.write_bytes(victim.read_bytes()[: ref.offset + ref.length // 2])  # cut through the QKV chunk
    with _unchanged(run.parent):
        assert_error_line(cli("verify", run), 1, "runs past the end of __0_0.distcp")
        assert_error_line(cli("show", run, F.QKV), 2, F.QKV, "__0_0.distcp", "truncated")
        assert cli("inspect", run).exit_code == 0  # metadata only: nothing to notice


def test_wrong_chunk_length(copy_ckpt):
    run = copy_ckpt("good")

    def shorten(md):
        idx, info = _storage_items(md, F.QKV)[0]
        md.storage_data[idx] = dataclasses.replace(info, length=info.length - 100)

    rewrite_metadata(run / ITER, shorten)
    with _unchanged(run.parent):
        ok = cli("verify", run)  # structure is fine, 100 bytes of the file are now unclaimed
        assert ok.exit_code == 0 and "unreferenced_bytes" in ok.stdout
        line = assert_error_line(cli("verify", run, "--data"), 1, F.QKV, "does not decode")
        assert "chunk" in line and ".distcp" in line
        assert_error_line(cli("show", run, F.QKV), 2, "does not decode")


def test_chunk_length_past_end_of_file(copy_ckpt):
    run = copy_ckpt("good")

    def grow(md):
        idx, info = _storage_items(md, F.NORM)[0]
        md.storage_data[idx] = dataclasses.replace(info, length=info.length + 10**9)

    rewrite_metadata(run / ITER, grow)
    with _unchanged(run.parent):
        assert_error_line(cli("verify", run), 1, F.NORM, "runs past the end")
        assert_error_line(cli("show", run, F.NORM), 2, "runs past its end")


def test_missing_data_file(copy_ckpt):
    run = copy_ckpt("good")
    (run / ITER / "__1_0.distcp").unlink()
    with _unchanged(run.parent):
        assert_error_line(cli("verify", run), 1, "__1_0.distcp is missing")
        assert_error_line(cli("show", run, F.QKV), 2, "__1_0.distcp is missing")  # rank 1 wrote rows 8-16


def test_missing_metadata(copy_ckpt):
    run = copy_ckpt("good")
    (run / ITER / ".metadata").unlink()
    with _unchanged(run.parent):
        for command in (["inspect", run], ["verify", run], ["show", run, F.QKV]):
            assert_error_line(cli(*command), 2, ".metadata is missing", "restore .metadata")


def test_garbage_metadata(copy_ckpt):
    run = copy_ckpt("good")
    (run / ITER / ".metadata").write_bytes(os.urandom(4096))
    with _unchanged(run.parent):
        assert_error_line(cli("inspect", run), 2, "cannot parse", ".metadata", "restore it")


def test_metadata_of_wrong_type(copy_ckpt):
    run = copy_ckpt("good")
    (run / ITER / ".metadata").write_bytes(struct.pack("<BB", 0x80, 4) + b"]\x94.")  # an empty list
    with _unchanged(run.parent):
        assert_error_line(cli("inspect", run), 2, "not DCP Metadata")


@pytest.mark.parametrize("bad_path", ["../outside.distcp", "/etc/hostname", "sub/../../outside.distcp"])
def test_storage_path_escaping(copy_ckpt, bad_path: str):
    run = copy_ckpt("good")
    (run / "outside.distcp").write_bytes((run / ITER / "__0_0.distcp").read_bytes())

    def escape(md):
        for idx, info in _storage_items(md, F.QKV):
            md.storage_data[idx] = dataclasses.replace(info, relative_path=bad_path)

    rewrite_metadata(run / ITER, escape)
    reason = "absolute" if bad_path.startswith("/") else "'..'"
    with _unchanged(run.parent):
        assert_error_line(cli("verify", run), 1, F.QKV, reason)
        assert_error_line(cli("show", run, F.QKV), 2, reason, "refusing to read outside")


def test_symlink_escaping_the_folder(copy_ckpt, tmp_path: Path):
    run = copy_ckpt("good")
    victim = run / ITER / "__0_0.distcp"
    outside = tmp_path / "elsewhere.distcp"
    outside.write_bytes(victim.read_bytes())
    victim.unlink()
    victim.symlink_to(outside)
    with _unchanged(tmp_path):
        assert_error_line(cli("verify", run), 1, "outside the checkpoint folder")
        assert_error_line(cli("show", run, F.QKV), 2, "outside the checkpoint folder")


def test_huge_declared_tensor_is_reported_not_allocated(copy_ckpt):
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    run = copy_ckpt("good")
    n = 10**15

    def add_huge(md):
        md.state_dict_metadata["huge"] = TensorStorageMetadata(
            TensorProperties(dtype=torch.float32), torch.Size([n]),
            [ChunkStorageMetadata(offsets=torch.Size([0]), sizes=torch.Size([n]))])
        md.storage_data[MetadataIndex("huge", [0])] = _StorageInfo("__0_0.distcp", 0, 1000)

    rewrite_metadata(run / ITER, add_huge)
    with _unchanged(run.parent):
        assert cli("inspect", run, "--keys", "huge").exit_code == 0
        line = assert_error_line(cli("verify", run, "--data"), 1)
        assert "huge" in line
        verify = cli("verify", run, "--format", "json")
        assert "declares 1000000000000000 elements" in verify.stdout
        assert_error_line(cli("show", run, "huge"), 2, "huge", "over the", "--slice")
        assert_error_line(cli("show", run, "huge", "--slice", "0:4"), 2, "declares 1000000000000000 elements")


def test_empty_folder(tmp_path: Path):
    (tmp_path / "empty").mkdir()
    with _unchanged(tmp_path):
        assert_error_line(cli("inspect", tmp_path / "empty"), 2, "is empty", "not a checkpoint folder")


def test_file_where_a_folder_is_expected(copy_ckpt, tmp_path: Path):
    run = copy_ckpt("good")
    with _unchanged(tmp_path):
        assert_error_line(cli("verify", run / ITER / ".metadata"), 2, "is a file", "iter_XXXXXXX")
        assert_error_line(cli("inspect", tmp_path / "nope"), 2, "does not exist")
    (run / "latest_checkpointed_iteration.txt").write_text("11")
    (run / "iter_0000011").write_text("not a folder")
    with _unchanged(run.parent):
        assert_error_line(cli("inspect", run), 2, "iter_0000011 is a file")


def test_data_file_replaced_by_a_folder(copy_ckpt):
    run = copy_ckpt("good")
    victim = run / ITER / "__0_0.distcp"
    victim.unlink()
    victim.mkdir()
    with _unchanged(run.parent):
        assert_error_line(cli("verify", run), 1, "__0_0.distcp", "not a regular file")
        assert_error_line(cli("show", run, F.QKV), 2, "not a regular file")


def test_unreadable_files(copy_ckpt, monkeypatch: pytest.MonkeyPatch):
    # We run as root, where chmod 000 stops nothing, so the OS refusal is simulated at the one
    # place every read goes through.
    run = copy_ckpt("good")
    real = local._open_at

    def deny_data(name, flags, dir_fd):
        if name.endswith(".distcp"):
            raise PermissionError(13, "Permission denied", name)
        return real(name, flags, dir_fd)

    monkeypatch.setattr(local, "_open_at", deny_data)
    with _unchanged(run.parent):
        assert_error_line(cli("show", run, F.QKV), 2, "Permission denied", ".distcp")
        assert_error_line(cli("verify", run, "--data"), 1, "Permission denied")

    def deny_metadata(name, flags, dir_fd):
        if name.endswith(".metadata"):
            raise PermissionError(13, "Permission denied", name)
        return real(name, flags, dir_fd)

    monkeypatch.setattr(local, "_open_at", deny_metadata)
    with _unchanged(run.parent):
        assert_error_line(cli("inspect", run), 2, "Permission denied", ".metadata")


def test_metadata_fifo_does_not_hang(copy_ckpt):
    run = copy_ckpt("good")
    meta = run / ITER / ".metadata"
    meta.unlink()
    os.mkfifo(meta)
    with _unchanged(run.parent):
        assert_error_line(cli("inspect", run), 2, ".metadata is not a regular file")


def test_metadata_size_limit(copy_ckpt, monkeypatch: pytest.MonkeyPatch):
    run = copy_ckpt("good")
    monkeypatch.setenv("CKPT_MAX_METADATA_BYTES", "100")
    with _unchanged(run.parent):
        assert_error_line(cli("inspect", run), 2, "over the 100-byte limit", "CKPT_MAX_METADATA_BYTES")


def test_per_bucket_numel_mismatch(copy_ckpt):
    run = copy_ckpt("good")
    buf = io.BytesIO()
    torch.save([[{(torch.bfloat16, torch.float32): [F.UNPADDED - 1]}]], buf)
    (run / ITER / "__9_0.distcp").write_bytes(buf.getvalue())

    def repoint(md):
        (idx, info), = _storage_items(md, F.PBN_UNPADDED)
        md.storage_data[idx] = dataclasses.replace(info, relative_path="__9_0.distcp", offset=0,
                                                   length=len(buf.getvalue()))

    rewrite_metadata(run / ITER, repoint)
    with _unchanged(run.parent):
        assert_error_line(cli("verify", run), 1, "per_bucket_numel_unpadded says [21]")


def _rehash_manifest(folder: Path, algorithms: tuple[str, ...]) -> None:
    """Give every file entry of the manifest these algorithms' digests, computed independently."""
    import hashlib
    import zlib

    import google_crc32c

    def digest(a: str, data: bytes) -> str:
        if a == "sha256":
            return hashlib.sha256(data).hexdigest()
        return f"{zlib.crc32(data) if a == 'crc32' else google_crc32c.value(data):08x}"

    path = folder / F.MANIFEST_FILE
    doc = json.loads(path.read_text())
    for name, spec in doc["files"].items():
        data = (folder / name).read_bytes()
        doc["files"][name] = {"size": spec["size"], **{a: digest(a, data) for a in algorithms}}
    path.write_text(json.dumps(doc))


@pytest.mark.parametrize("algorithms", [("crc32c",), ("crc32",), ("sha256",), ("crc32c", "sha256")],
                         ids=lambda a: "+".join(a))
def test_checksum_mismatch_needs_data(copy_ckpt, algorithms: tuple[str, ...]):
    """Each algorithm a manifest may name (CRC-32C now, CRC-32 in older checkpoints) catches a flipped byte."""
    run = copy_ckpt("good")
    _rehash_manifest(run / ITER, algorithms)
    assert cli("verify", run, "--data").exit_code == 0
    victim = run / ITER / "__3_0.distcp"
    raw = bytearray(victim.read_bytes())
    raw[-30] ^= 0xFF  # same size: only the checksum can tell
    victim.write_bytes(bytes(raw))
    with _unchanged(run.parent):
        assert cli("verify", run).exit_code == 0
        result = cli("verify", run, "--data", "--format", "json")
        assert_error_line(result, 1, "__3_0.distcp")
        problems = json.loads(result.stdout)["problems"]
        assert any(p["check"] == "checksum" and p["file"] == "__3_0.distcp" for p in problems)


def test_safetensors_bad_header(copy_ckpt):
    run = copy_ckpt("st")
    victim = run / "shard-00002-model-00001-of-00001.safetensors"
    raw = victim.read_bytes()
    victim.write_bytes(struct.pack("<Q", 10**12) + raw[8:])
    with _unchanged(run):
        assert_error_line(cli("inspect", run), 2, "declares a 1000000000000-byte safetensors header",
                          "shard-00002")


def test_safetensors_truncated_data(copy_ckpt):
    run = copy_ckpt("st")
    victim = run / "shard-00001-model-00001-of-00001.safetensors"
    victim.write_bytes(victim.read_bytes()[:-8])
    with _unchanged(run):
        assert_error_line(cli("verify", run), 1, "runs past the end", "shard-00001")


def test_gtp_safetensors_missing_file_and_index(copy_ckpt):
    run = copy_ckpt("gtst")
    (run / ITER / "__1_0.safetensors").unlink()
    with _unchanged(run.parent):
        assert_error_line(cli("verify", run), 1, "__1_0.safetensors")
        assert_error_line(cli("show", run, F.QKV), 2, F.QKV, "no storage entry")
    (run / ITER / "index.json").unlink()
    with _unchanged(run.parent):
        assert_error_line(cli("inspect", run), 2, "index.json is missing")


def test_deflated_blob_is_not_inflated(copy_ckpt):
    # A chunk whose torch.save zip has a deflated record: torch would inflate it into a buffer
    # sized by the pickle's claim. ckpt refuses before torch.load.
    import zipfile

    run = copy_ckpt("good")
    key = F.NORM
    ck = open_checkpoint(run)
    ref = ck.entries[key].chunks[0].storage
    blob = (run / ITER / ref.file).read_bytes()[ref.offset:ref.offset + ref.length]
    src = zipfile.ZipFile(io.BytesIO(blob))
    bomb = io.BytesIO()
    with zipfile.ZipFile(bomb, "w") as z:
        for info in src.infolist():
            z.writestr(info.filename, src.read(info.filename), compress_type=zipfile.ZIP_DEFLATED)
    (run / ITER / "__8_0.distcp").write_bytes(bomb.getvalue())

    def repoint(md):
        (idx, info), = _storage_items(md, key)
        md.storage_data[idx] = dataclasses.replace(info, relative_path="__8_0.distcp", offset=0,
                                                   length=len(bomb.getvalue()))

    rewrite_metadata(run / ITER, repoint)
    with _unchanged(run.parent):
        assert_error_line(cli("verify", run, "--data"), 1, key, "compressed")
        assert_error_line(cli("show", run, key), 2, "refusing to inflate")


def test_safetensors_header_with_a_non_string_dtype_is_a_finding(tmp_path: Path):
    """A header entry whose dtype is JSON but not a code ("dtype": [1]) is reported, never a crash."""
    import json
    import shutil
    import struct

    run = tmp_path / "st"
    shutil.copytree(Path(__file__).parents[2] / "fixtures/gtp/fold_cp2_g2_dp2_st", run)
    data = next((run / "iter_0000002").glob("__0_*.safetensors"))
    raw = data.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    name = next(k for k in header if k != "__metadata__")
    header[name]["dtype"] = [1]
    text = json.dumps(header).encode()
    data.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])
    result = cli("verify", run, "--format", "json")
    assert result.exit_code in (1, 2), (result.exit_code, result.stdout[-1000:], result.exception)
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert name in result.stdout + result.stderr
