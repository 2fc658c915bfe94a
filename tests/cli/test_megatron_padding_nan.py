"""verify never attributes megatron-core's alignment padding to the model.

megatron-core allocates its distributed-optimizer buffers with ``torch.empty`` and stores the gaps
between parameters (64-element alignment) as chunks of their own, so a healthy checkpoint's padding
may hold NaN. Planted in a copy of a genuine fixture (:mod:`chunk_edit`, the format's own writers):

* NaN in a padding chunk passes ``verify --data`` (with and without ``--cp-size``): it is counted
  apart, as padding, for the original GPT and for SwiGLU, whose ranges the padding map lays out;
* NaN in a parameter's range still fails it ("the run diverged");
* where the layout cannot be established (args that disagree with the tensors), non-finite values
  in bucket keys are a warning that says they are not attributed, never "the run diverged".
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
from chunk_edit import set_elements
from cli_helpers import cli

from gtp_format.megatron.padding import padding_chunks
from gtp_format.reader.checkpoint import open_checkpoint

MEGATRON = Path(__file__).resolve().parents[2] / "fixtures" / "megatron"
FAMILIES = ["pair_tp2_dp2_dp_reshardable", "pair_swiglu_tp2_dp_reshardable", "pair_swiglu_tp1_dp_reshardable",
            "pair_llama_tp2_dp2_dp_reshardable"]


def _copy(tmp_path: Path, name: str) -> Path:
    dst = tmp_path / name
    shutil.copytree(MEGATRON / name, dst, ignore=shutil.ignore_patterns("expected.json", "*.npz"))
    return dst / "iter_0000002"


def _plant(it: Path, padding: bool) -> str:
    """NaN into the first three elements of a padding chunk (or of a parameter's chunk) of an fp32 master key."""
    ckpt = open_checkpoint(it)
    pads = padding_chunks(ckpt)
    assert pads, "the padding map found no padding chunk"
    key = sorted(k for k, _ in pads if k.endswith(".param"))[0]
    chunks = [c.index for c in ckpt.entries[key].chunks if ((key, c.index) in pads) == padding]
    set_elements(it, key, chunks[0], 0, 3, float("nan"))
    return key


def _verify(it: Path, *extra: str) -> tuple[int, dict]:
    r = cli("verify", it, "--data", "--format", "json", *extra)
    return r.exit_code, json.loads(r.stdout)


@pytest.mark.parametrize("name", FAMILIES)
def test_nan_in_padding_passes_and_nan_in_a_parameter_fails(name: str, tmp_path: Path) -> None:
    it = _copy(tmp_path / "pad", name)
    key = _plant(it, padding=True)
    for extra in ((), ("--cp-size", "1")):
        code, doc = _verify(it, *extra)
        assert code == 0 and not doc["stats"]["nonfinite"], doc["problems"]
        assert [p for p in doc["problems"] if p["check"] == "padding" and p["key"] == key], doc["problems"]
        assert not any("diverged" in p["message"] for p in doc["problems"])
    it = _copy(tmp_path / "param", name)
    key = _plant(it, padding=False)
    code, doc = _verify(it)
    assert code == 1 and doc["stats"]["nonfinite"][key]["nan"] == 3, doc["problems"]
    bad = [p for p in doc["problems"] if p["check"] == "nonfinite" and p["key"] == key]
    assert bad and bad[0]["severity"] == "error" and "diverged" in bad[0]["message"], bad


def test_where_the_layout_is_unknown_nan_is_not_attributed(tmp_path: Path) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "hostile"))
    from args_corpus import set_args

    it = _copy(tmp_path, "pair_swiglu_tp2_dp_reshardable")
    key = _plant(it, padding=True)  # the padding map still knows the layout here
    set_args(it, {"num_attention_heads": 8, "kv_channels": 8})  # now it cannot: args disagree with linear_proj
    assert not padding_chunks(open_checkpoint(it))
    code, doc = _verify(it)
    assert code == 0, doc["problems"]
    line = [p for p in doc["problems"] if p["check"] == "nonfinite" and p["key"] == key]
    assert line and line[0]["severity"] == "warning", doc["problems"]
    assert "not attributed" in line[0]["message"] and "layout is unknown" in line[0]["message"]
    assert "num_attention_heads=8" in line[0]["message"]
    assert not any("diverged" in p["message"] for p in doc["problems"])


def test_diff_bitwise_reports_padding_apart_from_data(tmp_path: Path) -> None:
    """Two dp_reshardable saves of one state differ in their uninitialised padding (here: NaN planted in
    one copy's padding): ``diff --bitwise`` says they are identical, and lists the padding apart."""
    name = "pair_swiglu_tp2_dp_reshardable"
    it = _copy(tmp_path / "pad", name)
    key = _plant(it, padding=True)
    r = cli("diff", MEGATRON / name, it, "--bitwise", "--format", "json")
    doc = json.loads(r.stdout)
    assert r.exit_code == 0 and doc["equal"] and not doc["differences"], doc
    assert [p["key"] for p in doc["padding"]] == [key] and doc["padding"][0]["differing"] == 3
    table = cli("diff", MEGATRON / name, it, "--bitwise").stdout
    assert "padding (not data)" in table and "identical" in table
    it = _copy(tmp_path / "param", name)
    key = _plant(it, padding=False)
    r = cli("diff", MEGATRON / name, it, "--bitwise", "--format", "json")
    doc = json.loads(r.stdout)
    assert r.exit_code == 1 and [d["key"] for d in doc["differences"]] == [key] and not doc["padding"], doc
