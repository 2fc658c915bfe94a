"""The last commands to take a bucket as SRC: ``verify-roundtrip PATH``, ``import --from hf`` (``--to
megatron-core`` too) and ``migrate-aliased``, each against the same command on the local folder (moto's S3
server on 127.0.0.1).

They read through the one entry point the other commands use (``open_checkpoint`` / ``open_gated``, the
storage functions of :mod:`gtp_format.reader.storage`), so what each reads from the bucket is recorded
and must lie inside SRC's prefix. ``migrate-aliased --in-place`` stays refused on a bucket: an object
store has no atomic rename, so there is no moment-free swap of SRC for its migrated copy.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from s3_server import run_ckpt as ckpt
from s3_server import upload

from gtp_format.storage import objects

REPO = Path(__file__).resolve().parents[2]
GTP = REPO / "fixtures" / "gtp"


@pytest.fixture
def keys(monkeypatch):
    """Every key the bucket backend reads (``objects.fetch``, the one function that GETs an object's bytes),
    and every size it asks for (``objects.head_size``)."""
    seen: list[str] = []
    fetch, head = objects.fetch, objects.head_size

    def spy_fetch(root, rel, offset, n):
        seen.append(root.key(rel))
        return fetch(root, rel, offset, n)

    def spy_head(root, rel):
        seen.append(root.key(rel))
        return head(root, rel)

    monkeypatch.setattr(objects, "fetch", spy_fetch)
    monkeypatch.setattr(objects, "head_size", spy_head)
    return seen


@pytest.mark.slow
def test_verify_roundtrip_of_a_bucket_checkpoint(s3, capsys, keys):
    """The ranks load the checkpoint from the bucket (4 ranks at DP 1), save it again locally, and every check
    the local folder passes passes: the same checks, the same verdicts."""
    src = GTP / "fold_cp2_g2_dp2_st"
    url = upload(s3, src, "runs/rt")
    code, out, err = ckpt(capsys, "verify-roundtrip", url, "--dp", "1", "--format", "json")
    assert code == 0, (out[-2000:], err)
    remote = json.loads(out)
    assert remote["path"] == f"{url}/iter_0000002" and remote["config"]["world_size"] == 4
    assert all(k.startswith("runs/rt/") for k in keys) and any(k.endswith(".safetensors") for k in keys)
    code, out, err = ckpt(capsys, "verify-roundtrip", str(src), "--dp", "1", "--format", "json")
    assert code == 0, err
    here = json.loads(out)
    assert [(c["check"], c["ok"], c["expected"]) for c in remote["checks"]] == \
        [(c["check"], c["ok"], c["expected"]) for c in here["checks"]]
    assert s3.keys("runs/rt/") == sorted(f"runs/rt/{p.relative_to(src)}" for p in src.rglob("*") if p.is_file())


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("optimizer", [False, True])
def test_import_from_hf_in_a_bucket(s3, capsys, keys, tmp_path, optimizer):
    """A Hugging Face folder in a bucket (``export --to hf`` of a fixture, uploaded) imports to the same
    checkpoint as the same folder on disk (the same files, ``ckpt diff`` equal), read by ranged requests
    inside its prefix only."""
    hf = tmp_path / "hf"
    code, out, err = ckpt(capsys, "export", str(GTP / "fold_cp2_g2_dp2"), str(hf), "--to", "hf",
                          *(["--optimizer"] if optimizer else []))
    assert code == 0, err
    url = upload(s3, hf, "models/gpt")
    topo = ["--from", "hf", "--cp", "2", "--fold-cp", "--gtp-remat", "2", "--dp", "1"]
    code, out, err = ckpt(capsys, "import", url, str(tmp_path / "a"), *topo)
    assert code == 0, (out, err)
    code, out, err = ckpt(capsys, "import", str(hf), str(tmp_path / "b"), *topo)
    assert code == 0, (out, err)
    a, b = _files(tmp_path / "a"), _files(tmp_path / "b")
    assert a.keys() == b.keys() and any(k.endswith(".distcp") for k in a)
    # the bytes differ anyway (torch.save writes a random serialization id into every blob): compare values
    code, out, err = ckpt(capsys, "diff", str(tmp_path / "a"), str(tmp_path / "b"))
    assert code == 0, (out, err)
    assert keys and all(k.startswith("models/gpt/") for k in keys), keys
    data = [k for k in keys if k.endswith(".safetensors")]
    assert data and (not optimizer or any("optimizer" in k for k in data))


def test_import_from_a_bucket_names_what_is_missing(s3, capsys, tmp_path):
    """A bucket folder without its weights, or one whose index names a file outside it, is refused in one
    line as the folder on disk is (exit 2, nothing written)."""
    hf = tmp_path / "hf"
    assert ckpt(capsys, "export", str(GTP / "fold_cp2_g2_dp2"), str(hf), "--to", "hf")[0] == 0
    (hf / "model.safetensors").unlink()
    url = upload(s3, hf, "models/broken")
    code, out, err = ckpt(capsys, "import", url, str(tmp_path / "a"), "--from", "hf")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "model.safetensors" in err, err
    assert not (tmp_path / "a").exists()
    (hf / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "../secret.safetensors"}}))
    url = upload(s3, hf, "models/outside")
    code, out, err = ckpt(capsys, "import", url, str(tmp_path / "b"), "--from", "hf")
    assert code == 2 and "not a plain file name" in err, err


ALIASED = GTP / "aliased_cp2_g2_dp2"


def test_migrate_aliased_from_a_bucket(s3, capsys, keys, tmp_path):
    """An aliased checkpoint in a bucket migrates to a local folder and to a new prefix of the bucket: the same
    report as from the folder, a result ``diff`` finds equal to the folder's own migration, SRC's objects
    untouched, and every read inside SRC's prefix."""
    url = upload(s3, ALIASED, "runs/al")
    before = s3.keys("runs/al/")
    code, out, err = ckpt(capsys, "migrate-aliased", str(ALIASED), str(tmp_path / "local"), "--reset-lost-moments",
                          "--format", "json")
    assert code == 0, (out, err)
    here = json.loads(out)
    code, out, err = ckpt(capsys, "migrate-aliased", url, str(tmp_path / "from_bucket"), "--reset-lost-moments",
                          "--format", "json")
    assert code == 0, (out, err)
    remote = json.loads(out)
    for doc in (here, remote):
        for k in ("source", "destination", "files", "verdict", "notes"):  # paths and the time
            doc.pop(k, None)
    assert remote == here
    assert keys and all(k.startswith("runs/al/") for k in keys), sorted(set(keys))
    code, out, err = ckpt(capsys, "diff", str(tmp_path / "from_bucket"), str(tmp_path / "local"))
    assert code == 0, (out, err)
    code, out, err = ckpt(capsys, "migrate-aliased", url, s3.url("runs/al_migrated"), "--reset-lost-moments")
    assert code == 0, (out, err)
    code, out, err = ckpt(capsys, "verify", s3.url("runs/al_migrated"), "--data")
    assert code == 0, (out, err)
    assert s3.keys("runs/al/") == before


def test_migrate_aliased_in_place_on_a_bucket_is_refused(s3, capsys):
    url = upload(s3, ALIASED, "runs/ip")
    before = {k: s3.client.head_object(Bucket=s3.bucket, Key=k)["ETag"] for k in s3.keys("runs/ip/")}
    code, out, err = ckpt(capsys, "migrate-aliased", url, "--in-place")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and out == "", err
    assert url in lines[0] and "no atomic rename" in lines[0] and "pass a new DST" in lines[0], lines[0]
    assert {k: s3.client.head_object(Bucket=s3.bucket, Key=k)["ETag"] for k in s3.keys("runs/ip/")} == before


def test_import_to_megatron_core_from_a_bucket(s3, capsys, keys, tmp_path):
    """``import --to megatron-core`` of a Hugging Face folder in a bucket (each thread's rows read by ranged requests
    into its reused buffers; no read-ahead hint: a store has no page cache to advise) equals the same import of the
    folder on disk (the same files, ``ckpt diff --bitwise`` equal), reading inside its prefix only."""
    hf = tmp_path / "hf"
    code, out, err = ckpt(capsys, "export", str(REPO / "fixtures" / "megatron" / "pair_llama_tp2_dp2_dp_reshardable"),
                          str(hf), "--to", "hf")
    assert code == 0, err
    url = upload(s3, hf, "models/llama")
    topo = ["--from", "hf", "--to", "megatron-core", "--tp", "2", "--dp", "2"]
    code, out, err = ckpt(capsys, "import", url, str(tmp_path / "a"), *topo)
    assert code == 0, (out, err)
    code, out, err = ckpt(capsys, "import", str(hf), str(tmp_path / "b"), *topo)
    assert code == 0, (out, err)
    a, b = _files(tmp_path / "a"), _files(tmp_path / "b")
    assert a.keys() == b.keys() and any(k.endswith(".distcp") for k in a)
    code, out, err = ckpt(capsys, "diff", str(tmp_path / "a"), str(tmp_path / "b"), "--bitwise")
    assert code == 0, (out, err)
    assert keys and all(k.startswith("models/llama/") for k in keys), keys
