"""The runtime saves to and resumes from a bucket: 2 gloo ranks through the real launcher, on moto's
S3 server. Resuming from the bucket continues bit for bit where the uninterrupted run went."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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


def test_async_save_to_a_bucket_is_refused(s3):
    p = launch("--steps", "1", "--save", s3.url("d"), "--async-save")
    assert p.returncode == 2 and "--async-save writes local folders only" in p.stderr
    assert s3.keys("d/") == []


def test_no_credentials_is_refused_before_any_rank_starts(s3, monkeypatch):
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    p = launch("--steps", "1", "--save", s3.url("e"))
    assert p.returncode == 2 and p.stdout == "" and "no credentials in the environment" in p.stderr
    assert p.stderr.strip().count("\n") == 0
