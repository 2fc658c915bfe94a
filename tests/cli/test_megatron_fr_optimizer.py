"""``export --to hf --optimizer`` of a megatron-core ``fully_reshardable`` save (:mod:`ckpt_tool.copying.weights`).

fixtures/megatron/pair_*: one training state saved by megatron-core 0.19.2 as ``dp_reshardable`` and as
``fully_reshardable``. Must hold:

* the export of the ``fully_reshardable`` save writes the same ``model*.safetensors`` and ``optimizer*.safetensors``,
  byte for byte (tensors, their order, the run state in ``__metadata__``), as the export of the
  ``dp_reshardable`` save: dense (TP, PP with tied embeddings at TP 2, untied PP, CP, GQA, q/k norms, MQA, VPP
  with fp32 norms) and MoE (EP 2 chained, EP 1 with the experts in the dense optimizer, expert TP 2, shared
  experts), under HF names or the checkpoint's own;
* where megatron-core's own ``fully_reshardable`` save is wrong (tied embeddings at PP > 1: the state written
  64 elements late, ``tests/cli/test_megatron_view.py``), the optimizer export is refused in one line naming the
  key, nothing written, while the weights alone still export (and equal the dp save's);
* the export's optimizer files import back into megatron-core and carry the state (the lr schedule included).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from cli_helpers import assert_error_line, cli

ROOT = Path(__file__).resolve().parents[2]
MEGATRON = ROOT / "fixtures" / "megatron"
# (pair, export names): the pairs whose model has a transformers class export HF names
PAIRS = [("pair_tp2_dp2_dp_reshardable", "hf"), ("pair_llama_tp2_dp2_dp_reshardable", "hf"),
         ("pair_pp2_tp2_dp_reshardable", "hf"), ("pair_untied_pp2_dp_reshardable", "hf"),
         ("pair_cp2_dp2_dp_reshardable", "hf"), ("pair_qwen3_tp2_dp_reshardable", "hf"),
         ("pair_mqa_tp2_dp_reshardable", "hf"), ("pair_vpp_fp32norm_untied_pp2_dp_reshardable", "megatron"),
         ("pair_mixtral_ep2_dp_reshardable", "hf"), ("pair_mixtral_tp2_ep1_dp_reshardable", "hf"),
         ("pair_qwen2moe_ep2_dp_reshardable", "hf"), ("pair_moe_swiglu_etp2_dp_reshardable", "megatron"),
         ("pair_moe_shared_dp_reshardable", "megatron")]
SHIFTED = ["pair_pp2_dp2_dp_reshardable", "pair_pp4_dp_reshardable", "pair_uneven_pp2_dp_reshardable",
           "pair_vpp_pp2_dp2_dp_reshardable"]


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.glob("*.safetensors"))}


@pytest.mark.parametrize("pair,names", PAIRS)
def test_fully_reshardable_exports_what_the_dp_reshardable_save_of_the_same_state_does(pair: str, names: str,
                                                                                     tmp_path: Path) -> None:
    out = {}
    for side, src in (("dp", MEGATRON / pair), ("fr", MEGATRON / f"{pair}_fully_reshardable")):
        r = cli("export", src, tmp_path / side, "--to", "hf", "--optimizer", "--names", names)
        assert r.exit_code == 0, r.stderr
        out[side] = _files(tmp_path / side)
    assert sorted(out["fr"]) == sorted(out["dp"]) and any(n.startswith("optimizer") for n in out["dp"])
    for name, data in out["dp"].items():
        assert out["fr"][name] == data, name
    if names == "hf":
        for f in ("config.json", "model.safetensors.index.json", "optimizer.safetensors.index.json"):
            if (tmp_path / "dp" / f).exists():
                assert (tmp_path / "fr" / f).read_bytes() == (tmp_path / "dp" / f).read_bytes(), f


@pytest.mark.parametrize("pair", SHIFTED)
def test_megatron_cores_shifted_tied_embedding_state_is_refused(pair: str, tmp_path: Path) -> None:
    src = MEGATRON / f"{pair}_fully_reshardable"
    r = cli("export", src, tmp_path / "x", "--to", "hf", "--optimizer")
    assert_error_line(r, 2, "'optimizer.state.param.embedding.word_embeddings.weight' does not round to the model "
                      "weight", "64 elements late", "without --optimizer")
    assert not (tmp_path / "x").exists()
    for side, s in (("fr", src), ("dp", MEGATRON / pair)):  # the weights alone: the same files
        assert cli("export", s, tmp_path / side, "--to", "hf").exit_code == 0
    assert _files(tmp_path / "fr") == _files(tmp_path / "dp")


def test_the_export_of_a_fully_reshardable_save_imports_and_carries_its_state(tmp_path: Path) -> None:
    """fully_reshardable -> HF (--optimizer) -> megatron-core dp_reshardable at another topology -> HF: the same
    files; the import reports the carried step and schedule."""
    src = MEGATRON / "pair_llama_tp2_dp2_dp_reshardable_fully_reshardable"
    assert cli("export", src, tmp_path / "hf1", "--to", "hf", "--optimizer").exit_code == 0
    raw = (tmp_path / "hf1" / "optimizer.safetensors").read_bytes()
    meta = json.loads(raw[8:8 + struct.unpack("<Q", raw[:8])[0]])["__metadata__"]
    assert json.loads(meta["gtp_megatron_run_state"])["step"] == 2.0
    r = cli("import", tmp_path / "hf1", tmp_path / "mc", "--from", "hf", "--to", "megatron-core", "--dp", "4",
            "--format", "json")
    assert r.exit_code == 0 and json.loads(r.stdout)["optimizer"] == "carried (step 2, lr schedule)", r.stderr
    assert cli("export", tmp_path / "mc", tmp_path / "hf2", "--to", "hf", "--optimizer").exit_code == 0
    assert _files(tmp_path / "hf1") == _files(tmp_path / "hf2")
