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
