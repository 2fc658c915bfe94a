"""megatron-core's own loader accepts ``ckpt export --to fully_reshardable`` at another topology.

For a ``fixtures/megatron/pair_*`` state (one training state saved by megatron-core 0.19.2 as
``dp_reshardable`` and as ``fully_reshardable``), ``tests/helpers/megatron_load.py`` (the megatron
venv, gloo CPU ranks) loads our export of the ``dp_reshardable`` save and megatron's own
``fully_reshardable`` save at a TP/PP/DP neither was saved at, into wiped models and optimizers.
Every rank's model weights, fp32 masters, ``exp_avg`` and ``exp_avg_sq`` must be the same bits
from both; AdamW's per-parameter ``step`` is compared on its own and must be the iteration saved.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest
from cli_helpers import cli

ROOT = Path(__file__).resolve().parents[2]
MEGATRON = ROOT / "fixtures" / "megatron"
MEGATRON_PY = MEGATRON / "_venv" / "bin" / "python"
LOADER = ROOT / "tests" / "helpers" / "megatron_load.py"

# (pair, saved at, loaded at (tp, pp, dp), layers)
CASES = [("pair_tp2_dp2_dp_reshardable", "tp2 pp1 dp2", (1, 2, 2), 2),
         ("pair_pp2_tp2_dp_reshardable", "tp2 pp2 dp1", (1, 1, 4), 2),
         # two buffers, (bf16, fp32) and (fp32, fp32): at PP2 the second stage's buffers are the other way round
         ("pair_fp32norm_dp2_dp_reshardable", "tp1 pp1 dp2", (1, 2, 1), 2)]
# the model variant tests/helpers/megatron_load.py builds for a pair (the generator's spec)
VARIANT = {"pair_fp32norm_dp2_dp_reshardable": "fp32norm", "pair_moe_tp2_etp2_dp_reshardable": "sp"}


def _load(ckpt: Path, out: Path, topo: tuple[int, int, int], layers: int, sharding: str = "fully_reshardable",
          moe: tuple[int, ...] = (1, 0), variant: str = "plain") -> list[dict[str, np.ndarray]]:
    out.mkdir()
    r = subprocess.run([str(MEGATRON_PY), str(LOADER), str(ckpt / "iter_0000002"), str(out), *map(str, topo),
                        str(layers), sharding, *map(str, moe[:2]), variant, *map(str, moe[2:])], capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    ranks = []
    for i in range(topo[0] * topo[1] * topo[2]):
        with np.load(out / f"rank{i}.npz") as z:
            ranks.append({k: z[k] for k in z.files})
    return ranks


@pytest.mark.skipif(not MEGATRON_PY.exists(), reason="needs the megatron venv (fixtures/megatron/setup_venv.sh)")
@pytest.mark.parametrize("pair,saved,topo,layers", CASES)
def test_megatron_loads_our_export_at_another_topology(pair: str, saved: str, topo: tuple[int, int, int],
                                                       layers: int, tmp_path: Path) -> None:
    export = tmp_path / "fr"
    r = cli("export", MEGATRON / pair, export, "--to", "fully_reshardable")
    assert r.exit_code == 0, r.stderr
    variant = VARIANT.get(pair, "plain")
    ours = _load(export, tmp_path / "ours", topo, layers, variant=variant)
    theirs = _load(MEGATRON / f"{pair}_fully_reshardable", tmp_path / "theirs", topo, layers, variant=variant)
    for rank, (a, b) in enumerate(zip(ours, theirs)):
        assert sorted(a) == sorted(b), rank
        assert any(k.startswith("model.") for k in a) and any(k.startswith("opt.") for k in a), rank
        for k in a:
            if k != "step":
                assert a[k].dtype == b[k].dtype and a[k].tobytes() == b[k].tobytes(), (rank, k)
        moments = [a[k] for k in a if k.startswith("opt.")]
        assert all(np.any(m != 0) for m in moments[2::3]), rank  # exp_avg_sq loaded, not the wiped zeros
        assert np.array_equal(a["step"], b["step"]) and np.all(a["step"] == 2.0), (rank, a["step"])


# MoE (moe: EP, experts[, expert TP]): the EP2 x DP2 pair (1 layer, 4 experts) resharded to DP4 x EP2 (expert
# DP 2) and to TP2 (expert TP 1); the TP2 x expert TP2 pair to TP1 and to TP2 x expert TP1
RESHARD_CASES = [*((*c, (1, 0)) for c in CASES), ("pair_moe_ep2_dp_reshardable", "dp2 ep2", (1, 1, 4), 1, (2, 4)),
                 ("pair_moe_ep2_dp_reshardable", "dp2 ep2", (2, 1, 1), 1, (2, 4, 1)),
                 ("pair_moe_tp2_etp2_dp_reshardable", "tp2 etp2 ep2 dp2", (1, 1, 4), 1, (2, 4, 1)),
                 ("pair_moe_tp2_etp2_dp_reshardable", "tp2 etp2 ep2 dp2", (2, 1, 2), 1, (2, 4, 1))]


@pytest.mark.skipif(not MEGATRON_PY.exists(), reason="needs the megatron venv (fixtures/megatron/setup_venv.sh)")
@pytest.mark.parametrize("pair,saved,topo,layers,moe", RESHARD_CASES)
def test_megatron_loads_our_dp_reshardable_reshard_at_its_target(pair: str, saved: str, topo: tuple[int, int, int],
                                                                 layers: int, moe: tuple[int, ...],
                                                                 tmp_path: Path) -> None:
    """``ckpt reshard`` of the pair's dp_reshardable save to another TP/PP/DP, loaded by megatron-core
    as dp_reshardable at that topology (no flag but the topology), holds on every rank the bits
    megatron-core loads from its own fully_reshardable save of the same state there. ``step``: a
    dp_reshardable load leaves AdamW's per-parameter step at the dummy-init value (issue 24), so it
    is only required to be one value across the rank's parameters."""
    out = tmp_path / "rs"
    tp, pp, dp = topo
    etp = ("--etp", str(moe[2])) if len(moe) > 2 else ()
    r = cli("reshard", MEGATRON / pair, out, "--tp", str(tp), "--pp", str(pp), "--dp", str(dp), "--ep", str(moe[0]),
            *etp)
    assert r.exit_code == 0, r.stderr
    variant = VARIANT.get(pair, "plain")
    ours = _load(out, tmp_path / "ours", topo, layers, "dp_reshardable", moe, variant)
    theirs = _load(MEGATRON / f"{pair}_fully_reshardable", tmp_path / "theirs", topo, layers, "fully_reshardable", moe,
                   variant)
    for rank, (a, b) in enumerate(zip(ours, theirs)):
        assert sorted(a) == sorted(b), rank
        for k in a:
            if k != "step":
                assert a[k].dtype == b[k].dtype and a[k].tobytes() == b[k].tobytes(), (rank, k)
        moments = [a[k] for k in a if k.startswith("opt.")]
        assert moments and all(np.any(m != 0) for m in moments[2::3]), rank
        assert len(set(a["step"].tolist())) == 1, (rank, a["step"])


@pytest.mark.skipif(not MEGATRON_PY.exists(), reason="needs the megatron venv (fixtures/megatron/setup_venv.sh)")
def test_megatron_loads_the_reshard_of_a_virtual_pipeline_checkpoint(tmp_path: Path) -> None:
    """``pair_vpp_pp2_dp2``: PP2 x VPP2 x DP2 (4 layers, one buffer per model chunk) resharded to PP2 x DP2
    without virtual pipeline stages, loaded by megatron-core as dp_reshardable there, holds on every
    rank the bits megatron-core loads from our fully_reshardable export at the same topology (its own
    fully_reshardable save of this state has the tied embeddings' state 64 elements late,
    ``tests/cli/test_megatron_vpp.py``, so the export, equal to it everywhere else, is the reference)."""
    pair, topo = "pair_vpp_pp2_dp2_dp_reshardable", (1, 2, 2)
    out, export = tmp_path / "rs", tmp_path / "fr"
    r = cli("reshard", MEGATRON / pair, out, "--pp", "2", "--dp", "2")
    assert r.exit_code == 0, r.stderr
    assert cli("export", MEGATRON / pair, export, "--to", "fully_reshardable").exit_code == 0
    ours = _load(out, tmp_path / "ours", topo, 4, "dp_reshardable")
    theirs = _load(export, tmp_path / "theirs", topo, 4)
    for rank, (a, b) in enumerate(zip(ours, theirs)):
        assert sorted(a) == sorted(b) and any(k.startswith("opt.") for k in a), rank
        for k in a:
            if k != "step":
                assert a[k].dtype == b[k].dtype and a[k].tobytes() == b[k].tobytes(), (rank, k)
        moments = [a[k] for k in a if k.startswith("opt.")]
        assert all(np.any(m != 0) for m in moments[2::3]), rank
        assert len(set(a["step"].tolist())) == 1 and np.all(b["step"] == 2.0), (rank, a["step"])
