"""``ckpt inspect``, ``ckpt verify [--data]`` and ``ckpt migrate-aliased --dry-run`` never import torch.

Importing torch costs 2-4 s and a few hundred MB per process, more than a whole verify of a small
checkpoint; the read-only commands therefore run on numpy and the format's own dtype table. Each
case runs the CLI in a fresh interpreter and reports whether torch ended up in ``sys.modules``.
"""

from __future__ import annotations

import pytest
from cli_helpers import run_fresh


@pytest.mark.parametrize(("args", "code"), [
    (["inspect", "fixtures/gtp/fold_cp2_g2_dp2", "--chunks"], 0),
    (["verify", "fixtures/gtp/fold_cp2_g2_dp2", "--data", "--format", "json"], 0),
    (["verify", "fixtures/gtp/fold_cp2_g2_dp2_st", "--data"], 0),
    (["verify", "fixtures/megatron/cp2_dp2_dp_reshardable", "--data"], 0),
    (["inspect", "fixtures/megatron/pp2_dp2_dp_reshardable", "--params"], 0),  # common_state decoded torch-free
    (["plan", "fixtures/gtp/fold_cp2_g2_dp2", "--cp", "2", "--gtp-remat", "2", "--dp", "1", "--read-gbps", "1"], 0),
    (["plan", "fixtures/megatron/pp2_dp2_dp_reshardable", "--pp", "2", "--dp", "2"], 0),
    (["verify", "fixtures/gtp/aliased_cp2_g2_dp2"], 1),  # per_bucket_numel objects decoded torch-free too
    # the migration plan is torch-free: only writing rebuilds tensors (DST is never created by a dry run)
    (["migrate-aliased", "fixtures/gtp/aliased_cp2_g2_dp2", "/nonexistent-dst", "--dry-run", "--reset-lost-moments",
      "--format", "json"], 0),
    (["migrate-aliased", "fixtures/gtp/aliased_cp2_g2_dp2", "--in-place", "--dry-run"], 1),  # refused: lost moments
])
def test_read_only_commands_do_not_import_torch(args: list[str], code: int):
    assert run_fresh(*args) == {"code": code, "torch": False}


def test_show_still_uses_torch():  # the probe can tell: show builds tensors
    args = ["show", "fixtures/gtp/fold_cp2_g2_dp2", "decoder.layers.0.mlp.linear_fc1.weight", "--format", "json"]
    assert run_fresh(*args)["torch"] is True


def test_export_to_torch_writes_its_file_without_torch(tmp_path):  # noqa: ANN001
    """The ``torch.save`` file is written by gtp_format's own writer (gtp_format/writer/torch_file.py)."""
    dst = tmp_path / "m.pt"
    assert run_fresh("export", "fixtures/gtp/fold_cp2_g2_dp2", str(dst), "--to", "torch") == {"code": 0,
                                                                                              "torch": False}
    assert dst.stat().st_size > 0
