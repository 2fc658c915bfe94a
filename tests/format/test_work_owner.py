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


def _killed_at(tmp_path: Path, step: int, steps: list[str]) -> bool:
    """A writer that makes a work folder, writes a file into it and removes it (``new_work``, then
    ``remove_owned``), killed (SIGKILL) just before its ``step``-th call of ``mkdir``, ``rename``, ``rmdir`` or
    ``unlink`` (every change of the folder's entries those two make); whether the kill came (``steps``: what
    each call was, filled in by the run that was not killed)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        calls = [0]

        def counted(name: str, real):  # noqa: ANN001, ANN202 - the child's syscall wrapper
            def call(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
                calls[0] += 1
                os.write(w, f"{name}\n".encode())
                if calls[0] == step:
                    os.kill(os.getpid(), signal.SIGKILL)
                return real(*args, **kwargs)
            return call

        try:
            for name in ("mkdir", "rename", "rmdir", "unlink"):
                setattr(os, name, counted(name, getattr(os, name)))
            path = work.new_work(tmp_path / "out", "tmp")
            (path / "a.distcp").write_text("data")
            work.remove_owned(path)
        finally:
            os._exit(0)
    os.close(w)
    _, status = os.waitpid(pid, 0)
    with os.fdopen(r) as f:
        seen = f.read().split()
    if not steps:
        steps.extend(seen)
    return os.WIFSIGNALED(status)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc (Linux)")
def test_a_writer_killed_at_any_step_of_making_or_removing_its_folder_leaves_only_proven_entries(
        tmp_path: Path) -> None:
    """Every state a kill leaves while a work folder is made or removed is proven ours: before the ``mkdir``
    and after the ``rmdir`` its token lies in the proof file beside it (seen once in 8 runs of the upload kill
    test: a kill between dropping the token and the ``rmdir`` left an empty folder nothing proved ours, which
    no cleanup may take by its name). The next writer's cleanup removes every such entry; an empty folder
    merely *named* like a dead writer's (no token, no proof) stays and is listed unproven."""
    steps: list[str] = []
    assert not _killed_at(tmp_path, 0, steps) and os.listdir(tmp_path) == []  # the whole run, for its steps
    # the proof file's write (os.open), mkdir, the proof in as the token, the data file out, the token out to the
    # proof, rmdir, the proof
    assert steps == ["mkdir", "rename", "unlink", "rename", "rmdir", "unlink"], steps
    for step in range(1, len(steps) + 1):
        assert _killed_at(tmp_path, step, []), step
        left = work.leftovers(tmp_path)
        assert all(x.state == "dead" and work.proven(x) for x in left), (step, steps[step - 1], left)
        removed = work.clean_stale(tmp_path)
        assert os.listdir(tmp_path) == [], (step, steps[step - 1], removed, os.listdir(tmp_path))
    named = tmp_path / f".tmp.out.w{work._host_id()}{work._boot_id()}-999999-1-abcdef"  # no token, no proof
    named.mkdir()
    (w,) = work.leftovers(tmp_path)
    assert not work.proven(w) and work.clean_stale(tmp_path) == [] and named.is_dir()


def test_signals_deferred_holds_sigterm_and_sigint_until_the_step_is_done() -> None:
    """Inside, a SIGTERM (and a SIGINT) reaches no handler; on the way out each is delivered once to the
    handler then in place, so a step's effect and its record are never split by a raising handler."""
    import signal

    from gtp_format.work import Terminated, signals_deferred, sigterm_raises

    done = []
    with sigterm_raises(replace=True), pytest.raises(Terminated):
        with signals_deferred():
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)  # the handler would have run here
            done.append("step")
    assert done == ["step"]
    outer = signal.signal(signal.SIGINT, signal.default_int_handler)  # an xdist worker ignores SIGINT
    try:
        with pytest.raises(KeyboardInterrupt):
            with signals_deferred():
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.05)
                done.append("again")
        assert done == ["step", "again"] and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, outer)
