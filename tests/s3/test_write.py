"""Writing to a bucket through the one writer: ``ckpt reshard SRC s3://...`` (on moto's S3 server).

The commit rule under test: data objects first, then ``.metadata``/index and the manifest, then the
commit object ``metadata.json`` (a conditional create), the latest marker last; an upload that did not
finish is never taken for a checkpoint, and an existing prefix is never written into.
"""

from __future__ import annotations

import json

import pytest
from test_read import FIXTURES, ckpt

from gtp_format.storage import upload as up


@pytest.mark.parametrize("layout", sorted(FIXTURES))
def test_reshard_into_a_bucket(s3, capsys, tmp_path, puts, layout):
    dst = s3.url("out/run")
    code, out, err = ckpt(capsys, "reshard", str(FIXTURES[layout]), dst, "--dp", "1")
    assert code == 0, (out, err)
    # commit order: every data object, then the side files, metadata.json, the marker last
    base = [r.rsplit("/", 1)[-1] for r in puts]
    assert base[-2:] == ["metadata.json", "latest_checkpointed_iteration.txt"]
    data = [i for i, b in enumerate(base) if b.endswith((".distcp", ".safetensors"))]
    side = [i for i, b in enumerate(base) if not b.endswith((".distcp", ".safetensors"))]
    assert data and max(data) < min(side)
    assert s3.keys("out/run/") == sorted(f"out/run/{r}" for r in puts)
    # the same checkpoint as a reshard into a folder: verify --data passes, diff finds nothing
    code, out, err = ckpt(capsys, "verify", dst, "--data")
    assert code == 0, (out, err)
    code, out, err = ckpt(capsys, "reshard", str(FIXTURES[layout]), str(tmp_path / "local"), "--dp", "1")
    assert code == 0, err
    code, out, err = ckpt(capsys, "diff", dst, str(tmp_path / "local"), "--bitwise")
    assert code == 0, (out, err)
    code, out, _ = ckpt(capsys, "inspect", dst, "--format", "json")
    assert json.loads(out)["parallel_config"]["dp"] == 1
    # bucket to bucket
    code, out, err = ckpt(capsys, "reshard", dst, s3.url("out/again"), "--dp", "2")
    assert code == 0, (out, err)
    code, out, err = ckpt(capsys, "verify", s3.url("out/again"), "--data")
    assert code == 0, (out, err)


def test_an_existing_prefix_is_never_written_into(s3, capsys):
    s3.client.put_object(Bucket=s3.bucket, Key="taken/run/notes.txt", Body=b"mine")
    code, _, err = ckpt(capsys, "reshard", str(FIXTURES["dcp"]), s3.url("taken/run"), "--dp", "1")
    assert code == 2 and err.count("\n") == 1 and "objects already exist under this prefix" in err
    assert s3.keys("taken/") == ["taken/run/notes.txt"]


def test_an_interrupted_upload_leaves_nothing(s3, capsys, monkeypatch):
    """A store that fails mid-upload: one line, and the objects this upload created are removed."""
    real, calls = up.Upload._put, []

    def failing(self, local, rel, create=False):
        calls.append(rel)
        if len(calls) == 3:
            raise up.objects.describe_error(TimeoutError("connection timed out"), str(self.target / rel))
        real(self, local, rel, create)

    monkeypatch.setattr(up.Upload, "_put", failing)
    code, _, err = ckpt(capsys, "reshard", str(FIXTURES["dcp"]), s3.url("cut/run"), "--dp", "1")
    assert code == 2 and err.count("\n") == 1 and "did not answer" in err, err
    assert s3.keys("cut/") == []


def test_a_killed_upload_is_not_a_checkpoint(s3, capsys, monkeypatch):
    """A writer killed before its commit object (nothing undone): verify refuses the prefix by name."""
    def killed(self, point):
        raise KeyboardInterrupt  # stands in for SIGKILL at the point the commit object would go up

    monkeypatch.setattr(up.Upload, "undo", lambda self: None)  # a killed process cleans nothing
    real_init = up.Upload.__init__
    monkeypatch.setattr(up.Upload, "__init__", lambda self, target, fault=None, commit=None: real_init(
        self, target, lambda p: killed(self, p), commit))
    code, _, err = ckpt(capsys, "reshard", str(FIXTURES["dcp"]), s3.url("half/run"), "--dp", "1")
    assert code != 0
    keys = s3.keys("half/")
    assert keys and not any(k.endswith("metadata.json") for k in keys)  # data and side files, no commit object
    for argv in (["verify", s3.url("half/run/iter_0000002")], ["inspect", s3.url("half/run/iter_0000002")]):
        code, _, err = ckpt(capsys, *argv)
        assert code == 2 and "an unfinished upload, not a checkpoint" in err, err
