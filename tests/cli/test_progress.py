"""The one progress display: MB and MB/s for bytes, a count and a rate otherwise, only when enabled,
and a bar that follows bytes other processes write (verify-roundtrip's load and save)."""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path

import pytest

from ckpt_tool import output


def _rendered(capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch, unit: str) -> str:
    monkeypatch.setenv("FORCE_COLOR", "1")  # rich draws as on a terminal
    monkeypatch.setenv("COLUMNS", "160")
    monkeypatch.delenv("NO_COLOR", raising=False)
    capsys.readouterr()
    with output.progress(40_000_000, "resharding", True, unit) as advance:
        for _ in range(8):
            advance(4_000_000)
            time.sleep(0.15)
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", capsys.readouterr().err)  # drop colours and cursor moves


def test_bytes_show_megabytes_and_throughput(capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    err = _rendered(capsys, monkeypatch, output.BYTES)
    assert "resharding" in err and "/40.0 MB" in err and "MB/s" in err, err[-500:]
    assert "/40000000" not in err


def test_counts_show_their_noun_and_rate(capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    err = _rendered(capsys, monkeypatch, "chunks")
    assert "/40000000 chunks" in err and "chunks/s" in err, err[-500:]


def test_disabled_draws_nothing(capsys: pytest.CaptureFixture) -> None:
    capsys.readouterr()
    with output.progress(10, "x", False) as advance:
        advance(10)
    assert capsys.readouterr() == ("", "")


def test_follow_bytes_written_advances_while_files_grow(tmp_path: Path) -> None:
    folder = tmp_path / "out"
    steps: list[int] = []

    def writer() -> None:
        (folder / "sub").mkdir(parents=True)
        for i in range(6):
            (folder / "sub" / f"f{i}").write_bytes(b"x" * 1000)
            time.sleep(0.12)

    with output.follow_bytes_written(folder, steps.append, total=8000, interval=0.05):
        t = threading.Thread(target=writer)
        t.start()
        t.join()
        time.sleep(0.2)
        seen_during = sum(steps)
    assert len(steps) >= 3 and 0 < seen_during <= 6000, steps  # it moved while the files were written
    assert sum(steps) == 8000  # and the rest of the total at the end


FIXTURES = sorted(p.parent for p in Path(__file__).resolve().parents[2].glob("fixtures/*/*/iter_*/.metadata"))


@pytest.mark.parametrize("run", FIXTURES, ids=[f"{p.parent.parent.name}/{p.parent.name}" for p in FIXTURES])
def test_verify_data_advances_in_bytes_to_the_data_files_total(run: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """verify --data's progress is bytes: many steps as windows finish (not one jump at the end), summing to
    exactly the data files' bytes, the total the CLI gives its bar."""
    from gtp_format.check import data as data_check
    from gtp_format.check.verify import verify
    from gtp_format.reader.checkpoint import open_checkpoint

    monkeypatch.setattr(data_check, "WINDOW", 4096)
    ckpt = open_checkpoint(run)
    steps: list[int] = []
    verify(ckpt, data=True, workers=2, progress=steps.append)
    assert sum(steps) == data_check.data_bytes(ckpt) == sum(ckpt.data_files.values()) > 0
    assert len(steps) > len(ckpt.data_files) and min(steps) > 0, steps[:20]


def test_verify_cli_opens_a_bytes_bar(monkeypatch: pytest.MonkeyPatch) -> None:
    from cli_helpers import cli

    from ckpt_tool.commands import verify as verify_cmd
    from gtp_format.check.data import data_bytes
    from gtp_format.reader.checkpoint import open_checkpoint

    bars: list[tuple[int, str]] = []
    real = output.progress

    def spy(total: int, description: str, enabled: bool, unit: str = output.BYTES):  # type: ignore[no-untyped-def]
        bars.append((total, unit))
        return real(total, description, False, unit)

    monkeypatch.setattr(verify_cmd, "progress", spy)
    run = FIXTURES[0]
    assert cli("verify", run, "--data").exit_code == 0
    assert bars == [(data_bytes(open_checkpoint(run)), output.BYTES)] and bars[0][0] > 0
