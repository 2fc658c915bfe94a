"""Running a benchmark script as a user starts it, for tests/benchmarks: one subprocess per script,
its environment, and the two shapes of report the scripts print (a github table, a last JSON line)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "benchmarks"
MEGATRON_PY = REPO / "fixtures" / "megatron" / "_venv" / "bin" / "python"
TIMEOUT = 900  # seconds per run; a busy 2-core machine stretches start-up many times over


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(BENCH)]), "OMP_NUM_THREADS": "1"}


def run(argv: list[str], python: str = sys.executable) -> subprocess.CompletedProcess[str]:
    return subprocess.run([python, *argv], cwd=REPO, env=env(), capture_output=True, text=True, timeout=TIMEOUT)


def explain(p: subprocess.CompletedProcess[str]) -> str:
    return f"exit {p.returncode}\n--- stdout\n{p.stdout[-3000:]}\n--- stderr\n{p.stderr[-3000:]}"


def table(stdout: str) -> list[list[str]]:
    """The rows of the first github-style table in ``stdout`` (header first, rule dropped)."""
    lines = [ln for ln in stdout.splitlines() if ln.startswith("|")]
    rows = [[c.strip() for c in ln.strip("|").split("|")] for ln in lines if not set(ln) <= set("|-: ")]
    assert rows, stdout[-2000:]
    return rows


def last_json(stdout: str) -> dict:
    return json.loads(next(ln for ln in reversed(stdout.splitlines()) if ln.startswith("{")))
