"""gtp_runtime.roundtrip without processes: bitwise comparison, bucket size recovery, manifest configs."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from fake_groups import fake_groups

from gtp_format.layout.config import ConfigError, ModelConfig, ParallelConfig
from gtp_format.layout.schema import derive_bucket_size
from gtp_format.manifest import parse_manifest
from gtp_runtime.buffers import build_buffers
from gtp_runtime.checkpoint.manifest import buffer_layout
from gtp_runtime.model import GPTModel
from gtp_runtime.roundtrip import (
    DEFAULT_BUCKET_SIZE,
    compare_snapshots,
    config_from_manifest,
    is_model_key,
)

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "gtp" / "fold_cp2_g2_dp2" / "iter_0000002"
MODEL = ModelConfig(hidden=32, num_layers=2, num_heads=4, ffn_hidden=64, seq_length=16)


def test_compare_snapshots_reports_missing_shape_and_values():
    """The runtime's per-rank check is the comparison engine on tensors, bitwise."""
    want = {"model.a": torch.zeros(4), "model.b": torch.zeros(2), "model.c": torch.zeros(3),
            "optimizer.x": torch.ones(1), "model.z": torch.zeros(2)}
    got = {"model.a": torch.zeros(4), "model.b": torch.zeros(3), "model.d": torch.zeros(1),
           "optimizer.x": torch.full((1,), 2.0), "model.z": torch.tensor([0.0, -0.0])}
    s = compare_snapshots(want, got, is_model_key)
    assert not s.ok and s.keys == 5
    assert [(d.key, d.code) for d in s.differences] == [("model.b", "shape"), ("model.c", "only_in_a"),
                                                        ("model.d", "only_in_b"), ("model.z", "values")]
    assert (s.differences[-1].first_index, s.differences[-1].max_abs_diff) == ((1,), 0.0)  # -0.0 is not 0.0
    s = compare_snapshots(want, got, lambda k: k.startswith("optimizer."))
    assert (s.differing, s.max_abs_diff, s.differences[0].key) == (1, 1.0, "optimizer.x")
    assert json.loads(json.dumps(s.to_dict()))["diffs"][0]["code"] == "values"  # crosses the rank boundary as JSON


def _layout(par: ParallelConfig, bucket_size: int, model: ModelConfig = MODEL) -> tuple:
    groups = fake_groups(par, 0)
    bufs = build_buffers(GPTModel(model, par, groups), groups, bucket_size)
    return buffer_layout(SimpleNamespace(buffers=bufs), groups)


@pytest.mark.parametrize("bucket_size", [1, 700, 3000, 5000, 10**8])
@pytest.mark.parametrize("par", [ParallelConfig(cp=2, gtp_remat=2, dp=2, fold_cp=True), ParallelConfig(tp=2, dp=2)])
def test_bucket_size_recovered_from_layout(par: ParallelConfig, bucket_size: int):
    """Old manifests lack bucket_size: the derived one must rebuild exactly the same buckets."""
    layout = _layout(par, bucket_size)
    derived = derive_bucket_size(layout, DEFAULT_BUCKET_SIZE)
    assert _layout(par, derived) == layout


def test_config_from_fixture_manifest_and_refusals():
    raw = json.loads((FIXTURE / "gtp_manifest.json").read_text())
    manifest = parse_manifest(raw, "fixture", strict=True)
    cfg = config_from_manifest(manifest)
    assert cfg.par == ParallelConfig(cp=2, gtp_remat=2, dp=2, fold_cp=True)
    assert cfg.model.vocab_size == 128 and cfg.param_dtype == torch.float32
    groups = fake_groups(cfg.par, 0)
    bufs = build_buffers(GPTModel(cfg.model, cfg.par, groups), groups, cfg.bucket_size)
    assert buffer_layout(SimpleNamespace(buffers=bufs), groups) == manifest.buffers
    assert config_from_manifest(manifest, dp=1).par.dp == 1
    no_size = json.loads(json.dumps(raw))
    del no_size["bucket_size"]
    derived = config_from_manifest(parse_manifest(no_size, "x")).bucket_size
    assert _layout(cfg.par, derived, cfg.model) == manifest.buffers
    for edit, message in [(("optimizer", "momentum", 0.9), "field 'momentum', unknown to this version"),
                          (("optimizer", "type", "sgd"), "type 'sgd', unknown to this version")]:
        bad = json.loads(json.dumps(raw))
        bad[edit[0]][edit[1]] = edit[2]
        with pytest.raises(ConfigError, match=message):
            config_from_manifest(parse_manifest(bad, "x"))
