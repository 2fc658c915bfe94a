"""The rename primitives under the one checkpoint writer (gtp_format.commit); the writer itself is
tested in test_writer.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gtp_format import commit
from gtp_format.commit import commit_file, commit_new_folder, hidden_sibling, swap_in_folder


def _folder(path: Path, text: str) -> Path:
    path.mkdir()
    (path / "f").write_text(text)
    return path


@pytest.fixture(params=["renameat2", "portable"])
def kernel(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each test runs with Linux renameat2 and with the fallback used where it is missing."""
    if request.param == "portable":
        monkeypatch.setattr(commit, "_renameat2", lambda a, b, flags: False)
    return request.param


def test_commit_new_folder_never_replaces(tmp_path: Path, kernel: str):
    final = tmp_path / "out"
    tmp = _folder(hidden_sibling(final, "test"), "new")
    commit_new_folder(tmp, final)
    assert (final / "f").read_text() == "new" and os.listdir(tmp_path) == ["out"]
    (tmp_path / "taken").mkdir()  # empty: a bare rename() would silently replace it
    tmp = _folder(hidden_sibling(tmp_path / "taken", "test"), "new")
    with pytest.raises(FileExistsError):
        commit_new_folder(tmp, tmp_path / "taken")
    assert os.listdir(tmp_path / "taken") == [] and (tmp / "f").read_text() == "new"
    assert sorted(os.listdir(tmp_path)) == sorted(["out", "taken", tmp.name])


def test_commit_file_never_replaces(tmp_path: Path, kernel: str):
    final = tmp_path / "out.pt"
    tmp = hidden_sibling(final, "test")
    tmp.write_text("new")
    commit_file(tmp, final)
    assert final.read_text() == "new" and os.listdir(tmp_path) == ["out.pt"]
    tmp.write_text("newer")
    with pytest.raises(FileExistsError):
        commit_file(tmp, final)
    assert final.read_text() == "new"


def test_swap_keeps_the_old_folder_as_backup(tmp_path: Path, kernel: str):
    final = _folder(tmp_path / "iter", "old")
    swap_in_folder(_folder(hidden_sibling(final, "test"), "new"), final, tmp_path / "iter.bak")
    assert (final / "f").read_text() == "new" and (tmp_path / "iter.bak" / "f").read_text() == "old"
    assert sorted(os.listdir(tmp_path)) == ["iter", "iter.bak"]


def test_swap_puts_the_old_folder_back_when_the_second_rename_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(commit, "_renameat2", lambda a, b, flags: False)
    final = _folder(tmp_path / "iter", "old")
    real_rename = os.rename

    def rename(a, b):
        if Path(a).name.startswith(".test."):
            raise OSError(28, "No space left on device")
        real_rename(a, b)

    monkeypatch.setattr(os, "rename", rename)
    tmp = _folder(hidden_sibling(final, "test"), "new")
    with pytest.raises(OSError):
        swap_in_folder(tmp, final, tmp_path / "iter.bak")
    assert (final / "f").read_text() == "old" and sorted(os.listdir(tmp_path)) == sorted(["iter", tmp.name])
