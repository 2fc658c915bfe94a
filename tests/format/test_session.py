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


def count_hole_factor_parses(monkeypatch: pytest.MonkeyPatch, *also: object) -> list[int]:
    """One entry per parse of the hole-factor setting from now on (in ``limits`` and the modules ``also``)."""
    reads: list[int] = []
    parse = limits.hole_factor

    def counted() -> int:
        reads.append(1)
        return parse()

    for module in (limits, *also):
        monkeypatch.setattr(module, "hole_factor", counted)
    return reads


def test_a_local_commands_storages_share_its_limits(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A folder's storages (the source's, the output's) take the command's one Limits: the setting is parsed
    once, however many storages the command opens."""
    reads = count_hole_factor_parses(monkeypatch)
    monkeypatch.setenv(limits.HOLE_FACTOR_ENV, "32")
    session = Session()
    stores = [session.storage(tmp_path / "a"), session.storage(tmp_path / "b"), session.storage(str(tmp_path))]
    assert all(s.limits is session.limits for s in stores)
    assert [s.limits.hole_factor for s in stores] == [32, 32, 32] and len(reads) == 1
    monkeypatch.setenv(limits.HOLE_FACTOR_ENV, "x")  # changed midway: the command keeps what it read
    assert session.storage(tmp_path / "c").limits.hole_factor == 32 and len(reads) == 1


def _failing_reshard(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, forge: bool
                     ) -> tuple[list[Path], list[object], Path]:
    """Run a local ``ckpt reshard`` in-process that fails once its work folder exists, its writer's own removal
    switched off, so that what is left is the session's to remove; the session's record and the writer's
    storage's limits are captured."""
    from cli_helpers import cli

    import ckpt_tool.reshard.engine as engine
    from gtp_format.errors import FormatError as Fe
    from gtp_format.writer.checkpoint import CheckpointWriter

    made: list[Path] = []
    seen: list[object] = []
    end = Session.end

    def spy_end(self: Session, failed: bool) -> None:
        made.extend(self.work.made())
        seen.append(self.limits)
        end(self, failed)

    def fail(fill: object, target: object, plan: object, writer: CheckpointWriter, *a: object) -> None:
        seen.append(writer.storage.limits)
        assert writer.work is not None
        if forge:
            (writer.work / TOKEN_FILE).write_text("0" * 32 + "\n")  # no longer the token its name records
        raise Fe(f"{writer.work}: failed on purpose")

    monkeypatch.setattr(Session, "end", spy_end)
    monkeypatch.setattr(engine, "write_checkpoint", fail)
    monkeypatch.setattr(CheckpointWriter, "abort", lambda self: None)
    fold = Path(__file__).resolve().parents[2] / "fixtures" / "gtp" / "fold_cp2_g2_dp2"
    dst = tmp_path / "dst"
    r = cli("reshard", fold, dst, "--cp", "1", "--dp", "4")
    assert r.exit_code == 2 and "failed on purpose" in r.stderr
    return made, seen, dst


def test_a_failing_local_reshard_removes_its_work_folder_through_its_session(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    made, seen, dst = _failing_reshard(monkeypatch, tmp_path, forge=False)
    assert len(made) == 1 and made[0].parent == tmp_path and parse_work(made[0]) is not None
    assert not made[0].exists() and not dst.exists()  # proven the session's: removed by the session's end
    assert seen[0] is seen[-1]  # the writer's storage took the command's limits


def test_a_failing_local_reshard_keeps_a_forged_work_folder(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    made, _, _ = _failing_reshard(monkeypatch, tmp_path, forge=True)
    assert len(made) == 1
    w = parse_work(made[0])
    assert made[0].exists() and w is not None and not proven(w)  # not provably ours: kept


@pytest.mark.parametrize("command", [("verify", "--data"), ("reshard", "DST", "--cp", "1", "--dp", "4"),
                                     ("export", "DST", "--to", "fully_reshardable")])
def test_a_local_commands_reads_and_writes_take_its_one_limits(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                               command: tuple[str, ...]) -> None:
    """Every storage a local command opens, its source's and its output's (and the writer's read-back), reads
    the hole factor from the command's session: parsed once, however many files it reads."""
    from cli_helpers import cli

    import gtp_format.storage.local as local

    reads = count_hole_factor_parses(monkeypatch, local)  # a read without a session's limits counts there too
    monkeypatch.setenv(limits.HOLE_FACTOR_ENV, "16")
    fold = Path(__file__).resolve().parents[2] / "fixtures" / "gtp" / "fold_cp2_g2_dp2"
    args = [tmp_path / "dst" if a == "DST" else a for a in command]
    r = cli(args[0], fold, *args[1:])
    assert r.exit_code == 0, r.stderr
    assert len(reads) == 1
