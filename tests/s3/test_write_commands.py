"""Every ``ckpt`` command that writes takes an ``s3://`` DST (on moto's S3 server): ``export`` (hf,
fully_reshardable, torch), ``import --from hf`` (``--to megatron-core`` too), ``migrate-aliased`` and
``reshard`` of a megatron-core checkpoint (this runtime's: tests/s3/test_write.py),
all through the one writer's ordered upload. The output equals the same command into a local folder,
object for file and byte for byte; an upload that fails or is killed leaves nothing a reader takes;
an existing prefix is refused. ``plan`` reads a bucket SRC.
"""

from __future__ import annotations

import functools
import json
import tempfile
from pathlib import Path

import pytest
from test_read import FIXTURES, REPO, ckpt, upload

from gtp_format.storage import upload as up

ALIASED = REPO / "fixtures" / "gtp" / "aliased_cp2_g2_dp2"
SRC = FIXTURES["dcp"]
# the object each output's upload puts last, as a conditional create (its commit object)
COMMIT = {"export-hf": "config.json", "export-megatron-names": "model.safetensors",
          "export-fully_reshardable": "iter_0000002/metadata.json", "import": "iter_0000000/metadata.json",
          "import-megatron-core": "iter_0000000/metadata.json",
          "migrate": "iter_0000002/metadata.json", "reshard-megatron-core": "iter_0000002/metadata.json"}
CASES = sorted([*COMMIT, "export-torch"])


@functools.cache
def bigcode_src() -> Path:
    """A GPTBigCodeForCausalLM folder (the local export of a genuine megatron-core save): import
    --to megatron-core's SRC."""
    from ckpt_tool.cli import run

    out = Path(tempfile.mkdtemp()) / "bigcode"
    assert run(["export", str(REPO / "fixtures" / "megatron" / "pair_tp2_dp2_dp_reshardable"), str(out), "--to", "hf",
                "--format", "json"]) == 0
    return out


def argv(case: str, dst: str, hf_src: Path) -> list[str]:
    if case == "import-megatron-core":
        return ["import", str(bigcode_src()), dst, "--from", "hf", "--to", "megatron-core", "--tp", "2", "--pp", "2",
                "--dp", "2"]
    if case == "import":
        return ["import", str(hf_src), dst, "--from", "hf", "--dp", "2"]
    if case == "reshard-megatron-core":
        return ["reshard", str(REPO / "fixtures" / "megatron" / "pair_tp2_dp2_dp_reshardable"), dst, "--tp", "1",
                "--dp", "4"]
    if case == "migrate":
        return ["migrate-aliased", str(ALIASED), dst, "--reset-lost-moments"]
    if case == "export-megatron-names":
        return ["export", str(SRC), dst, "--to", "hf", "--names", "megatron", "--optimizer"]
    return ["export", str(SRC), dst + ("/model.pt" if case == "export-torch" else ""), "--to", case.split("-")[1]]


def files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


@pytest.mark.parametrize("case", CASES)
def test_a_bucket_dst_equals_the_local_output(s3, capsys, tmp_path, hf_src, puts, case):
    local, again = tmp_path / "local", tmp_path / "again"
    for out_dir in (local, again):
        if case == "export-torch":
            out_dir.mkdir()  # DST is the file model.pt inside it
        code, _, err = ckpt(capsys, *argv(case, str(out_dir), hf_src))
        assert code == 0, err
    code, out, err = ckpt(capsys, *argv(case, s3.url("out"), hf_src), "--format", "json")
    assert code == 0, (out, err)
    if case == "export-torch":
        # the file, then its attestation beside it (each a conditional create of its own)
        assert s3.keys("out/") == ["out/model.pt", "out/model.pt.gtp_attestation.json"] and puts == ["", ""]
        att = json.loads(s3.client.get_object(Bucket=s3.bucket, Key="out/model.pt.gtp_attestation.json")["Body"]
                         .read())
        assert att["command"] == "ckpt export --to torch" and att["target"]["path"] == s3.url("out/model.pt")
        got = s3.client.get_object(Bucket=s3.bucket, Key="out/model.pt")["Body"].read()
        assert got == (local / "model.pt").read_bytes()
        assert json.loads(out)["bytes_written"] == len(got)
        return
    names = files(local)
    assert s3.keys("out/") == [f"out/{n}" for n in names]
    # torch.save blobs carry a fresh serialization id, DCP's .metadata of a migration a fresh save id
    # (and the manifest their CRCs): files that differ between two local runs are compared by verify
    # and diff below; every other object is the local file, byte for byte
    fresh = {n for n in names if (local / n).read_bytes() != (again / n).read_bytes()}
    assert len(fresh) < len(names)
    for n in sorted(set(names) - fresh):
        got = s3.client.get_object(Bucket=s3.bucket, Key=f"out/{n}")["Body"].read()
        assert got == (local / n).read_bytes(), n
    # the commit object goes up after every other file of its folder, the latest marker after it
    rest = [r for r in puts if r != "latest_checkpointed_iteration.txt"]
    assert rest[-1] == COMMIT[case], puts
    assert puts[-1] == ("latest_checkpointed_iteration.txt" if "/" in COMMIT[case] else COMMIT[case])
    if "/" in COMMIT[case]:  # a checkpoint: the bucket's copy verifies and equals the local one
        code, out, err = ckpt(capsys, "verify", s3.url("out"), "--data")
        assert code == 0, (out, err)
        code, out, err = ckpt(capsys, "diff", s3.url("out"), str(local), "--bitwise")
        assert code == 0, (out, err)


@pytest.mark.parametrize("case", CASES)
def test_a_failed_upload_leaves_nothing(s3, capsys, hf_src, monkeypatch, case):
    """The store fails at the commit object: one line, exit 2, every object this upload created removed."""
    real = up.Upload._put

    def failing(self, local, rel, create=False):
        if create:
            raise up.objects.describe_error(TimeoutError("connection timed out"), str(self.target / rel))
        real(self, local, rel, create)

    monkeypatch.setattr(up.Upload, "_put", failing)
    code, _, err = ckpt(capsys, *argv(case, s3.url("cut/out"), hf_src))
    assert code == 2 and err.count("\n") == 1 and "did not answer" in err, err
    assert s3.keys("cut/") == []


@pytest.mark.parametrize("case", sorted(COMMIT))
def test_a_killed_upload_leaves_no_commit_object(s3, capsys, hf_src, monkeypatch, case):
    """Killed just before its commit object (nothing undone): the data objects are there, the commit
    object is not, and a checkpoint prefix is refused by verify by name."""
    def killed(point):
        raise KeyboardInterrupt  # stands in for SIGKILL at the point the commit object would go up

    monkeypatch.setattr(up.Upload, "undo", lambda self: None)  # a killed process cleans nothing
    real_init = up.Upload.__init__
    monkeypatch.setattr(up.Upload, "__init__", lambda self, target, fault=None, commit=None: real_init(
        self, target, killed, commit))
    code, _, _ = ckpt(capsys, *argv(case, s3.url("half/out"), hf_src))
    assert code != 0
    keys = s3.keys("half/")
    assert keys and f"half/out/{COMMIT[case]}" not in keys
    assert not any(k.endswith(("/latest_checkpointed_iteration.txt", "/metadata.json")) for k in keys)
    if "/" in COMMIT[case]:
        code, _, err = ckpt(capsys, "verify", s3.url(f"half/out/{COMMIT[case].split('/')[0]}"))
        assert code == 2 and "an unfinished upload, not a checkpoint" in err, err


@pytest.mark.parametrize("case", CASES)
def test_an_existing_prefix_is_refused(s3, capsys, hf_src, case):
    taken = "taken/out/model.pt" if case == "export-torch" else "taken/out/notes.txt"
    s3.client.put_object(Bucket=s3.bucket, Key=taken, Body=b"mine")
    code, _, err = ckpt(capsys, *argv(case, s3.url("taken/out"), hf_src))
    assert code == 2 and err.count("\n") == 1 and "objects already exist under this prefix" in err, err
    assert s3.keys("taken/") == [taken]
    assert s3.client.get_object(Bucket=s3.bucket, Key=taken)["Body"].read() == b"mine"


def test_plan_reads_a_bucket_src(s3, capsys):
    url = upload(s3, SRC, "runs/a")
    code, local, err = ckpt(capsys, "plan", str(SRC), "--cp", "2", "--dp", "2", "--read-gbps", "1", "--format", "json")
    assert code == 0, err
    code, remote, err = ckpt(capsys, "plan", url, "--cp", "2", "--dp", "2", "--read-gbps", "1", "--format", "json")
    assert code == 0, err
    a, b = json.loads(local), json.loads(remote)
    assert b.pop("path") == f"{url}/iter_0000002" and a.pop("path") == str(SRC / "iter_0000002")
    assert a == b


def test_the_bucket_top_level_as_dst(s3, capsys, tmp_path, monkeypatch):
    """An empty prefix: a folder output goes to the bucket's top level (its work folder, named after the
    bucket, stays inside the staging folder); ``--to torch`` needs an object name, refused in one line."""
    staging = tmp_path / "staging"
    staging.mkdir()
    monkeypatch.setenv("CKPT_S3_STAGING", str(staging))
    code, _, err = ckpt(capsys, "export", str(SRC), f"s3://{s3.bucket}", "--to", "torch")
    assert code == 2 and err.count("\n") == 1 and f"s3://{s3.bucket}/model.pt" in err, err
    code, _, err = ckpt(capsys, "export", str(SRC), f"s3://{s3.bucket}", "--to", "hf")
    assert code == 0, err
    assert "config.json" in s3.keys() and list(staging.iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["staging"], "nothing written beside the staging folder"
