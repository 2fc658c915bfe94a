"""Confined file access: nothing outside the folder is ever opened, whatever the links say."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from gtp_format.errors import ChunkError, FormatError
from gtp_format.reader.locate import locate
from gtp_format.reader.storage import (
    file_size,
    is_folder_inside,
    is_regular_inside,
    open_regular,
    read_range,
    read_small_file,
)
from gtp_format.storage import local


@pytest.fixture
def tree(tmp_path: Path) -> tuple[Path, Path]:
    root = tmp_path / "ckpt"
    (root / "sub").mkdir(parents=True)
    (root / "data.bin").write_bytes(b"0123456789")
    (root / "sub" / "inner.bin").write_bytes(b"inner")
    outside = tmp_path / "secret.txt"
    outside.write_bytes(b"SECRET")
    return root, outside


def test_plain_and_inside_links_are_read(tree):
    root, _ = tree
    (root / "alias.bin").symlink_to("data.bin")
    (root / "sub" / "up.bin").symlink_to("../data.bin")  # leaves sub/, stays in the folder
    (root / "linkdir").symlink_to("sub")
    assert bytes(read_range(root, "data.bin", 2, 3)) == b"234"
    assert bytes(read_range(root, "alias.bin", 0, 4)) == b"0123"
    assert bytes(read_range(root, "sub/up.bin", 0, 2)) == b"01"
    assert file_size(root, "linkdir/inner.bin") == 5
    assert is_folder_inside(root, "linkdir")


@pytest.mark.parametrize("target", ["../secret.txt", "sub/../../secret.txt", "ABS"])
def test_links_out_are_refused(tree, target):
    root, outside = tree
    (root / "evil.bin").symlink_to(str(outside) if target == "ABS" else target)
    for call in (lambda: read_range(root, "evil.bin", 0, 1), lambda: file_size(root, "evil.bin"),
                 lambda: open_regular(root, "evil.bin")):
        with pytest.raises(ChunkError, match="outside the checkpoint folder"):
            call()
    assert is_regular_inside(root, "evil.bin") is None


def test_folder_link_out_and_loops_are_refused(tree):
    root, outside = tree
    (root / "out").symlink_to("..")
    (root / "loop").symlink_to("loop")
    with pytest.raises(ChunkError, match="outside the checkpoint folder"):
        read_range(root, "out/secret.txt", 0, 1)
    with pytest.raises(ChunkError, match="outside the checkpoint folder"):
        file_size(root, "loop")
    assert not is_folder_inside(root, "out")


def test_recorded_paths_must_be_plain(tree):
    root, outside = tree
    for rel in ["../secret.txt", str(outside), "a\x00b", ""]:
        with pytest.raises(ChunkError):
            read_range(root, rel, 0, 1)


def test_non_regular_files_are_refused_without_hanging(tree):
    root, _ = tree
    os.mkfifo(root / "fifo")
    (root / "dir.bin").mkdir()
    done = threading.Event()

    def read_fifo() -> None:
        with pytest.raises(ChunkError, match="not a regular file"):
            file_size(root, "fifo")
        done.set()

    threading.Thread(target=read_fifo, daemon=True).start()
    assert done.wait(10), "opening a FIFO blocked"
    with pytest.raises(ChunkError, match="not a regular file"):
        read_range(root, "dir.bin", 0, 0)
    with pytest.raises(FormatError, match="not a regular file"):
        read_small_file(root / "fifo", 64, "a marker", "fix it")


def test_what_is_checked_is_what_was_opened(tree, monkeypatch: pytest.MonkeyPatch):
    """A file swapped for a link to outside between any check and the open is still refused."""
    root, outside = tree
    real = local._open_at

    def swap_then_open(name, flags, dir_fd):
        if name == "data.bin":
            os.unlink("data.bin", dir_fd=dir_fd)
            os.symlink(str(outside), "data.bin", dir_fd=dir_fd)
        return real(name, flags, dir_fd)

    monkeypatch.setattr(local, "_open_at", swap_then_open)
    with pytest.raises(ChunkError, match="outside the checkpoint folder"):
        read_range(root, "data.bin", 0, 1)


def test_ranges_and_small_files_are_bounded(tree):
    root, _ = tree
    with pytest.raises(ChunkError, match="runs past its end"):
        read_range(root, "data.bin", 8, 5)
    with pytest.raises(FormatError, match="over the 4-byte limit"):
        read_small_file(root / "data.bin", 4, "a marker", "fix it")
    for bad in (-1, 1.5, True):
        with pytest.raises(ChunkError, match="invalid"):
            read_range(root, "data.bin", bad, 1)


def test_latest_marker_is_confined(tmp_path: Path):
    run = tmp_path / "run"
    (run / "iter_0000005").mkdir(parents=True)
    (run / "iter_0000005" / ".metadata").write_bytes(b"x")
    secret = tmp_path / "secret"
    secret.write_text("top secret marker text")
    (run / "latest_checkpointed_iteration.txt").symlink_to(secret)
    with pytest.raises(FormatError) as e:
        locate(run)
    assert "outside the checkpoint folder" in str(e.value) and "top secret" not in str(e.value)
    (run / "latest_checkpointed_iteration.txt").unlink()
    (run / "latest_checkpointed_iteration.txt").write_text("6")
    (run / "iter_0000006").symlink_to(tmp_path)  # the named iteration leads out of the run folder
    with pytest.raises(FormatError, match="not a folder inside the run directory"):
        locate(run)
    (run / "latest_checkpointed_iteration.txt").write_text("5")
    assert locate(run).folder == run / "iter_0000005"
