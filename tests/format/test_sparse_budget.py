"""Budgets come from what files really store, not from ``st_size`` (issue 22, class 4), and a byte
object's ``data.pkl`` is bounded before ``torch.load`` sees it (class 7's residual).

A sparse data file has any size for free, and every limit derived from sizes let round 1's memory
classes come back behind one: the ``.metadata`` limit, the bytes that back a ``show``/``diff``
region, a whole-chunk read. Each case here builds the genuine checkpoint, adds holes, and expects
the one-line refusal that names the file, with the old limit shown to have let it through.
"""

from __future__ import annotations

import io
import os
import pickle
import shutil
import warnings
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from gtp_format.errors import ChunkError, FormatError
from gtp_format.reader.checkpoint import open_checkpoint
from gtp_format.reader.chunks import load_object
from gtp_format.reader.region import assemble
from gtp_format.reader.storage import metadata_limit, read_range, stored_bytes, stored_size

ROOT = Path(__file__).resolve().parents[2]
DCP = ROOT / "fixtures/gtp/fold_cp2_g2_dp2/iter_0000002"
MEGATRON = ROOT / "fixtures/megatron/tp2_dp2_dp_reshardable/iter_0000002"


def _holes(path: Path, extra: int) -> int:
    """Append ``extra`` bytes of holes to ``path``; returns where they start."""
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size + extra)
    return size


def test_stored_bytes_of_a_sparse_file(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"x" * 10_000)
    _holes(tmp_path / "f", 1 << 30)
    st = os.stat(tmp_path / "f")
    assert st.st_size == 10_000 + (1 << 30) and stored_bytes(st) < 1 << 20
    assert stored_size(tmp_path, "f") == stored_bytes(st) and stored_size(tmp_path, "../f") == 0


def test_whole_range_read_in_holes_is_refused(tmp_path: Path) -> None:
    (tmp_path / "d").write_bytes(b"x" * 4096)
    at = _holes(tmp_path / "d", 256 << 20)
    with pytest.raises(ChunkError) as info:
        read_range(tmp_path, "d", at, 256 << 20)
    assert "sparse" in info.value.message and "d:" in info.value.message and "\n" not in info.value.message
    assert len(read_range(tmp_path, "d", at, 4096)) == 4096  # small reads are never refused as sparse


def test_metadata_limit_ignores_holes(tmp_path: Path) -> None:
    folder = tmp_path / "iter_0000002"
    shutil.copytree(DCP, folder)
    genuine = (folder / ".metadata").read_bytes()
    (folder / ".metadata").write_bytes(genuine + b"\0" * (3 << 20))  # 3 MiB of junk after STOP
    _holes(folder / "__0_0.distcp", 64 << 30)
    assert metadata_limit(sum(p.stat().st_size for p in folder.glob("*.distcp"))) > 3 << 20  # the old budget
    with pytest.raises(FormatError) as info:
        open_checkpoint(folder)
    assert ".metadata" in info.value.message and "limit" in info.value.message


def test_region_backed_by_holes_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "iter_0000002"
    shutil.copytree(DCP, folder)
    md = pickle.loads((folder / ".metadata").read_bytes())  # our own fixture copy: trusted
    key = next(k for k, v in md.state_dict_metadata.items() if len(getattr(v, "size", ())) == 2)
    tsm = md.state_dict_metadata[key]
    tsm.properties = replace(tsm.properties, dtype=torch.uint8)
    n = 300 << 20
    tsm.size = type(tsm.size)([n, 1])
    tsm.chunks[:] = [replace(tsm.chunks[0], offsets=type(tsm.size)([0, 0]), sizes=type(tsm.size)([n, 1]))]
    idx = next(i for i in md.storage_data if i.fqn == key)
    at = _holes(folder / "__0_0.distcp", n + (1 << 20))
    md.storage_data = {i: s for i, s in md.storage_data.items() if i.fqn != key}
    md.storage_data[idx] = replace(next(iter(md.storage_data.values())), relative_path="__0_0.distcp",
                                   offset=at, length=n + 4096)
    (folder / ".metadata").write_bytes(pickle.dumps(md))
    ckpt = open_checkpoint(folder)
    with pytest.raises(FormatError) as info:
        assemble(ckpt, ckpt.entries[key], 0, n, 1 << 30)
    assert "store only" in info.value.message and key in info.value.message


def _blob_checkpoint(folder: Path, blob: bytes) -> Path:
    """A DCP checkpoint holding ``blob`` as the byte object ``o`` (DCP wraps it in torch.save once more)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"o": io.BytesIO(blob), "t": torch.zeros(2)}, checkpoint_id=str(folder))
    return folder


def _object_checkpoint(folder: Path, obj: object) -> Path:
    blob = io.BytesIO()
    torch.save(obj, blob)
    return _blob_checkpoint(folder, blob.getvalue())


def test_byte_object_data_pkl_is_bounded_before_torch_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    small = open_checkpoint(_object_checkpoint(tmp_path / "small", {"rng": list(range(625)), "x": torch.ones(3)}))
    assert load_object(small, small.entries["o"])["rng"][-1] == 624
    big = open_checkpoint(_object_checkpoint(tmp_path / "big", [[i] for i in range(700_000)]))  # ~5 MB data.pkl
    called = []
    monkeypatch.setattr(torch, "load", lambda *a, **k: called.append(1))
    with pytest.raises(ChunkError) as info:
        load_object(big, big.entries["o"])
    assert not called, "torch.load saw the pickle"
    assert "byte object o" in info.value.message and "data.pkl is" in info.value.message


def test_byte_object_of_many_containers_is_refused_by_the_shape_scan(tmp_path: Path) -> None:
    inner = io.BytesIO()
    with zipfile.ZipFile(inner, "w", zipfile.ZIP_STORED) as z:  # 900 KB of empty lists: under the size limit
        z.writestr("archive/data.pkl", b"\x80\x02(" + b"]" * 900_000 + b"l.")
        z.writestr("archive/version", b"3\n")
    ckpt = open_checkpoint(_blob_checkpoint(tmp_path / "flood", inner.getvalue()))
    with pytest.raises(ChunkError) as info:
        load_object(ckpt, ckpt.entries["o"])
    assert "byte object o" in info.value.message and "containers" in info.value.message, info.value.message


def test_verify_data_does_not_read_holes(tmp_path: Path) -> None:
    """A data file grown by 1 TiB of holes, its manifest size edited to match: ``verify --data``
    would read and hash the terabyte; it names the sparse file instead, at once."""
    import json
    import time

    from gtp_format.check.verify import verify

    folder = tmp_path / "iter_0000002"
    shutil.copytree(DCP, folder)
    _holes(folder / "__0_0.distcp", 1 << 40)
    doc = json.loads((folder / "gtp_manifest.json").read_text())
    doc["files"]["__0_0.distcp"]["size"] = (folder / "__0_0.distcp").stat().st_size
    (folder / "gtp_manifest.json").write_text(json.dumps(doc))
    t0 = time.monotonic()
    result = verify(open_checkpoint(folder), data=True)
    assert time.monotonic() - t0 < 30
    errors = [p for p in result.problems if p.severity == "error"]
    assert errors and all("sparse" in p.message for p in errors), [p.message for p in errors]


def test_holes_within_the_budget_read_as_zeros(tmp_path: Path) -> None:
    """Holes are not damage: a file that stores a third of its size is read, its holes as zeros."""
    from gtp_format.reader.storage import HOLE_FACTOR, is_sparse, read_budget

    path = tmp_path / "z"
    with open(path, "wb") as f:
        f.write(b"\x01" * (4 << 20))
        f.seek(8 << 20, os.SEEK_CUR)  # 8 MiB of holes, as a migration's zeroed moments leave them
        f.write(b"\x02" * 4096)
    st = os.stat(path)
    if stored_bytes(st) >= st.st_size:
        pytest.skip("this file system stores holes")
    assert not is_sparse(st) and read_budget(st) >= st.st_size
    got = read_range(tmp_path, "z", 0, st.st_size)
    assert bytes(got[(4 << 20):(12 << 20)]) == bytes(8 << 20) and got[-1] == 2
    with open(path, "r+b") as f:  # grown past the budget: refused as a bound, naming the factor
        f.truncate(st.st_size + HOLE_FACTOR * stored_bytes(st))
    assert is_sparse(os.stat(path))
    with pytest.raises(ChunkError, match="sparse"):
        read_range(tmp_path, "z", 0, os.stat(path).st_size)


@pytest.mark.parametrize("value", ["٣٢", "0", "-4", "1e3", " 8", str((1 << 20) + 1)])
def test_hole_ratio_override_is_ascii_and_bounded(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from gtp_format.reader.storage import HOLE_FACTOR_ENV, hole_factor

    monkeypatch.setenv(HOLE_FACTOR_ENV, value)
    with pytest.raises(FormatError, match=HOLE_FACTOR_ENV):
        hole_factor()
    monkeypatch.setenv(HOLE_FACTOR_ENV, "64")
    assert hole_factor() == 64
