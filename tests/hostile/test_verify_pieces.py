"""``verify --data`` reading a warm window of a large chunk's payload in pieces (``CKPT_VERIFY_PIECE_KIB``).

Each piece is read into the same start of one buffer, CRC'd (the zip record's CRC-32, the manifest's file
CRC-32C) and scanned before the next is read. The fixtures' chunks are small, so here the window is made
4 KiB and a piece 1 KiB: every chunk over 4 KiB is then read in pieces. What must hold: the same report as
whole windows (every check, every digest, every NaN), damage found the same way, a file that shrinks under
the pass one ``data_file`` error naming its window, a read error raised with every file closed and every
buffer given back, and a bad switch one line.
"""

from __future__ import annotations

import errno
import os
import shutil
import struct
from pathlib import Path

import pytest
from damage import truncate_once_planned

import gtp_format.check.data_read as data_read
from gtp_format.check import data as data_check
from gtp_format.check.verify import verify
from gtp_format.reader.blob import parse_blob
from gtp_format.reader.checkpoint import open_checkpoint
from gtp_format.reader.zip_blob import RangeReader

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "gtp" / "fold_cp2_g2_dp2" / "iter_0000002"


@pytest.fixture
def pieces(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """4 KiB windows read in 1 KiB pieces; the windows read that way (start, stop)."""
    monkeypatch.setattr(data_check, "WINDOW", 4 << 10)
    monkeypatch.setenv(data_read.PIECE_ENV, "1")
    monkeypatch.setenv(data_read.DIRECT_ENV, "0")  # warm fixtures: the same path at any worker count
    taken: list[tuple[int, int]] = []
    real = data_check._FilePass._pieces

    def spy(self, step, found):  # noqa: ANN001, ANN202
        taken.append((step.start, step.stop))
        return real(self, step, found)

    monkeypatch.setattr(data_check._FilePass, "_pieces", spy)
    return taken


def _copy(tmp_path: Path, manifest: bool = True) -> Path:
    run = tmp_path / "run"
    shutil.copytree(FIXTURE, run)
    if not manifest:  # a plain DCP checkpoint: the zip records' CRC-32 is the check
        (run / "gtp_manifest.json").unlink()
    return run


def _report(run: Path, workers: int = 3) -> tuple[list[dict], dict, bool]:
    res = verify(open_checkpoint(run), data=True, workers=workers)
    return [p.to_dict() for p in res.problems], res.stats, res.ok


def _whole(monkeypatch: pytest.MonkeyPatch, run: Path) -> tuple[list[dict], dict, bool]:
    monkeypatch.setenv(data_read.PIECE_ENV, "0")
    try:
        return _report(run)
    finally:
        monkeypatch.setenv(data_read.PIECE_ENV, "1")


def _largest_payload(run: Path) -> tuple[str, int, int]:
    """(file, payload start, payload bytes) of the largest float32 chunk."""
    ckpt = open_checkpoint(run)
    chunk = max((c for e in ckpt.entries.values() if e.dtype.name == "float32" for c in e.chunks
                 if c.storage is not None), key=lambda c: c.storage.length)
    fd = os.open(run / chunk.storage.file, os.O_RDONLY)
    try:
        layout = parse_blob(RangeReader(fd, chunk.storage.offset, chunk.storage.length))
    finally:
        os.close(fd)
    return chunk.storage.file, chunk.storage.offset + layout.payload_offset, layout.payload_bytes


@pytest.mark.parametrize("manifest", [True, False], ids=["file-crc32c", "zip-crc32"])
def test_pieces_give_the_report_of_whole_windows(tmp_path: Path, pieces: list[tuple[int, int]],
                                                 monkeypatch: pytest.MonkeyPatch, manifest: bool):
    run = _copy(tmp_path, manifest)
    got = _report(run)
    assert got[2] and pieces, "clean, and windows were read in pieces"
    assert any(stop - start > 1024 for start, stop in pieces)
    count = len(pieces)
    assert _whole(monkeypatch, run) == got and len(pieces) == count, "whole windows: no pieces, the same report"


@pytest.mark.parametrize("manifest", [True, False], ids=["file-crc32c", "zip-crc32"])
def test_a_flipped_bit_in_a_later_piece_is_found_the_same(tmp_path: Path, pieces: list[tuple[int, int]],
                                                          monkeypatch: pytest.MonkeyPatch, manifest: bool):
    run = _copy(tmp_path, manifest)
    rel, start, nbytes = _largest_payload(run)
    at = start + nbytes - 100  # past the window's first piece
    data = bytearray((run / rel).read_bytes())
    data[at] ^= 0x08
    (run / rel).write_bytes(bytes(data))
    got = _report(run)
    assert not got[2] and any(s < at < e and at - s >= 1024 for s, e in pieces)
    assert any(p["severity"] == "error" and p.get("file") == rel for p in got[0])
    assert _whole(monkeypatch, run) == got


def test_nan_and_inf_in_later_pieces_are_counted_the_same(tmp_path: Path, pieces: list[tuple[int, int]],
                                                          monkeypatch: pytest.MonkeyPatch):
    run = _copy(tmp_path, manifest=False)
    rel, start, nbytes = _largest_payload(run)
    data = bytearray((run / rel).read_bytes())
    for k, bits in enumerate([0x7FC00000, 0x7F800000, 0xFF800000, 0x7FC00001]):  # NaN, +Inf, -Inf, NaN
        at = start + nbytes - 4 * (1 + 300 * k)
        data[at:at + 4] = struct.pack("<I", bits)
    (run / rel).write_bytes(bytes(data))
    got = _report(run)
    counted = got[1]["nonfinite"]
    assert sum(v.get("nan", 0) for v in counted.values()) == 2
    assert sum(v.get("inf", 0) for v in counted.values()) == 2
    assert _whole(monkeypatch, run) == got


def test_a_file_that_shrinks_under_piece_reads_is_one_error(tmp_path: Path, pieces: list[tuple[int, int]],
                                                            monkeypatch: pytest.MonkeyPatch):
    run = _copy(tmp_path)
    victim = "__0_0.distcp"
    truncate_once_planned(monkeypatch, run, victim)
    problems, _, ok = _report(run, workers=2)
    cut = [p for p in problems if p["check"] == "data_file"]
    assert len(cut) == 1 and cut[0]["file"] == victim and "shrank while reading" in cut[0]["message"]
    assert pieces and not ok


def test_a_read_error_in_a_piece_is_raised_with_everything_closed(tmp_path: Path, pieces: list[tuple[int, int]],
                                                                  monkeypatch: pytest.MonkeyPatch):
    """EIO on the third piece of a window: raised, every file closed, every buffer back (a second pass runs)."""
    run = _copy(tmp_path)
    want = _report(run)
    real = os.preadv
    seen: list[int] = []

    def fail(fd, buffers, offset):  # noqa: ANN001, ANN202
        if memoryview(buffers[0]).nbytes <= 1024:
            seen.append(offset)
            if len(seen) == 3:
                raise OSError(errno.EIO, "Input/output error")
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", fail)
    fds = len(os.listdir("/proc/self/fd"))
    with pytest.raises(OSError, match="Input/output error"):
        _report(run)
    assert len(os.listdir("/proc/self/fd")) == fds and len(seen) >= 3
    monkeypatch.setattr(os, "preadv", real)
    assert _report(run) == want


def test_a_short_read_inside_a_piece_is_read_on(tmp_path: Path, pieces: list[tuple[int, int]],
                                                monkeypatch: pytest.MonkeyPatch):
    """A piece's read that returns part of it (as a signal or a network file system may): the rest is read, the same
    report."""
    run = _copy(tmp_path)
    want = _report(run)
    real = os.preadv
    short: list[int] = []

    def half(fd, buffers, offset):  # noqa: ANN001, ANN202
        view = memoryview(buffers[0])
        if view.nbytes == 1024 and len(buffers) == 1:
            short.append(offset)
            return real(fd, [view[:512]], offset)
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", half)
    assert _report(run) == want and short


def test_windows_whose_bytes_a_digest_keeps_are_not_read_in_pieces(tmp_path: Path, pieces: list[tuple[int, int]],
                                                                    monkeypatch: pytest.MonkeyPatch):
    """A file hashed on the main thread (here: two algorithms) keeps each window's view until its merge: whole
    windows, the same digests as a pass that reads them whole."""
    run = _copy(tmp_path)
    ckpt = open_checkpoint(run)
    files = {rel: ["crc32c", "sha256"] for rel in ckpt.data_files}
    got = data_check.check_data(ckpt, files, workers=2)
    assert not pieces and set(got.digests) == set(files)
    monkeypatch.setenv(data_read.PIECE_ENV, "0")
    assert data_check.check_data(open_checkpoint(run), files, workers=2).digests == got.digests


@pytest.mark.parametrize("value", ["2049", "-1", "512K", "", " 1", "\x1b[31m8"])
def test_a_bad_piece_is_one_line_and_exit_2(tmp_path: Path, value: str, monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]):
    from ckpt_tool.cli import run as cli

    monkeypatch.setenv(data_read.PIECE_ENV, value)
    assert cli(["verify", "--data", str(_copy(tmp_path))]) == 2
    err = capsys.readouterr().err.strip()
    assert data_read.PIECE_ENV in err and "KiB" in err and "Traceback" not in err
    assert "\n" not in err and "\x1b" not in err and len(err) < 400, err


def test_the_default_piece_follows_the_workers(monkeypatch) -> None:
    """Unset, pieces of PIECE up to PIECE_WORKERS workers and whole windows above (each piece hands the GIL back and
    takes it again four times: many workers wait on each other); a value set is taken at any worker count. A local
    file's default workers stop at MAX_LOCAL_WORKERS, a bucket's at MAX_WORKERS."""
    monkeypatch.delenv(data_read.PIECE_ENV, raising=False)
    assert [data_read.piece_bytes(w) for w in (1, data_read.PIECE_WORKERS)] == [data_read.PIECE] * 2
    assert [data_read.piece_bytes(w) for w in (data_read.PIECE_WORKERS + 1, 16, 64)] == [0, 0, 0]
    monkeypatch.setenv(data_read.PIECE_ENV, "256")
    assert data_read.piece_bytes(16) == data_read.piece_bytes(1) == 256 << 10
    monkeypatch.setattr(data_check.os, "sched_getaffinity", lambda _: set(range(32)))
    assert data_check.default_workers(remote=False) == data_check.MAX_LOCAL_WORKERS
    assert data_check.default_workers(remote=True) == data_check.MAX_WORKERS
