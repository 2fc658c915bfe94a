"""Helpers shared by the CLI tests: invoke the app (in process or in a fresh interpreter), check the
one-line error, snapshot a folder."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from typer.testing import CliRunner, Result

from ckpt_tool.cli import app

REPO = Path(__file__).resolve().parents[2]
_FRESH_PROBE = """
import json, sys
from ckpt_tool.cli import app
try:
    app(sys.argv[1:])
except SystemExit as e:
    code = e.code
print(json.dumps({"code": code, "torch": "torch" in sys.modules}))
"""


def run_fresh(*args: str, timeout: float = 120) -> dict:
    """``ckpt ARGS`` in a fresh interpreter: its exit code, and whether torch ended up imported."""
    out = subprocess.run([sys.executable, "-c", _FRESH_PROBE, *args], cwd=REPO, capture_output=True, text=True,
                         timeout=timeout, check=False)
    return json.loads(out.stdout.strip().splitlines()[-1])


def snapshot(root: Path) -> dict[str, tuple[int, int, str]]:
    """Every path under ``root`` with its size, mtime and content hash (links and dirs by name)."""
    out: dict[str, tuple[int, int, str]] = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        if p.is_symlink():
            out[rel] = (0, 0, "link:" + os.readlink(p))
        elif p.is_file():
            st = p.stat()
            out[rel] = (st.st_size, st.st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
        else:
            out[rel] = (0, 0, "dir")
    return out


def cli(*args: str) -> Result:
    return CliRunner().invoke(app, [str(a) for a in args])


def assert_error_line(result: Result, code: int, *needles: str) -> str:
    """Exit ``code`` with exactly one ``ckpt: error:`` line on stderr containing every needle."""
    assert result.exit_code == code, (result.exit_code, result.stdout[-2000:], result.stderr[-2000:], result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("ckpt: error: "), lines[0]
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def rewrite_metadata(folder: Path, edit: Callable[[object], None]) -> None:
    """Edit a fixture's .metadata with the real classes (our own files, hence trusted).

    The manifest's checksum of the old .metadata is dropped so that the test sees the damage it
    made, not the (correct) checksum mismatch.
    """
    path = folder / ".metadata"
    md = pickle.loads(path.read_bytes())  # written by ckpt_factory in this session
    edit(md)
    path.write_bytes(pickle.dumps(md))
    manifest = folder / "gtp_manifest.json"
    if manifest.exists():
        doc = json.loads(manifest.read_text())
        doc.get("files", {}).pop(".metadata", None)
        manifest.write_text(json.dumps(doc))
