"""``ckpt inspect``, ``ckpt verify [--data]`` and ``ckpt migrate-aliased --dry-run`` never import torch.

Importing torch costs 2-4 s and a few hundred MB per process, more than a whole verify of a small
checkpoint; the read-only commands therefore run on numpy and the format's own dtype table. Each
case runs the CLI in a fresh interpreter and reports whether torch ended up in ``sys.modules``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).parents[2]
_PROBE = """
import json, sys
from ckpt_tool.cli import app
try:
    app(sys.argv[1:])
except SystemExit as e:
    code = e.code
print(json.dumps({"code": code, "torch": "torch" in sys.modules}))
"""


def _run(*args: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _PROBE, *args], cwd=REPO, capture_output=True, text=True,
                         timeout=120, check=False)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(("args", "code"), [
    (["inspect", "fixtures/gtp/fold_cp2_g2_dp2", "--chunks"], 0),
    (["verify", "fixtures/gtp/fold_cp2_g2_dp2", "--data", "--format", "json"], 0),
    (["verify", "fixtures/gtp/fold_cp2_g2_dp2_st", "--data"], 0),
    (["verify", "fixtures/megatron/cp2_dp2_dp_reshardable", "--data"], 0),
    (["verify", "fixtures/gtp/aliased_cp2_g2_dp2"], 1),  # per_bucket_numel objects decoded torch-free too
    # the migration plan is torch-free: only writing rebuilds tensors (DST is never created by a dry run)
    (["migrate-aliased", "fixtures/gtp/aliased_cp2_g2_dp2", "/nonexistent-dst", "--dry-run", "--reset-lost-moments",
      "--format", "json"], 0),
    (["migrate-aliased", "fixtures/gtp/aliased_cp2_g2_dp2", "--in-place", "--dry-run"], 1),  # refused: lost moments
])
def test_read_only_commands_do_not_import_torch(args: list[str], code: int):
    assert _run(*args) == {"code": code, "torch": False}


def test_show_still_uses_torch():  # the probe can tell: show builds tensors
    args = ["show", "fixtures/gtp/fold_cp2_g2_dp2", "decoder.layers.0.mlp.linear_fc1.weight", "--format", "json"]
    assert _run(*args)["torch"] is True
