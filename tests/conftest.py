"""Fixtures for the ``ckpt`` CLI tests: real DCP checkpoints, built once per session.

``ckpts`` runs :mod:`ckpt_factory` in a subprocess (4 gloo ranks); tests that damage a checkpoint
work on a copy (``copy_ckpt``) and use ``snapshot`` to prove the CLI wrote and changed nothing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

# Timing is not what the property tests check: on the 2-core CI machine, with distributed tests
# running beside them, a draw took 1.2 s and an example 200+ ms, and hypothesis failed the test on
# its health check and deadline, not on a property. Every example still runs; only the clock is off.
settings.register_profile("suite", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("suite")

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


@pytest.fixture(scope="session")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ckpts")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(HERE / "helpers" / "ckpt_factory.py"), str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and (out / "DONE").exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


@pytest.fixture
def copy_ckpt(ckpts: Path, tmp_path: Path) -> Callable[[str], Path]:
    """Copy a fixture checkpoint run (with its parent marker file) into this test's tmp_path."""

    def copy(name: str) -> Path:
        dst = tmp_path / name
        shutil.copytree(ckpts / name, dst, symlinks=True)
        return dst

    return copy
