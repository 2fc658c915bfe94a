"""Rank generator: the worked example of docs/glossary.md ("rank order") and properties over small grids."""

from __future__ import annotations

import pytest
from fake_groups import fake_groups
from hypothesis import given, settings
from hypothesis import strategies as st

from gtp_format.layout import topology as topo
from gtp_format.layout.config import ParallelConfig
from gtp_format.layout.topology import Topology

# docs/glossary.md, "rank order": TP=1, CP=2, GTP_remat=2, DP=2 (8 ranks).
EXAMPLE = ParallelConfig(tp=1, cp=2, gtp_remat=2, dp=2, fold_cp=True)
EXAMPLE_TABLE = {
    topo.CP: [[0, 1], [2, 3], [4, 5], [6, 7]],
    topo.GTP: [[0, 2], [1, 3], [4, 6], [5, 7]],
    topo.FOLDED: [[0, 1, 2, 3], [4, 5, 6, 7]],
    topo.DP: [[0, 4], [1, 5], [2, 6], [3, 7]],
    topo.DP_CP: [[0, 1, 4, 5], [2, 3, 6, 7]],
    topo.MP: [[0, 2], [1, 3], [4, 6], [5, 7]],
}


@pytest.mark.parametrize("kind", sorted(EXAMPLE_TABLE))
def test_worked_example_groups(kind):
    assert Topology(EXAMPLE).groups(kind) == EXAMPLE_TABLE[kind]


def test_worked_example_weight_group_follows_fold():
    assert Topology(EXAMPLE).groups(topo.WEIGHT) == EXAMPLE_TABLE[topo.FOLDED]
    unfolded = ParallelConfig(tp=1, cp=2, gtp_remat=2, dp=2, fold_cp=False)
    assert Topology(unfolded).groups(topo.WEIGHT) == EXAMPLE_TABLE[topo.GTP]


def test_worked_example_folded_rank():
    t = Topology(EXAMPLE)
    # folded_rank = cp + CP*g: rank 0 (c0,g0)=0, 1 (c1,g0)=1, 2 (c0,g1)=2, 3 (c1,g1)=3, then again for dp 1.
    assert [t.folded_rank(r) for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    # The aliasing pair of docs/checkpoint-format.md (Keys): CP peers 0 and 1 share model-parallel rank 0.
    assert t.model_parallel_rank(0) == t.model_parallel_rank(1) == 0
    assert t.coords(0).cp != t.coords(1).cp


def test_coords_rejects_out_of_range():
    t = Topology(EXAMPLE)
    with pytest.raises(ValueError, match="outside world"):
        t.coords(8)
    with pytest.raises(ValueError, match="outside world"):
        t.coords(-1)


def test_unknown_group_kind():
    with pytest.raises(KeyError, match="unknown group kind"):
        Topology(EXAMPLE).groups("pp")


@st.composite
def parallel_configs(draw):
    tp, cp, g, dp = (draw(st.integers(1, 3)) for _ in range(4))
    per_tp = cp * g * dp
    eg = draw(st.sampled_from([d for d in range(1, per_tp + 1) if per_tp % d == 0]))
    fold = draw(st.booleans()) and cp > 1
    return ParallelConfig(tp=tp, cp=cp, gtp_remat=g, dp=dp, fold_cp=fold, expert_gtp_remat=eg)


GROUP_SIZES = {
    topo.CP: lambda p: p.cp,
    topo.GTP: lambda p: p.gtp_remat,
    topo.FOLDED: lambda p: p.cp * p.gtp_remat,
    topo.WEIGHT: lambda p: p.weight_group_size,
    topo.DP: lambda p: p.dp,
    topo.DP_CP: lambda p: p.dp * p.cp,
    topo.MP: lambda p: p.tp * p.gtp_remat,
    topo.TP: lambda p: p.tp,
    topo.REPLICATED: lambda p: p.cp * p.gtp_remat * p.dp,
    topo.EXPERT_GTP: lambda p: p.expert_gtp_remat,
    topo.EXPERT_DP: lambda p: p.expert_dp,
    topo.WORLD: lambda p: p.world_size,
}

# Which coordinates every member of a group shares (the axes the group does not span).
SHARED_COORDS = {
    topo.CP: ("tp", "gtp", "dp"),
    topo.GTP: ("tp", "cp", "dp"),
    topo.FOLDED: ("tp", "dp"),
    topo.DP: ("tp", "cp", "gtp"),
    topo.DP_CP: ("tp", "gtp"),
    topo.MP: ("cp", "dp"),
    topo.TP: ("cp", "gtp", "dp"),
    topo.REPLICATED: ("tp",),
    topo.EXPERT_GTP: ("tp", "expert_dp"),
    topo.EXPERT_DP: ("tp", "expert_gtp"),
}


@settings(max_examples=150, deadline=None)
@given(parallel_configs())
def test_every_group_kind_partitions_the_world(par):
    t = Topology(par)
    for kind, size in GROUP_SIZES.items():
        groups = t.groups(kind)
        flat = [r for g in groups for r in g]
        assert sorted(flat) == list(range(par.world_size)), kind
        assert all(len(g) == size(par) for g in groups), kind
        assert all(g == sorted(g) for g in groups), kind


@settings(max_examples=150, deadline=None)
@given(parallel_configs())
def test_coords_round_trip(par):
    t = Topology(par)
    seen = set()
    for rank in range(par.world_size):
        c = t.coords(rank)
        assert 0 <= c.tp < par.tp and 0 <= c.cp < par.cp and 0 <= c.gtp < par.gtp_remat and 0 <= c.dp < par.dp
        assert t.rank_of(c.tp, c.cp, c.gtp, c.dp) == rank
        assert rank == c.tp + par.tp * (c.cp + par.cp * (c.gtp + par.gtp_remat * c.dp))
        seen.add((c.tp, c.cp, c.gtp, c.dp))
    assert len(seen) == par.world_size


@settings(max_examples=150, deadline=None)
@given(parallel_configs())
def test_group_members_agree_with_coordinates(par):
    t = Topology(par)
    for kind, shared in SHARED_COORDS.items():
        for members in t.groups(kind):
            cs = [t.coords(r) for r in members]
            for axis in shared:
                assert len({getattr(c, axis) for c in cs}) == 1, (kind, axis, members)


@settings(max_examples=150, deadline=None)
@given(parallel_configs())
def test_rank_inside_groups(par):
    """The index of a rank in its (sorted) group is the rank formula the runtime relies on."""
    t = Topology(par)
    for rank in range(par.world_size):
        c = t.coords(rank)
        folded = t.group_of(topo.FOLDED, rank)
        assert t.folded_rank(rank) == c.cp + par.cp * c.gtp == folded.index(rank)
        assert t.weight_group_rank(rank) == t.group_of(topo.WEIGHT, rank).index(rank)
        assert t.weight_group_rank(rank) == (t.folded_rank(rank) if par.fold_cp else c.gtp)
        assert t.model_parallel_rank(rank) == c.tp + par.tp * c.gtp == t.group_of(topo.MP, rank).index(rank)
        assert t.group_of(topo.CP, rank).index(rank) == c.cp
        assert t.group_of(topo.GTP, rank).index(rank) == c.gtp
        assert t.group_of(topo.DP, rank).index(rank) == c.dp
        assert t.group_of(topo.DP_CP, rank).index(rank) == c.cp + par.cp * c.dp


@settings(max_examples=150, deadline=None)
@given(parallel_configs())
def test_model_parallel_rank_has_no_cp(par):
    """dp_group_idx (the model-parallel rank) is equal across CP peers: the root of the aliasing bug."""
    t = Topology(par)
    for members in t.groups(topo.CP):
        assert len({t.model_parallel_rank(r) for r in members}) == 1
        assert len({t.folded_rank(r) for r in members}) == len(members)


@settings(max_examples=150, deadline=None)
@given(parallel_configs())
def test_expert_grid_has_no_cp_axis(par):
    """Expert ranks are ``tp + TP*(eg + EG*edp)``: CP never enters, whatever the dense CP degree."""
    t = Topology(par)
    eg_n, edp_n = par.expert_gtp_remat, par.expert_dp
    assert par.tp * eg_n * edp_n == par.world_size
    for rank in range(par.world_size):
        c = t.coords(rank)
        assert 0 <= c.expert_gtp < eg_n and 0 <= c.expert_dp < edp_n
        assert t.expert_rank_of(c.tp, c.expert_gtp, c.expert_dp) == rank
        # The expert coordinates are a function of rank // tp alone (the dense cp/g/dp split is irrelevant).
        assert c.expert_gtp + eg_n * c.expert_dp == rank // par.tp
    assert t.groups(topo.EXPERT_GTP) == [
        [t.expert_rank_of(tp, e, d) for e in range(eg_n)] for d in range(edp_n) for tp in range(par.tp)
    ]
    assert t.groups(topo.EXPERT_DP) == [
        [t.expert_rank_of(tp, e, d) for d in range(edp_n)] for e in range(eg_n) for tp in range(par.tp)
    ]
    # The expert groups do not move when only the fold setting changes.
    flipped = ParallelConfig(tp=par.tp, cp=par.cp, gtp_remat=par.gtp_remat, dp=par.dp,
                             fold_cp=not par.fold_cp and par.cp > 1, expert_gtp_remat=eg_n)
    for kind in (topo.EXPERT_GTP, topo.EXPERT_DP):
        assert Topology(flipped).groups(kind) == t.groups(kind)


@settings(max_examples=60, deadline=None)
@given(parallel_configs())
def test_table_lists_the_documented_kinds(par):
    table = Topology(par).table()
    assert set(table) == {topo.CP, topo.GTP, topo.FOLDED, topo.DP, topo.DP_CP, topo.MP, topo.TP,
                          topo.EXPERT_GTP, topo.EXPERT_DP}
    for kind, groups in table.items():
        assert groups == Topology(par).groups(kind)


@settings(max_examples=40, deadline=None)
@given(parallel_configs())
def test_build_groups_matches_topology(par):
    """The runtime's per-rank Groups (communicators stubbed) hold exactly the topology's groups."""
    t = Topology(par)
    for rank in range(par.world_size):
        g = fake_groups(par, rank)
        for kind in (*topo.ALL_GROUP_KINDS, topo.WORLD, topo.WEIGHT):
            members = t.group_of(kind, rank)
            assert g[kind].ranks == members and g[kind].rank == members.index(rank), kind
        assert g[topo.WEIGHT] is g[topo.FOLDED if par.fold_cp else topo.GTP]
        assert g.coords == t.coords(rank)
