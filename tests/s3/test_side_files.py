"""Small reads from a bucket go out together (moto on 127.0.0.1): a command's side files (manifest, ``.metadata``,
chunk records...) are fetched as its listing names them, each once, and a warm fetch that fails changes nothing a
command reports; ``verify``'s per-bucket tables are read at once."""

from __future__ import annotations

import json
import threading
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
from s3_server import run_ckpt as ckpt
from s3_server import upload

from gtp_format.names import CHUNK_RECORDS_FILE, DCP_METADATA_FILE, MANIFEST_FILE, MEGATRON_METADATA_FILE
from gtp_format.storage import object_cache, objects

REPO = Path(__file__).resolve().parents[2]
FIXTURE = REPO / "fixtures" / "gtp" / "fold_cp2_g2_dp2"
SIDE = (DCP_METADATA_FILE, MANIFEST_FILE, MEGATRON_METADATA_FILE)  # the side files this fixture has


@pytest.fixture
def gets(monkeypatch):
    """Every GET the bucket backend sends (``objects._get``): (object name, offset, length, thread name)."""
    seen: list[tuple[str, int, int, str]] = []
    real = objects._get

    def spy(root, rel, offset, n):
        seen.append((rel.rsplit("/", 1)[-1], offset, n, threading.current_thread().name))
        return real(root, rel, offset, n)

    monkeypatch.setattr(objects, "_get", spy)
    return seen


def test_each_side_file_is_fetched_once_and_concurrently(s3, capsys, gets, monkeypatch):
    monkeypatch.setattr(object_cache, "MAX_DATA_OBJECT", 0)  # side files alone (data objects: test_reshard_prefetch)
    url = upload(s3, FIXTURE, "runs/a")
    code, out, err = ckpt(capsys, "verify", url, "--data", "--format", "json")
    assert code == 0, err
    assert json.loads(out)["ok"] is True
    per_name = Counter(name for name, *_ in gets)
    for name in SIDE:  # verify --data read .metadata twice, each a round trip after the other
        assert per_name[name] == 1, gets
    side = [g for g in gets if g[0] in SIDE]
    assert all(off == 0 and t.startswith("s3-warm") for _, off, _, t in side), side  # whole, on the warm pool
    first_data = next(i for i, g in enumerate(gets) if g[0].endswith(".distcp"))
    assert next(i for i, g in enumerate(gets) if g[0] == DCP_METADATA_FILE) < first_data


def test_a_failed_warm_fetch_is_read_again_by_the_command(s3, capsys, monkeypatch):
    url = upload(s3, FIXTURE, "runs/b")
    code, good, _ = ckpt(capsys, "verify", url, "--data", "--format", "json")
    real = objects._get

    def flaky(root, rel, offset, n):
        if threading.current_thread().name.startswith("s3-warm"):  # side files, and the data objects whole
            raise OSError("injected: the warm fetch failed")
        return real(root, rel, offset, n)

    monkeypatch.setattr(objects, "_get", flaky)
    code2, again, err = ckpt(capsys, "verify", url, "--data", "--format", "json")
    assert (code, code2) == (0, 0), err
    assert json.loads(again) == json.loads(good)


def test_a_side_file_deleted_after_the_listing_is_named_as_missing(s3, capsys, monkeypatch):
    """The warm copy is of the object the listing saw; one gone by the time it is fetched is reported by the
    command's own read, in its own words."""
    url = upload(s3, FIXTURE, "runs/c")
    real = objects._get

    def delete_then_get(root, rel, offset, n):
        if rel == MANIFEST_FILE and threading.current_thread().name.startswith("s3-warm"):
            s3.client.delete_object(Bucket=s3.bucket, Key=f"runs/c/iter_0000002/{MANIFEST_FILE}")
        return real(root, rel, offset, n)

    monkeypatch.setattr(objects, "_get", delete_then_get)
    code, out, err = ckpt(capsys, "verify", url, "--format", "json")
    assert code != 0
    assert MANIFEST_FILE in out + err and "Traceback" not in err


def _submit_on(pool: ThreadPoolExecutor):
    return lambda fn: pool.submit(fn)


def test_only_small_side_files_within_the_budget_are_warmed(monkeypatch):
    monkeypatch.setattr(object_cache, "MAX_SIDE_FILE", 100)
    monkeypatch.setattr(object_cache, "MAX_WARM_BYTES", 150)
    loaded: list[str] = []

    def load(name: str, n: int) -> bytes:
        loaded.append(name)
        return bytes(range(n))

    side = object_cache.SideFiles()
    with ThreadPoolExecutor(2) as pool:
        side.warm("b", [("__0_0.distcp", "p/__0_0.distcp", 10), (DCP_METADATA_FILE, "p/.metadata", 101),
                        (MANIFEST_FILE, "p/m", 100), (CHUNK_RECORDS_FILE, "p/c", 60), ("metadata.json", "p/j", 50),
                        ("index.json", "p/i", 0)], _submit_on(pool), load)
        assert side.take("b", "p/m", 10, 5, True) == bytes(range(10, 15))
        assert side.take("b", "p/j", 0, 50, True) == bytes(range(50))
    # data files, one over MAX_SIDE_FILE, one past the budget (100 + 60 > 150), empty objects: never fetched
    assert sorted(loaded) == sorted([MANIFEST_FILE, "metadata.json"])
    assert side.take("b", "p/c", 0, 1, True) is None
    assert side.take("b", "p/m", 95, 6, True) is None  # past the copy: the store answers (and refuses) it
    side.drop()
    assert side.take("b", "p/m", 0, 1, True) is None


def test_data_objects_are_warmed_all_or_none_within_the_budget(monkeypatch):
    """With a data budget, every listed data file is fetched whole, largest first, if there are few enough, each is
    at most one request and they add up to the budget; otherwise none is (the plan reads them). Other objects (a
    run folder's logs) never are."""
    monkeypatch.setattr(object_cache, "MAX_DATA_OBJECT", 100)
    monkeypatch.setattr(object_cache, "MAX_DATA_OBJECTS", 3)
    listing = [("__0_0.distcp", "p/a", 60), ("model.safetensors", "p/b", 90), (MANIFEST_FILE, "p/m", 10),
               ("train.log", "p/l", 5)]

    def warmed(budget: int, listed: list[tuple[str, str, int]]) -> list[str]:
        loaded: list[str] = []
        side = object_cache.SideFiles()
        side.warm("b", listed, lambda fn: (loaded.append("x"), Future())[1], lambda name, n: b"", budget)
        return sorted(k for _, k, _ in listed if side._copies.get(("b", k)))  # noqa: SLF001

    assert warmed(0, listing) == ["p/m"]  # no budget: side files only
    assert warmed(150, listing) == ["p/a", "p/b", "p/m"]
    assert warmed(149, listing) == ["p/m"]  # 60 + 90 > 149: none of them, not the 90 alone
    assert warmed(10_000, [*listing, ("__2_0.distcp", "p/c", 101)]) == ["p/m"]  # one over a request: none
    many = [(f"__{i}_0.distcp", f"p/{i}", 1) for i in range(4)]
    assert warmed(10_000, [*listing[2:], *many[:3]]) == ["p/0", "p/1", "p/2", "p/m"]
    assert warmed(10_000, [*listing[2:], *many]) == ["p/m"]  # more objects than MAX_DATA_OBJECTS: none


def test_a_copy_in_flight_is_not_waited_for_when_waiting_is_refused():
    side = object_cache.SideFiles()
    pending: Future[bytes] = Future()
    side.warm("b", [(MANIFEST_FILE, "p/m", 4)], lambda fn: pending, lambda name, n: b"")
    assert side.take("b", "p/m", 0, 4, False) is None  # a fetch thread: never waits on another task
    pending.set_result(b"abcd")
    assert side.take("b", "p/m", 1, 2, False) == b"bc"
    failed: Future[bytes] = Future()
    failed.set_exception(OSError("gone"))
    side.warm("b", [(DCP_METADATA_FILE, "p/x", 4)], lambda fn: failed, lambda name, n: b"")
    assert side.take("b", "p/x", 0, 4, True) is None
    assert side.take("b", "p/x", 0, 4, True) is None  # forgotten: the read asks the store


def test_the_bucket_tables_are_read_at_once(s3, capsys, monkeypatch):
    """``verify`` reads the per_bucket_numel tables (one per model-parallel rank) concurrently: the first two reads
    wait for each other, so one after the other they would time out and fail the check."""
    url = upload(s3, FIXTURE, "runs/d")
    real = objects._get
    barrier = threading.Barrier(2, timeout=10)
    seen: list[str] = []

    def paired(root, rel, offset, n):
        if threading.current_thread().name.startswith("bucket-numel"):
            seen.append(rel)
            if len(seen) <= 2:
                barrier.wait()
        return real(root, rel, offset, n)

    monkeypatch.setattr(objects, "_get", paired)
    code, out, err = ckpt(capsys, "verify", url, "--format", "json")
    assert code == 0, (out, err)
    assert len(seen) >= 2
