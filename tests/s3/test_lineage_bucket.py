"""``ckpt log`` of a run saved to a bucket (moto), sync and async, and a resume's parent chained there."""

from __future__ import annotations

import json

import pytest
from test_runtime import launch


def _log(capsys, url: str) -> tuple[int, dict]:
    from ckpt_tool.cli import run

    code = run(["log", url, "--format", "json"])
    out, err = capsys.readouterr()
    assert out, err
    return code, json.loads(out)


DATA_SUFFIXES = (".distcp", ".safetensors")


def _count_gets(monkeypatch) -> list[tuple[str, str, int | None]]:
    """Every read the bucket client sends, at obstore's level (below the storage layer, whatever calls it):
    (function, key, bytes returned; None where the body is a stream)."""
    import obstore

    seen: list[tuple[str, str, int | None]] = []
    for name in ("get_range", "get_ranges", "get", "open_reader"):
        real = getattr(obstore, name, None)
        if real is None:
            continue

        def spy(store, path, *a, _real=real, _name=name, **k):  # noqa: ANN001, ANN202
            out = _real(store, path, *a, **k)
            n = len(memoryview(out)) if _name == "get_range" else \
                sum(len(memoryview(b)) for b in out) if _name == "get_ranges" else None
            seen.append((_name, str(path), n))
            return out

        monkeypatch.setattr(obstore, name, spy)
    return seen


def test_bucket_run_logs_clean_with_parents_chained(s3, capsys, tmp_path):
    staging = tmp_path / "staging"
    staging.mkdir()
    p = launch("--steps", "4", "--save", s3.url("r"), "--save-interval", "2")
    assert p.returncode == 0, p.stderr[-3000:]
    p = launch("--steps", "6", "--load", s3.url("r"), "--save", s3.url("r"), "--save-interval", "2", "--async-save",
               CKPT_S3_STAGING=str(staging))
    assert p.returncode == 0, p.stderr[-3000:]
    with pytest.MonkeyPatch.context() as mp:
        seen = _count_gets(mp)
        code, doc = _log(capsys, s3.url("r"))
    assert code == 0, doc
    # no tensor data: not one request for a data object, only the small side files (metadata, manifest, records)
    assert seen and not [x for x in seen if x[1].endswith(DATA_SUFFIXES)], seen
    data = sum(int(o["Size"]) for o in s3.client.list_objects_v2(Bucket=s3.bucket, Prefix="r/")["Contents"]
               if o["Key"].endswith(DATA_SUFFIXES))
    assert sum(n or 0 for *_, n in seen) < data / 4, (seen, data)
    with pytest.MonkeyPatch.context() as mp:  # the control: the same spy sees a data read where one is made
        seen = _count_gets(mp)
        from ckpt_tool.cli import run

        assert run(["verify", "--data", s3.url("r/iter_0000002")]) == 0
        capsys.readouterr()
    assert [x for x in seen if x[1].endswith(DATA_SUFFIXES)]
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
