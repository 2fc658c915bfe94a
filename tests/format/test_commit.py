"""The folder-commit helpers tools use to publish a derived checkpoint (gtp_format.commit)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gtp_format import commit
from gtp_format.commit import building, commit_new_folder, swap_in_folder


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


def test_building_removes_what_was_not_committed(tmp_path: Path):
    final = tmp_path / "out"
    with pytest.raises(RuntimeError), building(final, "test") as tmp:
        _folder(tmp, "half")
        assert tmp.parent == tmp_path and tmp.name.startswith(".test.out.")
        raise RuntimeError("crash while building")
    assert os.listdir(tmp_path) == []


def test_commit_new_folder_never_replaces(tmp_path: Path, kernel: str):
    final = tmp_path / "out"
    with building(final, "test") as tmp:
        _folder(tmp, "new")
        commit_new_folder(tmp, final)
    assert (final / "f").read_text() == "new" and os.listdir(tmp_path) == ["out"]
    (tmp_path / "taken").mkdir()  # empty: a bare rename() would silently replace it
    with building(tmp_path / "taken", "test") as tmp:
        _folder(tmp, "new")
        with pytest.raises(FileExistsError):
            commit_new_folder(tmp, tmp_path / "taken")
    assert os.listdir(tmp_path / "taken") == [] and sorted(os.listdir(tmp_path)) == ["out", "taken"]


def test_swap_keeps_the_old_folder_as_backup(tmp_path: Path, kernel: str):
    final = _folder(tmp_path / "iter", "old")
    with building(final, "test") as tmp:
        _folder(tmp, "new")
        swap_in_folder(tmp, final, tmp_path / "iter.bak")
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
    with pytest.raises(OSError), building(final, "test") as tmp:
        _folder(tmp, "new")
        swap_in_folder(tmp, final, tmp_path / "iter.bak")
    assert (final / "f").read_text() == "old" and os.listdir(tmp_path) == ["iter"]
