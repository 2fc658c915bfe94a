"""A work folder's owner that is a zombie (killed, not yet reaped) is dead: its folder is a dead writer's.

Found by the ``--async-save`` fault cases: ranks killed with their launcher stay zombies until the
container's init reaps them, and the next save kept their work folder as a live writer's.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from gtp_format import work


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc (Linux)")
def test_a_zombie_owner_is_dead(tmp_path: Path) -> None:
    pid = os.fork()
    if pid == 0:  # the writer: it leaves its work folder and is killed
        work.new_work(tmp_path / "out", "tmp")
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        deadline = time.monotonic() + 30
        while Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
            assert time.monotonic() < deadline
            time.sleep(0.01)
        (w,) = work.leftovers(tmp_path)
        assert w.pid == pid and w.state == "dead" and work.proven(w)
        assert work.clean_stale(tmp_path) == [w.path] and not w.path.exists()
    finally:
        os.waitpid(pid, 0)


def test_the_copy_a_replace_moves_aside_is_proven_until_its_removal_ends(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The iteration an exchange replaces gets a token before it is moved aside, and loses it last: a
    writer killed meanwhile leaves a copy the next writer removes, never one under a name nothing proves."""
    final = tmp_path / "iter_0000003"
    final.mkdir()
    for name in ("a.distcp", "b.distcp", "metadata.json"):
        (final / name).write_text(name)
    old = work.own_before_removal(final, "old")
    os.rename(final, old)  # the exchange moved it aside
    (w,) = work.leftovers(tmp_path)
    assert w.path == old and w.tag == "old" and work.proven(w)
    real, calls = work.remove_entry, []

    def killed_after_one(path: Path) -> None:
        calls.append(path)
        if len(calls) > 1:
            raise KeyboardInterrupt  # stands in for the kill mid-removal
        real(path)

    monkeypatch.setattr(work, "remove_entry", killed_after_one)
    with pytest.raises(KeyboardInterrupt):
        work.remove_owned(old)
    (w,) = work.leftovers(tmp_path)
    assert work.proven(w) and len(os.listdir(old)) == 3  # two files and the token left
    monkeypatch.setattr(work, "remove_entry", real)
    work.remove_owned(old)
    assert os.listdir(tmp_path) == []


def test_a_folder_it_may_not_write_into_is_moved_aside_unproven_as_before(tmp_path: Path) -> None:
    final = tmp_path / "iter_0000003"
    final.mkdir()
    final.chmod(0o500)
    try:
        if os.access(final, os.W_OK):  # root writes anyway
            pytest.skip("runs as root")
        old = work.own_before_removal(final, "old")
        assert old.name.startswith(".old.iter_0000003.w") and not (final / work.TOKEN_FILE).exists()
    finally:
        final.chmod(0o700)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc (Linux)")
def test_a_kill_between_the_exchange_and_the_rename_leaves_a_proven_copy(tmp_path: Path) -> None:
    """Fault: a re-save killed right after ``RENAME_EXCHANGE``, before the old copy is renamed aside. The old
    copy then sits under the work folder's name; it carries the work folder's token (written before the
    exchange), so it is a proven dead writer's, and the next writer removes it. It carried a fresh token
    before: unproven under that name, kept by every later save."""
    from gtp_format.commit import swap_in_folder

    final = tmp_path / "iter_0000003"
    final.mkdir()
    for name in ("a.distcp", "metadata.json"):
        (final / name).write_text("old " + name)
    pid = os.fork()
    if pid == 0:  # the writer re-saving iteration 3, killed in the moment after the exchange
        try:
            new = work.new_work(final, "tmp")
            (new / "a.distcp").write_text("new")
            old = work.own_before_removal(final, "old", work.token_of(new))
            swap_in_folder(new, final, old, exchanged=lambda: os.kill(os.getpid(), signal.SIGKILL))
        finally:
            os._exit(3)  # no exchange here (renameat2 missing): the moment does not exist
    _, status = os.waitpid(pid, 0)
    if os.WIFEXITED(status):
        pytest.skip("this file system cannot exchange two paths (renameat2)")
    assert os.WTERMSIG(status) == signal.SIGKILL
    assert (final / "a.distcp").read_text() == "new"
    (w,) = work.leftovers(tmp_path)
    assert w.tag == "tmp" and w.state == "dead" and work.proven(w), w
    assert (w.path / "a.distcp").read_text() == "old a.distcp"
    assert work.clean_stale(tmp_path) == [w.path] and not w.path.exists()
