"""Checkpoints written before the format moved into gtp_format still verify, load and save back exactly.

``fixtures/compat/`` was written by commit 101e36d and ``fixtures/gtp/`` by 4ed88d2 (see
fixtures/compat/README.md); neither is ever regenerated.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_helpers import cli, snapshot

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
COMPAT = sorted(p for p in (FIXTURES / "compat").iterdir() if p.is_dir())
FROZEN = COMPAT + sorted(p for p in (FIXTURES / "gtp").iterdir() if p.is_dir() and not p.name.startswith("aliased"))


@pytest.mark.parametrize("run", FROZEN, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_frozen_checkpoint_verifies_with_data(run: Path):
    result = cli("verify", run, "--data", "--format", "json")
    assert result.exit_code == 0, (result.stdout[-2000:], result.stderr)
    doc = json.loads(result.stdout)
    assert doc["ok"] and not [p for p in doc["problems"] if p["severity"] != "info"]


@pytest.mark.slow
@pytest.mark.parametrize("run", COMPAT, ids=lambda p: p.name)
def test_frozen_checkpoint_loads_and_saves_back_bit_exact(run: Path):
    """Load with today's runtime at the manifest's topology, save, compare every key bit for bit."""
    before = snapshot(run)
    result = cli("verify-roundtrip", run, "--format", "json")
    assert result.exit_code == 0, (result.stdout[-3000:], result.stderr[-3000:])
    assert json.loads(result.stdout)["ok"]
    assert snapshot(run) == before
