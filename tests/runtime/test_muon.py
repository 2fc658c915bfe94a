"""Muon's pieces without processes: Newton-Schulz, owner balance, who holds what, the manifest.

Distributed parity (8 gloo ranks against the fp32 reference) is in ``test_parity.py`` (the
``muon-*`` cases of ``launcher_cases.PARITY``); checkpoints in ``tests/runtime/test_muon_checkpoint.py``.
"""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from fake_groups import fake_groups
from hypothesis import given, settings
from hypothesis import strategies as st

from gtp_format.layout.config import ModelConfig, ParallelConfig
from gtp_format.manifest import OptimizerInfo, format_version_for, parse_manifest
from gtp_runtime.buffers import build_buffers
from gtp_runtime.checkpoint.manifest import optimizer_info
from gtp_runtime.model import GPTModel
from gtp_runtime.muon import (
    MuonConfig,
    _ns_cost,
    assign_owners,
    held_pieces,
    muon_owned,
    newton_schulz,
    shape_scale,
)
from gtp_runtime.optimizer import AdamConfig
from gtp_runtime.reference import param_names, param_shape
from gtp_runtime.reference_muon import reference_newton_schulz


@pytest.mark.parametrize("shape", [(64, 64), (192, 64), (64, 160), (7, 3)])
def test_newton_schulz_pushes_singular_values_near_one(shape):
    """Five quintic steps leave every singular value in about [0.6, 1.2] (the quintic's band, not
    exactly 1) for any scale, when no singular value is below ~1/500 of the Frobenius norm (each
    step multiplies a small one by at most 3.4445: 3.4445**5 = 487)."""
    g = torch.Generator().manual_seed(0)
    k = min(shape)
    q1 = torch.linalg.qr(torch.randn(shape[0], k, generator=g))[0]
    q2 = torch.linalg.qr(torch.randn(shape[1], k, generator=g))[0]
    u = q1 @ torch.diag(torch.logspace(0, -1, k)) @ q2.t() * 37.0
    o = newton_schulz(u, 5)
    sv = torch.linalg.svdvals(o)
    assert o.shape == u.shape
    assert sv.min() > 0.55 and sv.max() < 1.25, sv
    # The same orthogonal directions as the exact polar factor U V^T.
    uu, _, vh = torch.linalg.svd(u, full_matrices=False)
    cos = (o * (uu @ vh)).sum() / (o.norm() * (uu @ vh).norm())
    assert cos > 0.97


@pytest.mark.parametrize("shape", [(48, 48), (240, 48), (48, 80)])
def test_reference_newton_schulz_agrees_with_the_runtimes(shape):
    """Written in two orientations; equal up to fp32 rounding."""
    u = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    a, b = newton_schulz(u, 5), reference_newton_schulz(u, 5)
    assert (a - b).abs().max() <= 1e-5 * a.abs().max()
    assert not torch.equal(newton_schulz(u, 4), a)  # the step count matters


def test_shape_scale():
    assert shape_scale((192, 64)) == pytest.approx(3 ** 0.5)
    assert shape_scale((64, 192)) == 1.0


def test_muon_owns_the_linears_only():
    cfg = ModelConfig(num_experts=2, num_layers=2)
    owned = {n for n in param_names(cfg) if muon_owned(n)}
    assert owned == {n for n in param_names(cfg) if n.rsplit(".", 2)[-2].startswith("linear_")}
    assert all(len(param_shape(cfg, n)) == 2 for n in owned)
    assert "decoder.layers.1.mlp.experts.local_experts.1.linear_fc2.weight" in owned
    for n in ("output_layer.weight", "embedding.word_embeddings.weight", "decoder.layers.1.mlp.router.weight",
              "decoder.final_layernorm.weight"):
        assert not muon_owned(n)


def _brute_force_makespan(costs: list[int], world: int) -> int:
    return min(max(sum(c for c, r in zip(costs, rs) if r == k) for k in range(world))
               for rs in itertools.product(range(world), repeat=len(costs)))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 12), st.integers(1, 12)), min_size=1, max_size=7), st.integers(1, 3))
def test_owner_assignment_is_within_four_thirds_of_the_best(shapes, world):
    """LPT against brute force: every matrix gets one owner in range, and the busiest rank's NS
    work is at most 4/3 of the best possible assignment's."""
    owners = assign_owners(shapes, world)
    assert len(owners) == len(shapes) and all(0 <= o < world for o in owners)
    costs = [_ns_cost(s) for s in shapes]
    got = max(sum(c for c, o in zip(costs, owners) if o == k) for k in range(world))
    assert 3 * got <= 4 * _brute_force_makespan(costs, world)


TOPOLOGIES = {
    "cp2-g2-dp2-fold": (ParallelConfig(cp=2, gtp_remat=2, dp=2, fold_cp=True), ModelConfig(hidden=48, ffn_hidden=80)),
    "cp2-g2-dp2-nofold": (ParallelConfig(cp=2, gtp_remat=2, dp=2), ModelConfig(hidden=48, ffn_hidden=80)),
    "tp2-cp2-dp2-fold-moe": (ParallelConfig(tp=2, cp=2, dp=2, fold_cp=True, expert_gtp_remat=2),
                             ModelConfig(num_heads=2, num_experts=2, gtp_align=8)),
}


@pytest.mark.parametrize("name", TOPOLOGIES)
def test_every_matrix_element_is_held_exactly_once(name):
    """Over all ranks, the ZeRO-1 slices hold each element of each Muon matrix once: the owner's
    assembly is complete, and no element is updated twice (or by two owners)."""
    par, model = TOPOLOGIES[name]
    names = sorted(n for n in param_names(model) if muon_owned(n))
    seen = {n: torch.zeros(param_shape(model, n), dtype=torch.int64).flatten() for n in names}
    for rank in range(par.world_size):
        groups = fake_groups(par, rank)
        bufs = build_buffers(GPTModel(model, par, groups), groups, 3000)
        for pc in held_pieces(bufs, names):
            assert pc.index.numel() == pc.hi - pc.lo
            seen[names[pc.matrix]].index_add_(0, pc.index, torch.ones_like(pc.index))
    for n, count in seen.items():
        assert torch.equal(count, torch.ones_like(count)), n


def test_manifest_records_owners_and_old_manifests_still_parse():
    par, model = TOPOLOGIES["cp2-g2-dp2-fold"]
    groups = fake_groups(par, 0)
    bufs = build_buffers(GPTModel(model, par, groups), groups, 3000)
    owners = {s.name: "muon" if muon_owned(s.name) else "adamw" for b in bufs for s in b.slots}

    class Opt:
        def param_optimizers(self):
            return owners

    info = optimizer_info(Opt(), AdamConfig(), MuonConfig(), step=3)
    assert info.type == "muon" and info.hyper["muon_lr"] == 0.02 and info.hyper["muon_ns_steps"] == 5
    assert format_version_for(info) == 2
    adam = optimizer_info(object(), AdamConfig(), MuonConfig(), step=3)
    assert (adam.type, adam.param_optimizers, format_version_for(adam)) == ("adamw", {}, 1)
    raw = {"format": "gtp-ckpt", "format_version": 2, "iteration": 3, "optimizer": info.to_json()}
    parsed = parse_manifest(json.loads(json.dumps(raw)), "m", strict=False).optimizer
    assert parsed == info
    assert parsed.owner("output_layer.weight") == "adamw"
    assert parsed.owner("decoder.layers.0.mlp.linear_fc1.weight") == "muon"
    # Version 1 (no owners): every param is AdamW's.
    old = parse_manifest({**raw, "format_version": 1, "optimizer": adam.to_json()}, "m", strict=False).optimizer
    assert old.param_optimizers == {} and old.owner("decoder.layers.0.mlp.linear_fc1.weight") == "adamw"
    bad = {**raw, "optimizer": {**info.to_json(), "param_optimizers": {"x": "sgd"}}}
    m = parse_manifest(bad, "m", strict=False)
    assert m.optimizer is None and any("optimizer.param_optimizers['x']" in p and "sgd" in p for p in m.problems)


def test_optimizer_info_round_trips_through_to_json():
    info = OptimizerInfo("muon", 2, {"lr": 1e-3}, {"a.linear_fc1.weight": "muon", "b.weight": "adamw"})
    assert parse_manifest({"format": "gtp-ckpt", "format_version": 2, "iteration": 0,
                           "optimizer": info.to_json()}, "m", strict=False).optimizer == info
