"""``upload.sweep``: a survivor of a torchrun job removes the objects the job's writers created, a killed rank's too,
proven by the token every object of the job carries (``x-amz-meta-ckpt-writer``), and nothing else: objects of
another writer (no token, another token, an object put with boto3) stay, whatever their names; a folder below the
output (a nested output's iteration folder) is swept too. Against brute force: every object's metadata read back
with boto3, the independent client."""

from __future__ import annotations

import random
from pathlib import Path

from gtp_format.storage import upload
from gtp_format.storage.location import parse_location


def _metadata_owner(s3, key: str) -> str | None:
    return s3.client.head_object(Bucket=s3.bucket, Key=key)["Metadata"].get(upload.OWNER_ATTRIBUTE)


def test_sweep_removes_exactly_the_objects_that_carry_the_token(s3, tmp_path: Path) -> None:
    target = parse_location(s3.url("out"))
    mine, theirs = upload.new_owner(), upload.new_owner()
    rng = random.Random(7)
    names = [f"{d}__{i}_0.distcp" for i in range(12) for d in ("", "iter_0000002/")]
    rng.shuffle(names)
    local = tmp_path / "f"
    local.write_bytes(b"x" * 1000)
    for n in names[:8]:  # ours, through the writer's own put
        upload.Upload(target, owner=mine)._put(local, n)
    for n in names[8:14]:  # another writer's, with its own token
        upload.Upload(target, owner=theirs)._put(local, n)
    for n in names[14:]:  # put by another tool: no token at all
        s3.client.put_object(Bucket=s3.bucket, Key=f"out/{n}", Body=b"y")
    deep = "iter_0000002/a/b/__9_0.distcp"  # deeper than any output of ours: never listed, never touched
    upload.Upload(target, owner=mine)._put(local, deep)
    assert _metadata_owner(s3, f"out/{names[0]}") == mine  # the token is the object's own metadata
    gone = upload.sweep(target, mine)
    want_left = sorted(f"out/{n}" for n in [*names[8:], deep])
    assert s3.keys("out/") == want_left
    assert sorted(gone) == sorted(f"out/{n}" for n in names[:8])
    assert all(_metadata_owner(s3, k) != mine for k in want_left if k != f"out/{deep}")
    assert upload.sweep(target, mine) == []  # nothing left of ours at the depths it sweeps
    assert upload.sweep(parse_location(s3.url("empty")), mine) == []


def test_every_object_of_an_upload_carries_its_token(s3, tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    for n in ("__0_0.distcp", "__1_0.distcp", ".metadata", "metadata.json"):
        (work / n).write_bytes(n.encode() * 100)
    up = upload.Upload(parse_location(s3.url("run")))
    up.run(work)
    keys = s3.keys("run/")
    assert len(keys) == 4 and {_metadata_owner(s3, k) for k in keys} == {up.owner}
    assert up.owner != upload.Upload(parse_location(s3.url("other"))).owner  # a fresh token per writer


def test_only_the_exact_token_proves_an_object_ours(s3) -> None:
    """Hostile metadata (another tool may set the same key): an empty value, the token's prefix, the token with
    more after it, in capitals: every such object stays. (Spaces around the token are HTTP's to trim: such a
    value is the token, and whoever wrote it knew the token.)"""
    target = parse_location(s3.url("h"))
    token = upload.new_owner()
    values = ["", token[:-1], token + "0", token.upper(), "x" * 2000]
    for i, v in enumerate(values):
        s3.client.put_object(Bucket=s3.bucket, Key=f"h/__{i}_0.distcp", Body=b"z", Metadata={upload.OWNER_ATTRIBUTE: v})
    s3.client.put_object(Bucket=s3.bucket, Key="h/mine", Body=b"z", Metadata={upload.OWNER_ATTRIBUTE: token})
    assert upload.sweep(target, token) == ["h/mine"]
    assert len(s3.keys("h/")) == len(values)
