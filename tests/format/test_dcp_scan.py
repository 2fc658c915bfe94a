"""The columns scan of a DCP ``.metadata`` gives the old reader's model, or gives up: never another verdict.

For every pickle here (genuine ones written by torch's own classes, the fixtures, mutations of them, the
hostile corpus), :func:`columns_model` either returns ``None`` (the caller then reads the file the old way)
or exactly what the old way returns: the same entries, chunks, storage, notes and version, and only where
the old way accepts the file.
"""

from __future__ import annotations

import os
import pickle
import random
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("numba")

from gtp_format.errors import FormatError  # noqa: E402
from gtp_format.model import ChunkColumns  # noqa: E402
from gtp_format.reader import dcp_columns, dcp_reader, dcp_scan  # noqa: E402
from gtp_format.reader.safe_pickle import load_metadata_pickle  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "hostile"))
from hostile_pickles import build_pickles  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
PATH = Path("x/.metadata")


def _old(raw: bytes) -> object:
    try:
        md = load_metadata_pickle(raw, str(PATH))
        return dcp_reader.metadata_entries(PATH, len(raw), md)
    except FormatError as e:
        return f"refused: {e}"


def _same_or_gives_up(raw: bytes) -> bool:
    """True where the scan gave a model (equal to the old one), False where it gave up."""
    new = dcp_columns.columns_model(PATH, raw)
    if new is None:
        return False
    old = _old(raw)
    assert not isinstance(old, str), f"the scan accepted what the old way refuses: {old}"
    entries, notes, version = new
    old_entries, old_notes, old_version = old  # type: ignore[misc]
    assert list(entries) == list(old_entries)
    for key, e in entries.items():
        o = old_entries[key]
        assert (e.key, e.kind, e.shape, e.dtype) == (o.key, o.kind, o.shape, o.dtype)
        assert tuple(e.chunks) == tuple(o.chunks)
        assert e == o and e.stored_bytes == o.stored_bytes
        if isinstance(e.chunks, ChunkColumns):
            assert e.chunks.boxes() == [(c.offsets, c.sizes) for c in o.chunks]
            assert [e.chunks[i] for i in range(-len(o.chunks), len(o.chunks))] == list(o.chunks) * 2
            assert e.chunks[1:3] == o.chunks[1:3]
    assert notes == old_notes and version == old_version
    return True


def _genuine(n_keys: int = 6, per_key: int = 5, *, orphans: int = 0, bytes_keys: int = 1, two_d: bool = False,
             extra_storage: bool = False) -> bytes:
    torch = pytest.importorskip("torch")
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    sdm, storage, planner = {}, {}, {}
    props = TensorProperties(dtype=torch.bfloat16)
    end = 0
    for k in range(n_keys):
        key = f"decoder.layers.{k}.mlp.weight"
        chunks = []
        for i in range(per_key):
            offsets = torch.Size([i * 8, 0] if two_d else [i * 8])
            sizes = torch.Size([8, 4] if two_d else [8])
            chunks.append(ChunkStorageMetadata(offsets=offsets, sizes=sizes))
            storage[MetadataIndex(key, offsets, i)] = _StorageInfo(f"__{i % 2}_0.distcp", end, 64 + k)
            end += 64 + k
        shape = torch.Size([per_key * 8, 4] if two_d else [per_key * 8])
        sdm[key] = TensorStorageMetadata(properties=props if k % 2 else TensorProperties(dtype=torch.float32),
                                         size=shape, chunks=chunks)
        planner[key] = (key,)
    for b in range(bytes_keys):
        key = f"common_state.{b}"
        sdm[key] = BytesStorageMetadata()
        storage[MetadataIndex(key)] = _StorageInfo("__0_0.distcp", end, 99)
        end += 99
    for o in range(orphans):
        storage[MetadataIndex(f"gone.{o}", torch.Size([o]), 0)] = _StorageInfo("__1_0.distcp", end, 5)
        storage[MetadataIndex("decoder.layers.0.mlp.weight", torch.Size([10_000 + o]), 0)] = \
            _StorageInfo("__1_0.distcp", end, 5)
    if extra_storage:
        storage[MetadataIndex("common_state.0", torch.Size([3]), 0)] = _StorageInfo("__0_0.distcp", 0, 1)
    md = Metadata(state_dict_metadata=sdm, planner_data=planner, storage_data=storage,
                  storage_meta=StorageMeta(checkpoint_id=Path("/ck/iter_1"), save_id="s"))
    md.version = "1.0.0"
    return pickle.dumps(md, protocol=4)


@pytest.mark.parametrize("kw", [{}, {"two_d": True}, {"orphans": 3}, {"bytes_keys": 0}, {"extra_storage": True},
                                {"n_keys": 1, "per_key": 1}, {"n_keys": 40, "per_key": 30}])
def test_genuine_pickles_give_the_old_model(kw):
    assert _same_or_gives_up(_genuine(**kw)), "the scan gave up on a genuine DCP pickle"


def test_protocol_5_and_dict_state():
    torch = pytest.importorskip("torch")
    raw = _genuine()
    md = pickle.loads(raw)  # noqa: S301  # our own pickle, made just above
    assert _same_or_gives_up(pickle.dumps(md, protocol=5))
    assert not dcp_columns.columns_model(PATH, pickle.dumps(md, protocol=2))  # BINPUT: left to the old way
    assert torch is not None


@pytest.mark.parametrize("path", sorted(str(p.relative_to(ROOT)) for p in (ROOT / "fixtures").rglob(".metadata")))
def test_fixtures(path):
    raw = (ROOT / path).read_bytes()
    _same_or_gives_up(raw)


def _smallest_megatron() -> bytes:
    """The smallest megatron-core fixture: its Metadata carries ``all_local_plans`` (SavePlans of WriteItems)."""
    return min(((ROOT / "fixtures" / "megatron").rglob(".metadata")), key=lambda p: p.stat().st_size).read_bytes()


@pytest.mark.parametrize("which", ["torch", "megatron"])
def test_mutations_never_accept_what_the_old_way_refuses(which):
    """Byte flips, cuts, insertions and deletions: each mutated pickle is equal or given up, never different."""
    rng = random.Random(41)
    base = _genuine(n_keys=4, per_key=4, orphans=1) if which == "torch" else _smallest_megatron()
    assert _same_or_gives_up(base)
    accepted = 0
    for _ in range(1500 if which == "torch" else 400):
        raw = bytearray(base)
        for _ in range(rng.choice((1, 1, 2, 3))):
            at = rng.randrange(len(raw))
            what = rng.random()
            if what < 0.6:
                raw[at] = rng.randrange(256)
            elif what < 0.75:
                del raw[at:at + rng.randrange(1, 9)]
            elif what < 0.9:
                raw[at:at] = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 5)))
            else:
                del raw[at:]
        accepted += _same_or_gives_up(bytes(raw))
    assert accepted > (50 if which == "torch" else 10), "too few mutations kept a model: the test checks little"


def test_hostile_pickles_are_left_to_the_old_way():
    for name, (_, raw) in build_pickles("/nonexistent/canary").items():
        assert dcp_columns.columns_model(PATH, raw) is None, name


def test_read_dcp_metadata_takes_the_columns_path(tmp_path, monkeypatch):
    """Above the size limit the model comes from the scan (chunks as columns), below it the old way."""
    from gtp_format.reader.checkpoint import open_checkpoint

    folder = tmp_path / "ck"
    folder.mkdir()
    (folder / ".metadata").write_bytes(_genuine(orphans=1))
    for name in ("__0_0.distcp", "__1_0.distcp"):
        with open(folder / name, "wb") as f:
            f.truncate(100_000)
    old = open_checkpoint(folder)
    monkeypatch.setattr(dcp_columns, "MIN_BYTES", 0)
    monkeypatch.setenv(dcp_columns.COMPILE_ENV, "1")  # whether or not numba's cache holds the scan yet
    new = open_checkpoint(folder)
    assert any(isinstance(e.chunks, ChunkColumns) for e in new.entries.values())
    assert not any(isinstance(e.chunks, ChunkColumns) for e in old.entries.values())
    assert new.entries == old.entries and new.notes == old.notes and new.data_files == old.data_files
    from gtp_format.check.verify import verify

    a, b = verify(old), verify(new)
    assert [p.to_dict() for p in a.problems] == [p.to_dict() for p in b.problems] and a.checks == b.checks


def test_scan_taken_only_where_compiled_or_worth_compiling(monkeypatch):
    """Not compiled: a file is scanned only from COMPILE_BYTES (the compile pays for itself in it) or when asked."""
    big, small = dcp_columns.COMPILE_BYTES, dcp_columns.MIN_BYTES
    monkeypatch.delenv(dcp_columns.COMPILE_ENV, raising=False)
    monkeypatch.setattr(dcp_scan, "compiled", lambda: False)
    assert not dcp_columns.wanted(small - 1) and not dcp_columns.wanted(small) and dcp_columns.wanted(big)
    monkeypatch.setenv(dcp_columns.COMPILE_ENV, "1")
    assert dcp_columns.wanted(small) and not dcp_columns.wanted(small - 1)
    monkeypatch.setenv(dcp_columns.COMPILE_ENV, "0")
    assert not dcp_columns.wanted(big)
    monkeypatch.delenv(dcp_columns.COMPILE_ENV)
    monkeypatch.setattr(dcp_scan, "compiled", lambda: True)
    assert dcp_columns.wanted(small)
    for bad in ("2", "yes", "-1", "1e3"):
        monkeypatch.setenv(dcp_columns.COMPILE_ENV, bad)
        with pytest.raises(FormatError, match=dcp_columns.COMPILE_ENV):
            dcp_columns.wanted(small)


def test_compiled_on_disk_reads_numbas_own_cache(tmp_path):
    """A fresh cache folder: not compiled; after one process scans, the next finds all three loops compiled.
    Anything that is not a cached numba dispatcher answers False rather than raising."""
    from gtp_format.reader.jit import compiled_on_disk

    assert not compiled_on_disk(object()) and not compiled_on_disk(None)
    probe = ("from gtp_format.reader import dcp_scan, dcp_columns\n"
             "import sys\n"
             "print(dcp_scan.compiled())\n"
             "if sys.argv[1] == 'scan':\n"
             "    assert dcp_columns.columns_model(dcp_columns.Path('x'), sys.stdin.buffer.read()) is not None\n")
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba"), "CKPT_COMPILE_SCAN": ""}
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")

    def run(mode: str) -> str:
        return subprocess.run([sys.executable, "-c", probe, mode], input=_genuine(orphans=1), env=env, cwd=root,
                              capture_output=True, check=True).stdout.decode().strip()

    assert run("scan") == "False"
    assert run("look") == "True"
