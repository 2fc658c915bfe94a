"""The README's and the docs' example commands, run in order on the demo checkpoint, so they cannot rot.

A block is tested when the line before its fence is the ``<!-- tested: ... -->`` marker. Its
commands run as written, with ``runs/demo`` moved into a temporary folder, ``ckpt`` and
``python`` this interpreter; each must exit 0. README.md goes first (it makes the demo checkpoint),
then docs/ in name order. The demo is small (hidden 64, 2 layers, 10 steps on 8 CPU ranks).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MARKER = "<!-- tested: tests/cli/test_doc_examples.py"
DEMO = "runs/demo"


def marked_blocks() -> list[tuple[str, list[str]]]:
    """(file, command lines) of every marked block, README.md first."""
    out = []
    for doc in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        lines = doc.read_text().splitlines()
        for i, line in enumerate(lines):
            if not line.startswith(MARKER):
                continue
            assert lines[i + 1].startswith("```"), f"{doc.name}:{i + 2}: the marker must precede a fence"
            body = []
            for cmd in lines[i + 2:]:
                if cmd.startswith("```"):
                    break
                body.append(cmd)
            text = "\n".join(body).replace("\\\n", " ")
            out.append((doc.name, [c for c in text.splitlines() if c.strip()]))
    return out


def argv(command: str, demo: Path) -> list[str]:
    words = shlex.split(command.replace(DEMO, str(demo)), comments=True)
    if words[0] == "ckpt":
        return [sys.executable, "-m", "ckpt_tool.cli", *words[1:]]
    if words[0] == "python":
        return [sys.executable, *words[1:]]
    return words


def test_the_docs_have_marked_blocks() -> None:
    files = [f for f, _ in marked_blocks()]
    assert files[0] == "README.md" and "reshard-export.md" in files


@pytest.mark.slow
def test_doc_examples_run_in_order_on_the_demo_checkpoint(tmp_path: Path) -> None:
    demo = tmp_path / "demo"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    for doc, commands in marked_blocks():
        for command in commands:
            p = subprocess.run(argv(command, demo), cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
            assert p.returncode == 0, f"{doc}: {command}\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}"
            if "--load" in command and "gtp_runtime.train" in command:
                steps = re.findall(r"^step +(\d+) ", p.stdout, re.MULTILINE)
                assert steps, f"{doc}: {command} trained nothing:\n{p.stdout[-1000:]}"
    assert (tmp_path / "demo-tp2" / "iter_0000012").is_dir(), "the resumed run saved nothing"
