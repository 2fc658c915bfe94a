"""Reading a checkpoint from a bucket: the same answers as the local folder, metadata reads only for
``inspect`` and ``verify``, the same refusals by name (on moto's S3 server on 127.0.0.1)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from ckpt_tool.cli import run
from gtp_format.storage import objects

REPO = Path(__file__).resolve().parents[2]
FIXTURES = {"dcp": REPO / "fixtures" / "gtp" / "fold_cp2_g2_dp2",
            "safetensors": REPO / "fixtures" / "gtp" / "fold_cp2_g2_dp2_st"}


def upload(s3, folder: Path, prefix: str) -> str:
    """Every file of ``folder`` as an object below ``prefix`` (boto3: independent of the code under test)."""
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            s3.client.upload_file(str(p), s3.bucket, f"{prefix}/{p.relative_to(folder)}")
    return s3.url(prefix)


def ckpt(capsys, *argv: str) -> tuple[int, str, str]:
    code = run(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture
def reads(monkeypatch):
    """Every ranged request the bucket backend sends (``objects.fetch``, the one function that sends a GET of
    an object's bytes): (key, offset, length)."""
    seen: list[tuple[str, int, int]] = []
    real = objects.fetch

    def spy(root, rel, offset, n):
        seen.append((root.key(rel), offset, n))
        return real(root, rel, offset, n)

    monkeypatch.setattr(objects, "fetch", spy)
    return seen


@pytest.mark.parametrize("layout", sorted(FIXTURES))
def test_inspect_and_verify_match_the_local_folder(s3, capsys, reads, layout):
    url = upload(s3, FIXTURES[layout], "runs/a")
    code, local, _ = ckpt(capsys, "inspect", str(FIXTURES[layout]), "--format", "json")
    assert code == 0
    code, remote, err = ckpt(capsys, "inspect", url, "--format", "json")
    assert code == 0, err
    a, b = json.loads(local), json.loads(remote)
    assert b["path"] == f"{url}/iter_0000002"
    for d in (a, b):
        d.pop("path")
        d.pop("leftovers")
    assert a == b
    code, out, err = ckpt(capsys, "verify", url, "--format", "json")
    assert code == 0, (out, err)
    assert json.loads(out)["ok"] is True
    # Only ranged reads of data objects: safetensors headers, and verify's small per-bucket numel tensors
    # (as it reads them locally), never a whole object.
    sizes = {k: s3.client.head_object(Bucket=s3.bucket, Key=k)["ContentLength"] for k in s3.keys("runs/a/")}
    data = [(k, off, n) for k, off, n in reads if k.endswith((".distcp", ".safetensors"))]
    assert all(n <= 64 << 10 and n < sizes[k] for k, _, n in data), data


def test_a_deleted_data_object_is_named(s3, capsys):
    url = upload(s3, FIXTURES["dcp"], "runs/b")
    s3.client.delete_object(Bucket=s3.bucket, Key="runs/b/iter_0000002/__3_0.distcp")
    code, out, err = ckpt(capsys, "verify", url)
    assert code == 1
    assert "__3_0.distcp" in out + err


def test_missing_prefix_and_bad_marker(s3, capsys):
    code, _, err = ckpt(capsys, "inspect", s3.url("runs/none"))
    assert code == 2 and err.count("\n") == 1 and "s3://ckpt-test/runs/none does not exist" in err
    s3.client.put_object(Bucket=s3.bucket, Key="runs/c/latest_checkpointed_iteration.txt", Body=b"7\n")
    code, _, err = ckpt(capsys, "inspect", s3.url("runs/c"))
    assert code == 2 and err.count("\n") == 1 and "names iteration 7" in err and "iter_0000007" in err


def test_a_recorded_path_outside_the_prefix_is_never_asked_for(s3, tmp_path, capsys, reads):
    """A manifest naming ``../other/x`` must not turn into a request for a key outside the prefix."""
    src = tmp_path / "ckpt"
    shutil.copytree(FIXTURES["dcp"], src)
    man = src / "iter_0000002" / "gtp_manifest.json"
    doc = json.loads(man.read_text())
    doc["files"]["../../secret"] = {"size": 1, "checksums": {}}
    man.write_text(json.dumps(doc))
    s3.client.put_object(Bucket=s3.bucket, Key="runs/secret", Body=b"x")
    url = upload(s3, src, "runs/d/run")
    code, out, err = ckpt(capsys, "verify", url)
    assert code == 1 and "../../secret" in out + err
    assert all(k.startswith("runs/d/run/") for k, _, _ in reads)


@pytest.mark.parametrize("layout", sorted(FIXTURES))
def test_verify_data_show_and_diff_from_a_bucket(s3, capsys, reads, layout):
    """``verify --data`` reads every byte by ranged requests (none larger than one window) and finds what
    the local run finds; ``show`` prints the same values; ``diff`` of the bucket against the folder is equal."""
    local = FIXTURES[layout]
    url = upload(s3, local, "runs/e")
    code, out, err = ckpt(capsys, "verify", url, "--data", "--format", "json")
    assert code == 0, (out, err)
    remote = json.loads(out)
    code, out, _ = ckpt(capsys, "verify", str(local), "--data", "--format", "json")
    assert code == 0
    here = json.loads(out)
    assert remote["ok"] and remote["checks"] == here["checks"] and remote["stats"] == here["stats"]
    sizes = {k: s3.client.head_object(Bucket=s3.bucket, Key=k)["ContentLength"] for k in s3.keys("runs/e/")}
    data = {k for k, _, _ in reads if k.endswith((".distcp", ".safetensors"))}
    assert data == {k for k in sizes if k.endswith((".distcp", ".safetensors"))}  # every data object was read
    assert max(n for _, _, n in reads) <= objects.PIECE

    code, out, _ = ckpt(capsys, "inspect", str(local), "--format", "json")
    key = json.loads(out)["weights"][0]["key"]
    code, a, err = ckpt(capsys, "show", url, key, "--format", "json")
    assert code == 0, err
    code, b, _ = ckpt(capsys, "show", str(local), key, "--format", "json")
    assert json.loads(a) | {"path": None} == json.loads(b) | {"path": None}
    code, out, err = ckpt(capsys, "diff", url, str(local))
    assert code == 0, (out, err)


def test_diff_finds_a_changed_object(s3, capsys, tmp_path):
    src = tmp_path / "ckpt"
    shutil.copytree(FIXTURES["safetensors"], src)
    url_a = upload(s3, src, "runs/f")
    code, out, _ = ckpt(capsys, "inspect", str(src), "--format", "json", "--chunks")
    row = json.loads(out)["chunks"][0]
    path = src / "iter_0000002" / row["file"]
    raw = bytearray(path.read_bytes())
    raw[row["byte_offset"]] ^= 0x40
    path.write_bytes(bytes(raw))
    url_b = upload(s3, src, "runs/g")
    code, out, err = ckpt(capsys, "diff", url_a, url_b)
    assert code == 1 and row["key"] in out, (out, err)


def test_export_hf_streams_from_a_bucket(s3, capsys, tmp_path, reads):
    """``export --to hf`` from the bucket writes the same files as from the folder, by bounded ranged reads."""
    local = FIXTURES["dcp"]
    url = upload(s3, local, "runs/h")
    code, out, err = ckpt(capsys, "export", url, str(tmp_path / "from_bucket"), "--to", "hf")
    assert code == 0, (out, err)
    code, out, err = ckpt(capsys, "export", str(local), str(tmp_path / "from_folder"), "--to", "hf")
    assert code == 0, (out, err)
    a = {p.name: p.read_bytes() for p in (tmp_path / "from_bucket").iterdir()}
    b = {p.name: p.read_bytes() for p in (tmp_path / "from_folder").iterdir()}
    assert a == b and any(n.endswith(".safetensors") for n in a)
    assert max(n for _, _, n in reads) <= objects.PIECE


def test_verify_data_with_chunks_larger_than_a_window(s3, capsys, monkeypatch):
    """Chunks over ``WINDOW`` are parsed from their ends and read window by window: the same on a bucket."""
    from gtp_format.check import data as data_check

    monkeypatch.setattr(data_check, "WINDOW", 4096)
    url = upload(s3, FIXTURES["dcp"], "runs/w")
    code, out, err = ckpt(capsys, "verify", url, "--data", "--format", "json")
    assert code == 0, (out, err)
    code, here, _ = ckpt(capsys, "verify", str(FIXTURES["dcp"]), "--data", "--format", "json")
    assert json.loads(out)["stats"] == json.loads(here)["stats"]
