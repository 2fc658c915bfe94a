"""The one local-rank launcher (gtp_runtime.launch): results in rank order, failures named in one
line with the traceback in the rank's log, no hang, no process left behind."""

from __future__ import annotations

import time
from pathlib import Path

import launch_jobs as jobs
import pytest

from gtp_runtime.launch import RankFailure, log_path, run_local_ranks


def test_results_in_rank_order_env_and_quiet_console(tmp_path: Path, capfd: pytest.CaptureFixture) -> None:
    out = run_local_ranks(3, jobs.whoami, ("x",), tmp_path, "ok", env={"LAUNCH_TEST_VAR": "seen"})
    assert out == [(0, 6, "x", "seen"), (1, 6, "x", "seen"), (2, 6, "x", "seen")]
    captured = capfd.readouterr()
    assert "must stay off the console" not in captured.out + captured.err
    assert "must stay off the console" in log_path(tmp_path, "ok", 1).read_text()


def test_raising_rank_is_named_with_its_traceback_in_its_log(tmp_path: Path, capfd: pytest.CaptureFixture) -> None:
    t = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_local_ranks(3, jobs.fail_on, (2, "raise"), tmp_path, "t", timeout=60)
    e = info.value
    assert (e.rank, e.kind, e.clean) == (2, "RuntimeError", False)
    assert e.message == "boom on purpose second line"  # one line
    assert str(e) == "rank 2: RuntimeError: boom on purpose second line"
    assert e.line().startswith(str(e)) and str(log_path(tmp_path, "t", 2)) in e.line()
    assert "Traceback (most recent call last)" in log_path(tmp_path, "t", 2).read_text()
    captured = capfd.readouterr()
    assert "Traceback" not in captured.out + captured.err
    assert time.monotonic() - t < 45, "peers of the failed rank must be stopped, not waited for"


def test_known_error_is_clean_and_wins_over_peer_errors() -> None:
    with pytest.raises(RankFailure) as info:
        run_local_ranks(2, jobs.fail_on, (1, "config"), timeout=60)
    e = info.value
    assert (e.rank, e.kind, e.clean) == (1, "ConfigError", True)
    assert e.line() == "rank 1: --cp 3 does not divide the world; pass --dp"


def test_silent_death_named_with_exit_code_and_last_log_line() -> None:
    with pytest.raises(RankFailure) as info:
        run_local_ranks(2, jobs.fail_on, (0, "exit"), timeout=60)
    e = info.value
    assert e.rank == 0 and "exited with code 17" in str(e) and "last words before dying" in str(e)
    assert e.log is not None and Path(e.log).exists(), "a failed call keeps its own work folder for the logs"


def test_deadline_stops_a_run_that_never_finishes(tmp_path: Path) -> None:
    t = time.monotonic()
    with pytest.raises(RankFailure, match="did not finish within 3 s"):
        run_local_ranks(2, jobs.sleep_forever, (), tmp_path, "d", timeout=60, deadline=3)
    assert time.monotonic() - t < 30


def test_own_work_folder_removed_after_success(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)
    run_local_ranks(2, jobs.whoami, ("y",))
    assert list(tmp_path.iterdir()) == []


def test_tensor_results_survive_the_rank_exiting() -> None:
    """torch's pipe pickler sends tensors as shared-memory handles served by the sending rank, which
    exits right after: results are pickled plainly instead (test_dp_reshard_fold lost one so)."""
    import torch

    out = run_local_ranks(2, jobs.tensors, (50_000,))
    assert [r["rank"] for r in out] == [0, 1]
    for i, r in enumerate(out):
        assert torch.equal(torch.cat(r["t"]), torch.arange(50_000, dtype=torch.float32) + i)
