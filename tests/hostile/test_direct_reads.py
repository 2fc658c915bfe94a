"""Damaged data files on the ``O_DIRECT`` read path of the runtime's loads (``gtp_format/reader/preads.py``).

The runtime reads a chunk of at least ``DIRECT_MIN`` (1 MiB) with ``O_DIRECT`` into its pooled buffer
(``load_chunk(..., into)``); the hostile corpus's fixtures have smaller chunks, so their loads take the
page-cache path. Here ``DIRECT_MIN`` is lowered below the fixture's chunks and each damage is loaded the way
the runtime loads (``load_chunk`` with a buffer-giving ``into``): every case must end in one
:class:`ChunkError` line naming the data file (and the key where the damage is inside a chunk), never an
``OSError``, a short tensor or wrong bytes; and the direct path must really have been taken.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

import gtp_format.reader.preads as preads
import gtp_format.storage.local as local
from gtp_format.errors import ChunkError, FormatError
from gtp_format.reader.checkpoint import open_checkpoint
from gtp_format.reader.chunks import load_chunk

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "gtp" / "fold_cp2_g2_dp2"


def _largest(ckpt):  # noqa: ANN001, ANN202
    return max(((e, c) for e in ckpt.entries.values() if e.kind == "tensor" for c in e.chunks if c.storage),
               key=lambda ec: ec[1].storage.length)


def _takes_direct(folder: Path) -> bool:
    """Whether the file system under ``folder`` serves an ``O_DIRECT`` read (tmpfs before Linux 6.6 does not)."""
    import mmap

    probe = folder / "direct_probe"
    probe.write_bytes(b"x" * 8192)
    try:
        fd = os.open(probe, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    except OSError:
        return False
    try:
        buf = mmap.mmap(-1, 4096)  # page-aligned
        os.preadv(fd, [buf], 0)
        return bool(getattr(os, "O_DIRECT", 0))
    except OSError:
        return False
    finally:
        os.close(fd)
        probe.unlink()


@pytest.fixture
def direct(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[int]:
    """``DIRECT_MIN`` at 4 KiB, and the lengths every taken direct read returned."""
    if not _takes_direct(tmp_path):
        pytest.skip("this file system refuses O_DIRECT: loads read through the cache (tests/format/test_preads.py)")
    monkeypatch.setattr(preads, "DIRECT_MIN", 4096)
    taken: list[int] = []
    real = preads.read_direct

    def spy(fd, offset, length, into):  # noqa: ANN001, ANN202
        out = real(fd, offset, length, into)
        if out is not None:
            taken.append(out[1])
        return out

    monkeypatch.setattr(local, "read_direct", spy)
    return taken


def _into(n: int) -> memoryview:
    return memoryview(bytearray(n))


def _copy(tmp_path: Path) -> tuple[Path, object, object, Path]:
    run = tmp_path / "run"
    shutil.copytree(FIXTURE, run)
    ckpt = open_checkpoint(run)
    e, c = _largest(ckpt)
    return run, e, c, Path(ckpt.root) / c.storage.file  # type: ignore[attr-defined]


def test_an_intact_chunk_reads_the_same_through_the_direct_path(tmp_path: Path, direct: list[int]) -> None:
    run, e, c, _ = _copy(tmp_path)
    ckpt = open_checkpoint(run)
    got = load_chunk(ckpt, e, c, _into)
    assert direct, "the direct path was not taken"
    import torch

    want = load_chunk(open_checkpoint(FIXTURE), e, c)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("damage", ["truncated_in_chunk", "payload_flip", "shrinks_during_read", "replaced_by_dir"])
def test_a_damaged_file_is_one_chunk_error_naming_it(tmp_path: Path, direct: list[int], monkeypatch: pytest.MonkeyPatch,
                                                     damage: str) -> None:
    run, e, c, path = _copy(tmp_path)
    ckpt = open_checkpoint(run)
    st = c.storage  # type: ignore[attr-defined]
    into = _into
    if damage == "truncated_in_chunk":
        os.truncate(path, st.offset + st.length // 2)
    elif damage == "payload_flip":
        with open(path, "r+b") as f:
            f.seek(st.offset + st.length - 4096)  # inside the elements, far from the zip's head and tail records
            b = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([b[0] ^ 0x40]))
    elif damage == "shrinks_during_read":
        def into(n: int) -> memoryview:  # the range passed its checks; the file is cut before the read itself
            os.truncate(path, st.offset + 100)
            return _into(n)
    else:
        path.unlink()
        path.mkdir()
    with pytest.raises((ChunkError, FormatError)) as err:
        load_chunk(ckpt, e, c, into)
    msg = err.value.message if hasattr(err.value, "message") else str(err.value)
    assert "\n" not in msg and c.storage.file in msg, msg  # type: ignore[attr-defined]
    if damage == "payload_flip":
        assert direct and e.key in msg, msg  # the direct read happened; the check named the key
    if damage == "shrinks_during_read":
        assert direct and direct[-1] < st.length and "shrank" in msg, msg
