"""``ckpt reshard`` from a bucket reads ahead through export's plan (``BoxReader.prefetch_chunks``,
``PlanPrefetch``): every source chunk the copy reads comes from a planned request, none from the workers'
own threads; the output is the local reshard's, file for file (moto's S3 server on 127.0.0.1)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from test_read import FIXTURES, ckpt, upload

from ckpt_tool.copying.plan import read_order, split_files
from gtp_format.dtypes import by_name


class Gets:
    """Every ranged GET obstore sends, with the name of the thread that sent it."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import obstore

        self.seen: list[tuple[str, str]] = []
        real = obstore.get_range

        def spy(store, key, *a, **k):
            self.seen.append((str(key), threading.current_thread().name))
            return real(store, key, *a, **k)

        monkeypatch.setattr(obstore, "get_range", spy)

    def take(self) -> list[tuple[str, str]]:
        out, self.seen = self.seen, []
        return out


def copy_threads(gets: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """GETs of data objects sent by the copy's own worker threads (run_files' pool), not by the shared fetch
    pool (the plan's requests), the ledger's fill, the gate's bucket-table reads or the main thread (metadata, the
    gate, the ledger's end)."""
    return [g for g in gets if g[0].endswith((".distcp", ".safetensors"))
            and not g[1].startswith(("s3-fetch", "ledger-fill", "bucket-numel", "MainThread"))]


def files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


@pytest.fixture
def no_whole_objects(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fixtures' data objects are small enough to be fetched whole at the listing
    (``test_a_small_bucket_source_is_fetched_whole_at_its_listing``); these tests are of the plan's requests."""
    from ckpt_tool.copying import source

    monkeypatch.setattr(source, "WHOLE_OBJECTS", 0)


@pytest.mark.parametrize("layout", sorted(FIXTURES))
def test_reshard_from_a_bucket_reads_through_the_plan(s3, capsys, tmp_path, monkeypatch, layout, no_whole_objects):
    url = upload(s3, FIXTURES[layout], "runs/a")
    gets = Gets(monkeypatch)
    code, out, err = ckpt(capsys, "reshard", url, str(tmp_path / "planned"), "--dp", "1")
    assert code == 0, (out, err)
    planned = gets.take()
    assert copy_threads(planned) == [], copy_threads(planned)[:5]
    # the same command without the plan (the state before): every chunk read on the workers' threads
    from gtp_format.reader import boxes

    monkeypatch.setattr(boxes.BoxReader, "prefetch_chunks", lambda self, order, budget=0: None)
    code, out, err = ckpt(capsys, "reshard", url, str(tmp_path / "direct"), "--dp", "1")
    assert code == 0, (out, err)
    direct = gets.take()
    assert len(copy_threads(direct)) > 0 and len(planned) < len(direct), (len(planned), len(direct))
    code, out, err = ckpt(capsys, "reshard", str(FIXTURES[layout]), str(tmp_path / "local"), "--dp", "1")
    assert code == 0, err
    # torch.save blobs carry a fresh serialization id, so two local reshards differ in bytes too: the outputs
    # are compared key for key, bit for bit, and verified
    for out_dir in ("planned", "direct"):
        assert files(tmp_path / out_dir) == files(tmp_path / "local")
        code, out, err = ckpt(capsys, "diff", str(tmp_path / out_dir), str(tmp_path / "local"), "--bitwise")
        assert code == 0, (out, err)
        code, out, err = ckpt(capsys, "verify", str(tmp_path / out_dir), "--data")
        assert code == 0, (out, err)


def test_a_damaged_bucket_source_is_refused_through_the_plan(s3, capsys, tmp_path):
    """A flipped byte inside a data object: the planned read hashes it, the reshard fails its checksum (exit 1)
    and writes nothing."""
    import shutil

    src = tmp_path / "src"
    shutil.copytree(FIXTURES["dcp"], src)
    victim = src / "iter_0000002" / "__1_0.distcp"
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    victim.write_bytes(bytes(raw))
    url = upload(s3, src, "runs/bad")
    code, out, err = ckpt(capsys, "reshard", url, str(tmp_path / "out"), "--dp", "1")
    assert code == 1 and "__1_0.distcp" in out + err, (code, out, err)
    assert not (tmp_path / "out").exists()


class C:
    """A stand-in chunk of the plan: a name and a size."""

    def __init__(self, name: str, nbytes: int) -> None:
        self.name, self.nbytes, self.dtype = name, nbytes, by_name("float32")


def test_read_order_follows_the_workers():
    parts = [[C("a0", 10), C("a1", 10)], [C("b0", 30)], [C("c0", 5), C("c1", 5)]]
    names = [[c.name for c in p] for p in parts]
    one = [c.name for c in read_order(parts, 1)]  # one thread: the files one after another
    assert one == [n for p in names for n in p]
    two = [c.name for c in read_order(parts, 2)]
    # a0 and b0 start together; a1 at 10 bytes; file a ends at 20, so c starts there, before b ends at 30
    assert two == ["a0", "b0", "a1", "c0", "c1"]
    for w in (1, 2, 3, 5):
        got = read_order(parts, w)
        assert sorted(c.name for c in got) == sorted(n for p in names for n in p)
        for p in names:  # each file's chunks in their own order
            mine = [c.name for c in got if c.name in p]
            assert mine == p


def test_read_order_of_a_real_plan_keeps_every_chunk_once():
    from ckpt_tool.copying.plan import plan_target
    from ckpt_tool.copying.source import open_source

    source = open_source(FIXTURES["dcp"])
    source.reader.close()
    assert source.manifest is not None
    plan = plan_target(source.manifest, 1 << 20)
    parts = split_files(plan.chunks, 4)
    got = read_order(parts, 2)
    assert len(got) == len(plan.chunks) and {id(c) for c in got} == {id(c) for c in plan.chunks}


def test_megatron_reshard_from_a_bucket_reads_through_the_plan(s3, capsys, tmp_path, monkeypatch, no_whole_objects):
    """A genuine megatron-core dp_reshardable checkpoint resharded from a bucket (TP2 x DP2 -> TP1 x CP2 x DP2):
    every data read comes from the plan, and the output equals the local reshard's, key for key."""
    src = Path(__file__).resolve().parents[2] / "fixtures" / "megatron" / "tp2_dp2_dp_reshardable"
    url = upload(s3, src, "runs/m")
    gets = Gets(monkeypatch)
    flags = ("--tp", "1", "--cp", "2", "--dp", "2")
    code, out, err = ckpt(capsys, "reshard", url, str(tmp_path / "planned"), *flags)
    assert code == 0, (out, err)
    planned = gets.take()
    assert copy_threads(planned) == [], copy_threads(planned)[:5]
    code, out, err = ckpt(capsys, "reshard", str(src), str(tmp_path / "local"), *flags)
    assert code == 0, err
    assert files(tmp_path / "planned") == files(tmp_path / "local")
    code, out, err = ckpt(capsys, "diff", str(tmp_path / "planned"), str(tmp_path / "local"), "--bitwise")
    assert code == 0, (out, err)


@pytest.mark.parametrize("command", [("reshard", "{dst}", "--dp", "1"), ("export", "{dst}", "--to", "torch"),
                                     ("verify", "--data")])
def test_a_small_bucket_source_is_fetched_whole_at_its_listing(s3, capsys, tmp_path, monkeypatch, command):
    """A command that reads every byte, of a source whose data objects are each one request and together within
    the budget: each data object is one whole GET, sent from the listing on (on the warm pool, while the gate reads
    the metadata), and no other GET of a data object is sent; the answer is the local folder's."""
    url = upload(s3, FIXTURES["dcp"], "runs/w")
    gets = Gets(monkeypatch)
    argv = [a.format(dst=tmp_path / "out") for a in command]
    code, out, err = ckpt(capsys, argv[0], url, *argv[1:])
    assert code == 0, (out, err)
    data = [g for g in gets.take() if g[0].endswith(".distcp")]
    names = sorted(p.name for p in (FIXTURES["dcp"] / "iter_0000002").glob("*.distcp"))
    assert sorted(k.rsplit("/", 1)[-1] for k, _ in data) == names, data  # each once
    assert all(t.startswith("s3-warm") for _, t in data), data
    local = [a.format(dst=tmp_path / "local") for a in command]
    code, want, err = ckpt(capsys, local[0], str(FIXTURES["dcp"]), *local[1:])
    assert code == 0, err
    if command[0] == "reshard":
        code, out, err = ckpt(capsys, "diff", str(tmp_path / "out"), str(tmp_path / "local"), "--bitwise")
        assert code == 0, (out, err)
    elif command[0] == "export":
        assert (tmp_path / "out").read_bytes() == (tmp_path / "local").read_bytes()


def test_inspect_verify_and_a_tight_budget_fetch_no_data_object_whole(s3, capsys, tmp_path, monkeypatch):
    """Only a command that reads every byte fetches data objects at its listing, and only within its budget:
    ``inspect`` and ``verify`` read metadata alone, and a budget (the least of ``WHOLE_OBJECTS`` and a quarter of
    ``--max-memory``) below the data objects' sum reads them through the plan."""
    url = upload(s3, FIXTURES["dcp"], "runs/n")
    gets = Gets(monkeypatch)
    for argv in (("inspect", url), ("verify", url)):
        code, out, err = ckpt(capsys, *argv)
        assert code == 0, (out, err)
        assert not [g for g in gets.take() if g[0].endswith(".distcp") and g[1].startswith("s3-warm")]
    from ckpt_tool.copying import source

    total = sum(p.stat().st_size for p in (FIXTURES["dcp"] / "iter_0000002").glob("*.distcp"))
    for budget, whole in ((total, True), (total - 1, False)):
        monkeypatch.setattr(source, "WHOLE_OBJECTS", budget)
        code, out, err = ckpt(capsys, "reshard", url, str(tmp_path / f"o{budget}"), "--dp", "1")
        assert code == 0, (out, err)
        warm = [g for g in gets.take() if g[0].endswith(".distcp") and g[1].startswith("s3-warm")]
        assert bool(warm) == whole, (budget, warm)


@pytest.mark.parametrize("command", [("reshard", "{dst}", "--dp", "1"), ("export", "{dst}", "--to", "torch")])
def test_a_data_object_deleted_while_it_is_fetched_whole_is_named_and_nothing_is_written(s3, capsys, tmp_path,
                                                                                        monkeypatch, command):
    """A fault in the whole-object fetch: the object goes away between the listing and its GET. The copy is
    forgotten, the command's own read asks the store, and the command fails in one line naming the object,
    without a traceback and with nothing at DST."""
    from gtp_format.storage import objects

    url = upload(s3, FIXTURES["dcp"], "runs/gone")
    real = objects._get
    victim = "__2_0.distcp"

    def delete_then_get(root, rel, offset, n):
        if rel == victim and threading.current_thread().name.startswith("s3-warm"):
            s3.client.delete_object(Bucket=s3.bucket, Key=f"runs/gone/iter_0000002/{victim}")
        return real(root, rel, offset, n)

    monkeypatch.setattr(objects, "_get", delete_then_get)
    argv = [a.format(dst=tmp_path / "out") for a in command]
    code, out, err = ckpt(capsys, argv[0], url, *argv[1:])
    assert code != 0 and victim in out + err and "Traceback" not in err, (code, out, err)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".*"))
