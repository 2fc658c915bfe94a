"""A rank that crashes ends the run with one line naming it; its traceback goes to its log file.

Before, the launcher printed every failing rank's traceback (a wall of them when peers fail in
the collectives the crashed rank left) and joined its processes with no bound. Injected here:
rank 1 raises inside the save (``GTP_FAULT_INJECT=before_write:1:raise``).
"""

from __future__ import annotations

import re
import socket
import subprocess
from pathlib import Path

import launcher_cases as lc
import pytest


def _run(cmd: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    env = {**lc.env(), **lc.CRASH_ENV, "TMPDIR": str(tmp_path)}
    argv = [a.replace("{ckpt}", str(tmp_path / "ckpt")) for a in lc.CRASH_RUN]
    return subprocess.run([*cmd, *argv], cwd=lc.REPO, env=env, capture_output=True, text=True, timeout=600)


def _rank_lines(stderr: str) -> dict[int, str]:
    """``error: rank N: ...`` lines by rank; each failing rank prints exactly one."""
    lines = [x for x in stderr.splitlines() if x.startswith("error: rank")]
    by_rank = {int(x.split()[2].rstrip(":")): x for x in lines}
    assert len(by_rank) == len(lines), stderr[-3000:]
    return by_rank


def _crash_log(line: str) -> Path:
    m = re.fullmatch(r"error: rank 1: RuntimeError: injected fault at before_write \(full log: (\S+)\)", line)
    assert m, line
    return Path(m.group(1))


def test_spawned_rank_crash_is_one_line_naming_it(tmp_path: Path) -> None:
    p = _run(lc.LAUNCHER, tmp_path)
    assert p.returncode == 1, p.stderr[-3000:]
    lines = _rank_lines(p.stderr)
    assert list(lines) == [1], "the root cause, not its peers' echoes: " + p.stderr[-3000:]
    log = _crash_log(lines[1])
    assert p.stderr.strip().count("\n") == 0, "one line, nothing else: " + p.stderr[-3000:]
    assert "Traceback (most recent call last)" in log.read_text() and "injected fault" in log.read_text()
    assert "step    1" in p.stdout, "rank 0's progress still reaches the console"
    assert not list((tmp_path / "ckpt").glob("iter_*")), "nothing committed"


@pytest.mark.slow
def test_torchrun_rank_crash_is_one_line_naming_it(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = _run([lc.TORCHRUN, "--nproc-per-node", "2", "--master-port", str(port), "-m", "gtp_runtime.train"], tmp_path)
    assert p.returncode != 0
    # torchrun adds its own report; ours is one line per failing rank: rank 1's crash, and rank 0's
    # collective error if it noticed before torchrun stopped it.
    lines = _rank_lines(p.stderr)
    assert 1 in lines and set(lines) <= {0, 1}, p.stderr[-3000:]
    assert "Traceback (most recent call last)" in _crash_log(lines[1]).read_text()
