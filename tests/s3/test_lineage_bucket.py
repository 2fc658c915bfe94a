"""``ckpt log`` of a run saved to a bucket (moto), sync and async, and a resume's parent chained there."""

from __future__ import annotations

import json

from test_runtime import launch


def _log(capsys, url: str) -> tuple[int, dict]:
    from ckpt_tool.cli import run

    code = run(["log", url, "--format", "json"])
    out = capsys.readouterr().out
    return code, json.loads(out)


def test_bucket_run_logs_clean_with_parents_chained(s3, capsys, tmp_path):
    staging = tmp_path / "staging"
    staging.mkdir()
    p = launch("--steps", "4", "--save", s3.url("r"), "--save-interval", "2")
    assert p.returncode == 0, p.stderr[-3000:]
    p = launch("--steps", "6", "--load", s3.url("r"), "--save", s3.url("r"), "--save-interval", "2", "--async-save",
               CKPT_S3_STAGING=str(staging))
    assert p.returncode == 0, p.stderr[-3000:]
    code, doc = _log(capsys, s3.url("r"))
    assert code == 0, doc
    it = {e["folder"]: e for e in doc["iterations"]}
    assert list(it) == ["iter_0000002", "iter_0000004", "iter_0000006"]
    assert it["iter_0000006"]["parent"] == {"run_id": it["iter_0000004"]["run_id"],
                                            "root_hash": it["iter_0000004"]["root_hash"], "iteration": 4,
                                            "via": "load"}
    assert len({e["run_id"] for e in doc["iterations"]}) == 1
    # the marker moved back by hand: named, exit 1
    s3.client.put_object(Bucket=s3.bucket, Key="r/latest_checkpointed_iteration.txt", Body=b"2\n")
    code, doc = _log(capsys, s3.url("r"))
    assert code == 1 and "newest complete iteration is 6" in doc["problems"][0]
