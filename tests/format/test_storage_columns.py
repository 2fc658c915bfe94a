"""verify's storage check over columns gives the chunk-by-chunk walk's verdict, or hands over to it."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from gtp_format.check import verify as checks
from gtp_format.dtypes import DTYPES
from gtp_format.model import BYTES, ENC_RAW, ENC_TORCH_SAVE, TENSOR, Checkpoint, Chunk, Entry, StorageRef


def _ckpt(root: Path, chunks: list[tuple[str, int, int, tuple[int, ...]]], encoding: str = ENC_TORCH_SAVE,
          files: dict[str, int] | None = None, byte_object: StorageRef | None = None,
          transforms: tuple[str, ...] = ()) -> Checkpoint:
    """One 1-D fp32 key whose chunks are ``(file, offset, length, sizes)`` (storage ``None`` where file is '')."""
    files = {"a.distcp": 4096, "b.distcp": 2048} if files is None else files
    for name, size in files.items():
        (root / name).write_bytes(b"\0" * size)
    made = [Chunk(i, (sum(s[3][0] for s in chunks[:i]),), sizes,
                  StorageRef(f, off, ln, transforms if i == 0 else ()) if f else None)
            for i, (f, off, ln, sizes) in enumerate(chunks)]
    numel = sum(c.sizes[0] for c in made)
    entries = {"w": Entry(key="w", kind=TENSOR, shape=(numel,), dtype=DTYPES["float32"], chunks=tuple(made))}
    if byte_object is not None:
        entries["obj"] = Entry(key="obj", kind=BYTES, shape=None, dtype=None,
                               chunks=(Chunk(0, (), (), byte_object),))
    return Checkpoint(root=root, layout="torch_dist", backend="dcp", encoding=encoding, entries=entries,
                      data_files={n: s for n, s in files.items()})


def _both(ckpt: Checkpoint, monkeypatch: pytest.MonkeyPatch) -> tuple[list, list | None]:
    fast = checks._storage_in_order(ckpt)
    with monkeypatch.context() as m:
        m.setattr(checks, "_storage_in_order", lambda c: None)
        walk = checks.check_storage(ckpt)
    return walk, fast


CASES = {
    "in order": [("a.distcp", 0, 100, (10,)), ("a.distcp", 100, 60, (15,)), ("b.distcp", 0, 2048, (8,))],
    "gaps": [("a.distcp", 10, 100, (10,)), ("a.distcp", 500, 60, (15,)), ("b.distcp", 8, 40, (8,))],
    "overlap": [("a.distcp", 0, 100, (10,)), ("a.distcp", 50, 100, (10,))],
    "nested overlap": [("a.distcp", 0, 1000, (10,)), ("a.distcp", 100, 40, (10,)), ("a.distcp", 990, 100, (1,))],
    "past the end": [("a.distcp", 4000, 200, (10,))],
    "declares too much": [("a.distcp", 0, 30, (10,))],
    "no storage": [("a.distcp", 0, 100, (10,)), ("", 0, 0, (10,))],
    "unsafe path": [("../a.distcp", 0, 100, (10,))],
    "missing file": [("c.distcp", 0, 100, (10,))],
    "empty chunks": [("a.distcp", 0, 0, (0,)), ("a.distcp", 0, 0, (0,)), ("a.distcp", 0, 4096, (5,))],
}


@pytest.mark.parametrize("name", list(CASES))
def test_same_verdict_as_the_walk(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt = _ckpt(tmp_path, CASES[name], files={"a.distcp": 4096, "b.distcp": 2048, "orphan.distcp": 7})
    walk, fast = _both(ckpt, monkeypatch)
    assert fast is None or fast == walk
    # where a chunk has a problem of its own, the walk names it: the columns only ever answer "none"
    if any(p.chunk is not None or p.check in ("byte_overlap", "data_file") for p in walk):
        assert fast is None
    if name in ("in order", "gaps", "empty chunks"):
        assert fast == walk and any(p.check == "orphan_file" for p in walk)


def test_raw_encoding_transforms_and_byte_objects(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    exact = [("a.distcp", 0, 40, (10,)), ("a.distcp", 40, 4056, (1014,))]
    for encoding, chunks, expect_fast in ((ENC_RAW, exact, True), (ENC_RAW, [("a.distcp", 0, 44, (10,))], False)):
        walk, fast = _both(_ckpt(tmp_path, chunks, encoding, files={"a.distcp": 4096}), monkeypatch)
        assert (fast is not None) == expect_fast and (fast is None or fast == walk)
    walk, fast = _both(_ckpt(tmp_path, exact, transforms=("zstd",)), monkeypatch)
    assert fast is None and any(p.check == "transform" for p in walk)
    obj = StorageRef("b.distcp", 0, 700)
    walk, fast = _both(_ckpt(tmp_path, exact, byte_object=obj), monkeypatch)
    assert fast == walk
    walk, fast = _both(_ckpt(tmp_path, exact, ENC_RAW, byte_object=obj), monkeypatch)
    assert fast is None


def test_random_layouts_against_the_walk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(41)
    for trial in range(200):
        root = tmp_path / str(trial)
        root.mkdir()
        chunks = []
        for _ in range(rng.randint(1, 12)):
            n = rng.randint(0, 40)
            length = 4 * n + rng.randint(-2, 8)
            chunks.append((rng.choice(["a.distcp", "b.distcp"]), rng.randint(0, 2100), length, (n,)))
        walk, fast = _both(_ckpt(root, chunks), monkeypatch)
        assert fast is None or fast == walk, (chunks, walk, fast)
        if all(p.chunk is None and p.check not in ("byte_overlap", "data_file") for p in walk):
            assert fast == walk, (chunks, walk)
