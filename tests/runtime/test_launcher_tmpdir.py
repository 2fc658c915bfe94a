"""A TMPDIR too long for the fork server's socket is named in one line, with the fix.

The fork server that starts the ranks listens on an AF_UNIX socket under TMPDIR, and AF_UNIX paths
hold 107 bytes; a long TMPDIR (a deep CI work folder) ended every launcher, and ``ckpt
verify-roundtrip``, with a bare ``OSError: AF_UNIX path too long`` and a traceback. A launcher with
one thread forks its gloo ranks itself (no fork server, no socket): there, a long TMPDIR just works.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import launcher_cases as lc
import pytest

COMMANDS = {
    "train": [*lc.LAUNCHER, "--nproc-per-node", "1", "--steps", "1", "--device", "cpu"],
    "verify-roundtrip": [sys.executable, "-m", "ckpt_tool.cli", "verify-roundtrip", "--nproc", "1", "--tp", "1",
                         "--cp", "1", "--gtp-remat", "1", "--dp", "1", "--no-fold-cp"],
}


# The same commands from a process with a thread of its own: its ranks come from a fork server.
WITH_A_THREAD = ("import importlib, sys, threading; "
                 "threading.Thread(target=threading.Event().wait, daemon=True).start(); "
                 "m = importlib.import_module(sys.argv[1]); sys.exit((m.main if hasattr(m, 'main') and "
                 "sys.argv[1].endswith('train') else m.run)(sys.argv[2:]))")


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_tmpdir_too_long_for_a_socket_is_no_matter_where_the_launcher_forks(command: str, tmp_path: Path) -> None:
    long = tmp_path / ("t" * 120)
    long.mkdir()
    p = subprocess.run(COMMANDS[command], cwd=lc.REPO, env={**lc.env(), "TMPDIR": str(long)}, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, (p.stdout[-2000:], p.stderr[-3000:])
    assert not [d for d in long.iterdir() if d.name.startswith("gtp-")], list(long.iterdir())  # nothing left


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_tmpdir_too_long_for_the_fork_server_is_one_line_naming_it(command: str, tmp_path: Path) -> None:
    long = tmp_path / ("t" * 120)
    long.mkdir()
    argv = COMMANDS[command]
    assert argv[1] == "-m"
    p = subprocess.run([sys.executable, "-c", WITH_A_THREAD, *argv[2:]], cwd=lc.REPO,
                       env={**lc.env(), "TMPDIR": str(long)}, capture_output=True, text=True, timeout=600)
    lines = [x for x in p.stderr.splitlines() if x.strip()]
    assert p.returncode == 2, (p.returncode, p.stdout[-2000:], p.stderr[-3000:])
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert f"TMPDIR={long}" in lines[0] and "set TMPDIR to a shorter folder" in lines[0], lines[0]
    assert not [d for d in long.iterdir() if d.name.startswith("gtp-")], list(long.iterdir())  # nothing left
