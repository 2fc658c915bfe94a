"""The command session: its limits read once, the work folders it made removed when it fails, its bucket
clients and threads its own and ended with it."""

from __future__ import annotations

from pathlib import Path

import pytest

from gtp_format.errors import FormatError
from gtp_format.session import Session
from gtp_format.storage import limits
from gtp_format.storage.objects import BucketState
from gtp_format.work import TOKEN_FILE, parse_work, proven


def test_each_limit_is_read_once_at_its_first_use(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(limits.HOLE_FACTOR_ENV, "64")
    monkeypatch.setenv(limits.TIMEOUT_ENV, "\u0666\u0660")  # Arabic-Indic digits: refused, but only where used
    session = Session()
    assert session.limits.hole_factor == 64
    monkeypatch.setenv(limits.HOLE_FACTOR_ENV, "8")
    assert session.limits.hole_factor == 64  # the session's value, from start to end
    assert session.storage(Path("/nowhere")).limits.hole_factor == 64  # and its storages'
    assert Session().limits.hole_factor == 8  # the next command reads the environment as it is then
    with pytest.raises(FormatError, match=limits.TIMEOUT_ENV) as e:
        _ = session.limits.s3_timeout_s
    assert "\n" not in str(e.value)


def test_a_failed_session_removes_the_work_folders_it_made_and_proves(tmp_path: Path) -> None:
    target = tmp_path / "out"
    with pytest.raises(RuntimeError), Session() as session:
        store = session.storage(target)
        made = store.new_work(target, "tmp")
        (made / "data").write_bytes(b"x")
        forged = store.new_work(tmp_path / "other", "tmp")
        (forged / TOKEN_FILE).write_text("0" * 32 + "\n")  # no longer the token its name records
        assert session.work.made() == [made, forged]
        raise RuntimeError("the command failed")
    assert not made.exists()  # made here and proven: removed
    w = parse_work(forged)
    assert forged.exists() and w is not None and not proven(w)  # not provably ours: kept, as everywhere


def test_a_session_that_ends_well_removes_nothing(tmp_path: Path) -> None:
    with Session() as session:
        made = session.storage(tmp_path / "out").new_work(tmp_path / "out", "tmp")
    assert made.exists()


def test_a_sessions_threads_and_clients_end_with_it() -> None:
    state = BucketState()
    pool = state.pool()
    assert pool.submit(lambda: 7).result() == 7 and state.pool() is pool  # one pool a session
    state.clients[("b",)] = object()
    state.close()
    assert not state.pools and not state.clients
    with pytest.raises(RuntimeError):
        pool.submit(lambda: 7)  # shut down: its threads end once their tasks have
    assert BucketState().pool() is not pool  # another session's are its own
