"""The runtime saves to and resumes from a bucket: 2 gloo ranks through the real launcher, on moto's
S3 server. Resuming from the bucket continues bit for bit where the uninterrupted run went."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_read import ckpt

REPO = Path(__file__).resolve().parents[2]
MODEL = ["--nproc-per-node", "2", "--cp", "2", "--fold-cp", "--device", "cpu"]


def launch(*argv: str, **env: str) -> subprocess.CompletedProcess[str]:
    e = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
         "OMP_NUM_THREADS": "1", **env}
    return subprocess.run([sys.executable, "-m", "gtp_runtime.train", *MODEL, *argv], cwd=REPO, env=e,
                          capture_output=True, text=True, timeout=600)


def test_save_and_resume_bit_exact_through_a_bucket(s3, capsys):
    p = launch("--steps", "4", "--save", s3.url("a"), "--save-interval", "2")
    assert p.returncode == 0, p.stderr[-3000:]
    assert s3.client.get_object(Bucket=s3.bucket, Key="a/latest_checkpointed_iteration.txt")["Body"].read() == b"4\n"
    assert {k.split("/")[1] for k in s3.keys("a/")} == {"iter_0000002", "iter_0000004",
                                                       "latest_checkpointed_iteration.txt"}
    p = launch("--steps", "4", "--load", s3.url("a/iter_0000002"), "--save", s3.url("b"))
    assert p.returncode == 0, p.stderr[-3000:]
    assert "loaded s3://ckpt-test/a/iter_0000002 at iteration 2" in p.stdout
    code, out, err = ckpt(capsys, "diff", s3.url("a"), s3.url("b"), "--bitwise")
    assert code == 0, (out, err)
    code, out, err = ckpt(capsys, "verify", s3.url("b"), "--data")
    assert code == 0, (out, err)


def test_a_save_killed_before_its_commit_object_is_never_loaded(s3, capsys):
    p = launch("--steps", "2", "--save", s3.url("c"), GTP_FAULT_INJECT="before_commit_object:0")
    assert p.returncode != 0
    keys = s3.keys("c/")
    assert keys and not any(k.endswith(("metadata.json", "latest_checkpointed_iteration.txt")) for k in keys)
    code, _, err = ckpt(capsys, "verify", s3.url("c/iter_0000002"))
    assert code == 2 and "an unfinished upload, not a checkpoint" in err
    p = launch("--steps", "4", "--load", s3.url("c/iter_0000002"))
    assert p.returncode == 2 and "an unfinished upload, not a checkpoint" in p.stderr, p.stderr[-2000:]
    assert p.stderr.strip().count("\n") == 0


def _latest(s3, prefix: str) -> bytes:
    return s3.client.get_object(Bucket=s3.bucket, Key=f"{prefix}/latest_checkpointed_iteration.txt")["Body"].read()


def test_async_save_to_a_bucket_resumes_bit_exact(s3, capsys, tmp_path):
    """``--async-save`` to a bucket: the writes and then the upload run in the background; resuming the
    bucket's iteration 2 (asynchronously again) ends bit for bit where the uninterrupted run did."""
    staging = tmp_path / "staging"
    staging.mkdir()
    env = {"CKPT_S3_STAGING": str(staging)}
    p = launch("--steps", "4", "--save", s3.url("a"), "--save-interval", "2", "--async-save",
               "--log-json", str(tmp_path / "full.json"), **env)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "saving s3://ckpt-test/a/iter_0000002 in the background" in p.stdout
    assert "saved s3://ckpt-test/a/iter_0000004" in p.stdout, p.stdout[-2000:]
    assert _latest(s3, "a") == b"4\n"
    assert {k.split("/")[1] for k in s3.keys("a/")} == {"iter_0000002", "iter_0000004",
                                                       "latest_checkpointed_iteration.txt"}
    assert list(staging.iterdir()) == [], "the local staging of every upload is removed"
    p = launch("--steps", "4", "--load", s3.url("a/iter_0000002"), "--save", s3.url("b"), "--async-save",
               "--log-json", str(tmp_path / "resumed.json"), **env)
    assert p.returncode == 0, p.stderr[-3000:]
    full = json.loads((tmp_path / "full.json").read_text())["rows"]
    resumed = json.loads((tmp_path / "resumed.json").read_text())["rows"]
    assert [(x["loss"], x["grad_norm"]) for x in full[2:]] == [(x["loss"], x["grad_norm"]) for x in resumed]
    code, out, err = ckpt(capsys, "diff", s3.url("a"), s3.url("b"), "--bitwise")
    assert code == 0, (out, err)
    code, out, err = ckpt(capsys, "verify", s3.url("b"), "--data")
    assert code == 0, (out, err)


@pytest.mark.parametrize("fault", ["before_commit_object:0:raise", "before_commit_object:0"])
def test_a_failed_async_upload_keeps_the_previous_latest(s3, capsys, tmp_path, fault):
    """An upload that fails (raises: one line, its objects removed) or dies (rank 0 killed in the
    background upload: its data objects stay, without the commit object) before the commit object
    leaves iteration 2 the latest and nothing that ``verify`` or ``--load`` takes for iteration 4."""
    p = launch("--steps", "2", "--save", s3.url("c"), "--async-save")
    assert p.returncode == 0, p.stderr[-3000:]
    p = launch("--steps", "4", "--load", s3.url("c"), "--save", s3.url("c"), "--async-save",
               GTP_FAULT_INJECT=fault)
    assert p.returncode != 0
    assert "step    4" in p.stdout, "training went on while the save ran in the background"
    assert _latest(s3, "c") == b"2\n"
    left = s3.keys("c/iter_0000004/")
    assert not any(k.endswith("metadata.json") for k in left)
    if fault.endswith("raise"):
        lines = [x for x in p.stderr.splitlines() if x.strip()]
        assert len(lines) == 1 and p.returncode == 1, p.stderr[-3000:]
        assert "saving s3://ckpt-test/c/iter_0000004 failed" in lines[0], lines[0]
        assert "injected fault" in lines[0] and "latest checkpoint is still iteration 2" in lines[0], lines[0]
        assert left == [], "a failed upload removes the objects it created"
    else:
        assert left, "a killed upload cleans nothing"
        code, _, err = ckpt(capsys, "verify", s3.url("c/iter_0000004"))
        assert code == 2 and "an unfinished upload, not a checkpoint" in err, err
    code, out, err = ckpt(capsys, "verify", s3.url("c"))
    assert code == 0 and "iter_0000002" in out, (out, err)
    p = launch("--steps", "3", "--load", s3.url("c/iter_0000004"))
    assert p.returncode == 2 and p.stderr.strip().count("\n") == 0, p.stderr[-2000:]


def test_no_credentials_is_refused_before_any_rank_starts(s3, monkeypatch):
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    p = launch("--steps", "1", "--save", s3.url("e"))
    assert p.returncode == 2 and p.stdout == "" and "no credentials in the environment" in p.stderr
    assert p.stderr.strip().count("\n") == 0
