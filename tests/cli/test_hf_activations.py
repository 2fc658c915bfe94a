"""The activation an exported ``config.json`` names computes megatron-core's own activation.

Checked value by value on a grid, not through logits: a tanh GELU written as the erf one moves a
tiny model's logits by only 2e-6, under any logits tolerance. Megatron's values come from the
megatron venv (``tests/helpers/megatron_activations.py``; skipped cleanly without it).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from ckpt_tool.hf.megatron_arch import ACT_BIGCODE, ACT_HF

REPO = Path(__file__).resolve().parents[2]
MEGATRON_PY = REPO / "fixtures" / "megatron" / "_venv" / "bin" / "python"


@pytest.fixture(scope="module")
def megatron_values(tmp_path_factory: pytest.TempPathFactory) -> dict[str, np.ndarray]:
    if not MEGATRON_PY.exists():
        pytest.skip("needs the megatron venv (fixtures/megatron/setup_venv.sh)")
    out = tmp_path_factory.mktemp("act") / "act.npz"
    r = subprocess.run([str(MEGATRON_PY), str(REPO / "tests" / "helpers" / "megatron_activations.py"), str(out)],
                       capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    with np.load(out) as z:
        return {k: z[k] for k in z.files}


@pytest.mark.parametrize("table", [ACT_BIGCODE, ACT_HF], ids=["gpt_bigcode", "rope_classes"])
def test_config_activation_is_megatrons(table: dict[str, str], megatron_values: dict[str, np.ndarray]) -> None:
    from transformers.activations import ACT2FN

    x = torch.from_numpy(megatron_values["x"])
    for megatron_name, hf_name in table.items():
        got = ACT2FN[hf_name](x).numpy()
        want = megatron_values[megatron_name]
        assert np.abs(got - want).max() <= 1e-12, (megatron_name, hf_name, np.abs(got - want).max())
    # the test can tell them apart: erf and tanh GELU differ by far more than the tolerance
    assert np.abs(megatron_values["gelu"] - megatron_values["gelu_tanh"]).max() > 1e-4
