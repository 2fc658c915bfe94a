"""Reading a checkpoint from a bucket: the same answers as the local folder, metadata reads only for
``inspect`` and ``verify``, the same refusals by name (on moto's S3 server on 127.0.0.1)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from s3_server import run_ckpt as ckpt
from s3_server import upload

from gtp_format.storage import objects

REPO = Path(__file__).resolve().parents[2]
FIXTURES = {"dcp": REPO / "fixtures" / "gtp" / "fold_cp2_g2_dp2",
            "safetensors": REPO / "fixtures" / "gtp" / "fold_cp2_g2_dp2_st"}


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


def test_a_prefix_in_place_of_a_data_object_is_named_as_a_folder_is(s3, capsys, tmp_path):
    """A data file's name that is a "folder" of the bucket (objects below it, no object of its own) gets the
    line a folder in place of a data file gets on disk, not "missing"."""
    src = tmp_path / "ckpt"
    shutil.copytree(FIXTURES["dcp"], src)
    it = src / "iter_0000002"
    (it / "__3_0.distcp").unlink()
    (it / "__3_0.distcp").mkdir()
    (it / "__3_0.distcp" / "inside").write_bytes(b"x")
    url = upload(s3, src, "runs/dir")
    local = ckpt(capsys, "verify", str(src), "--format", "json")
    remote = ckpt(capsys, "verify", url, "--format", "json")
    assert local[0] == remote[0] == 1
    assert "__3_0.distcp is not a regular file" in remote[2], remote[2]
    assert remote[2].strip() == local[2].strip().replace(str(src), url)


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
    # the attestation names each export's own source (a URL, a folder): every other file is the same
    a = {p.name: p.read_bytes() for p in (tmp_path / "from_bucket").iterdir() if p.name != "gtp_attestation.json"}
    b = {p.name: p.read_bytes() for p in (tmp_path / "from_folder").iterdir() if p.name != "gtp_attestation.json"}
    assert a == b and any(n.endswith(".safetensors") for n in a)
    assert max(n for _, _, n in reads) <= objects.PIECE


def test_verify_data_with_chunks_larger_than_a_window(s3, capsys, monkeypatch):
    """Chunks over ``WINDOW`` are parsed from their ends and read window by window: the same on a bucket."""
    from gtp_format.check import data as data_check

    monkeypatch.setattr(data_check, "WINDOW", 4096)
    monkeypatch.setattr(data_check, "PART", 4096)  # a bucket's window (one request each otherwise)
    url = upload(s3, FIXTURES["dcp"], "runs/w")
    code, out, err = ckpt(capsys, "verify", url, "--data", "--format", "json")
    assert code == 0, (out, err)
    code, here, _ = ckpt(capsys, "verify", str(FIXTURES["dcp"]), "--data", "--format", "json")
    assert json.loads(out)["stats"] == json.loads(here)["stats"]


def _data_gets(reads, sizes):
    return [(k, off, n) for k, off, n in reads if k in sizes]


@pytest.mark.parametrize("to", ["torch", "hf"])
def test_export_reads_each_chunk_once_by_prefetched_requests(s3, capsys, tmp_path, reads, to):
    """``export`` from a bucket fetches chunks whole and ahead, neighbours joined into requests: no 64 KiB
    structure block or per-chunk payload read of its own (which were 191 GETs for a 26.5 MB checkpoint). Every
    data object is read in at most as many requests as its size needs, plus the gate's two reads of small
    tensors (as ``verify`` makes them) and the ledger's one of the bytes no exported key holds; the output is
    the one the local folder gives, byte for byte."""
    local = FIXTURES["dcp"]
    url = upload(s3, local, "runs/p")
    out_b, out_l = tmp_path / ("b.pt" if to == "torch" else "b"), tmp_path / ("l.pt" if to == "torch" else "l")
    code, out, err = ckpt(capsys, "export", url, str(out_b), "--to", to)
    assert code == 0, (out, err)
    code, out, err = ckpt(capsys, "export", str(local), str(out_l), "--to", to)
    assert code == 0, (out, err)
    if to == "torch":
        assert out_b.read_bytes() == out_l.read_bytes()
    else:
        same = "gtp_attestation.json"  # names each export's own source
        assert {p.name: p.read_bytes() for p in out_b.iterdir() if p.name != same} == \
            {p.name: p.read_bytes() for p in out_l.iterdir() if p.name != same}
    sizes = {k: s3.client.head_object(Bucket=s3.bucket, Key=k)["ContentLength"]
             for k in s3.keys("runs/p/") if k.endswith(".distcp")}
    gets = _data_gets(reads, sizes)
    for key, size in sizes.items():
        mine = [(off, n) for k, off, n in gets if k == key]
        assert len(mine) <= -(-size // objects.PART) + 3, (key, mine)
        assert not [(off, n) for off, n in mine if off % objects.BLOCK == 0 and n == objects.BLOCK], (key, mine)
        assert len(set(mine)) == len(mine), f"{key}: a range was fetched twice: {mine}"


def test_export_from_a_bucket_refuses_a_damaged_payload(s3, capsys, tmp_path):
    """A flipped payload byte of an object the copy reads through its prefetch fails the file's CRC-32C: exit 1,
    one line naming the object, nothing written (the ledger hashes what the prefetch served)."""
    src = tmp_path / "ckpt"
    shutil.copytree(FIXTURES["dcp"], src)
    code, out, _ = ckpt(capsys, "inspect", str(src), "--format", "json", "--chunks")
    rows = [r for r in json.loads(out)["chunks"] if r["key"].endswith("weight") and r["length"] > 2048]
    row = rows[0]
    path = src / "iter_0000002" / row["file"]
    raw = bytearray(path.read_bytes())
    raw[row["byte_offset"] + row["length"] // 2] ^= 0x01
    path.write_bytes(bytes(raw))
    url = upload(s3, src, "runs/q")
    for to, dst in (("torch", tmp_path / "x.pt"), ("hf", tmp_path / "x")):
        code, out, err = ckpt(capsys, "export", url, str(dst), "--to", to)
        assert code == 1, (to, out, err)
        assert row["file"] in err and len(err.strip().splitlines()) == 1, err
        assert not dst.exists()


@pytest.mark.parametrize("over", [1, 1500])
def test_verify_reads_a_chunk_a_little_over_a_window_in_its_windows_request(s3, capsys, reads, monkeypatch, over):
    """A chunk larger than a bucket window (PART) but at most two of them is one window of its own: its zip
    structure comes from that window's bytes, not from requests of its own at its two ends (a 2048 x 1024
    fp32 chunk is 8 MiB of payload and 1.5 KiB of zip, just over PART). Here the windows are made just
    smaller than the fixture's largest chunks: no request but the stream's aligned pieces touches them."""
    import gtp_format.check.data as data_mod
    from gtp_format.reader.checkpoint import open_checkpoint

    src = FIXTURES["dcp"]
    stored = [c.storage for e in open_checkpoint(src).entries.values() for c in e.chunks if c.storage]
    window = max(st.length for st in stored) - over
    monkeypatch.setattr(data_mod, "PART", window)
    big = [(st.file, st.offset, st.offset + st.length) for st in stored if st.length > window]
    assert big
    url = upload(s3, src, "runs/w")
    code, out, err = ckpt(capsys, "verify", url, "--data", "--format", "json")
    assert code == 0 and json.loads(out)["ok"] is True, (out, err)
    sizes = {k: s3.client.head_object(Bucket=s3.bucket, Key=k)["ContentLength"] for k in s3.keys("runs/w/")}
    pieces = {(k, off, min(objects.PART, sizes[k] - off)) for k in sizes for off in range(0, sizes[k], objects.PART)}
    other = [(k, off, n) for k, off, n in reads if (k, off, n) not in pieces]
    touching = [(k, off, n) for k, off, n in other for f, a, b in big
                if k.endswith("/" + f) and off < b and a < off + n]
    assert touching == [], touching[:5]
