"""ShardSpec math and the buffer layout, checked without any process group."""

from __future__ import annotations

import math

import pytest
import torch
from fake_groups import fake_groups
from hypothesis import given, settings
from hypothesis import strategies as st

from gtp_format.layout import topology as topo
from gtp_format.layout.config import ModelConfig, ParallelConfig
from gtp_format.layout.shard import ShardSpec
from gtp_runtime.buffers import BUCKET_PAD, PARAM_ALIGN, build_buffers
from gtp_runtime.init import full_init
from gtp_runtime.model import GPTModel, is_gtp_dense
from gtp_runtime.sharding import drop_padding, take_shard

# -- ShardSpec -----------------------------------------------------------------------------------


@st.composite
def weights(draw):
    """A full weight, its TP mode and sizes; returns (full, spec factory args)."""
    mode = draw(st.sampled_from(["column", "row", "vocab", None]))
    tp = draw(st.integers(1, 3)) if mode else 1
    rows, cols = draw(st.integers(1, 40)), draw(st.integers(1, 5))
    sharded = mode != "vocab" and draw(st.booleans())
    group = draw(st.integers(1, 4)) if sharded else 1
    align = draw(st.sampled_from([1, 2, 4, 16]))
    if mode in ("column", "vocab"):
        full_shape = (tp * rows, cols)
    elif mode == "row":
        full_shape = (rows, tp * cols)
    else:
        full_shape = (rows, cols) if draw(st.booleans()) else (rows,)
    n = math.prod(full_shape)
    full = (torch.arange(n, dtype=torch.float64) + 1).reshape(full_shape)  # no element is zero
    return full, mode, tp, ("weight" if sharded else None), group, align


def spec_of(full, mode, tp, kind, group, align, tp_rank, shard_rank) -> ShardSpec:
    return ShardSpec(tuple(full.shape), mode, tp, tp_rank, kind, group, shard_rank, align)


def tp_local(full, mode, tp, tp_rank) -> torch.Tensor:
    if mode in ("column", "vocab"):
        n = full.shape[0] // tp
        return full[tp_rank * n : (tp_rank + 1) * n]
    if mode == "row":
        n = full.shape[1] // tp
        return full[:, tp_rank * n : (tp_rank + 1) * n]
    return full


@settings(max_examples=300, deadline=None)
@given(weights())
def test_padding_is_minimal_multiple_of_align_times_group(w):
    full, mode, tp, kind, group, align = w
    spec = spec_of(*w, 0, 0)
    rows = spec.tp_local_shape[0]
    if kind is None:
        assert spec.padded_rows == rows and spec.shard_rows == rows
    else:
        assert spec.padded_rows % (align * group) == 0
        assert rows <= spec.padded_rows < rows + align * group
        assert spec.shard_rows * group == spec.padded_rows


@settings(max_examples=300, deadline=None)
@given(weights())
def test_shards_tile_the_padded_tp_local_tensor(w):
    full, mode, tp, kind, group, align = w
    for t in range(tp):
        local = tp_local(full, mode, tp, t)
        specs = [spec_of(*w, t, r) for r in range(group)]
        pieces = [take_shard(s, full) for s in specs]
        assert all(tuple(p.shape) == specs[0].local_shape for p in pieces)
        padded = torch.cat(pieces)
        assert padded.shape[0] == specs[0].padded_rows
        # Trimmed, the concatenation is the TP-local weight; the tail is zero padding.
        assert torch.equal(drop_padding(specs[0], padded), local)
        assert not padded[local.shape[0] :].any()
        # Distinct slices: each shard's real rows are its own range, and together they count every row once.
        assert sum(s.valid_rows for s in specs) == local.shape[0]
        for r, (s, p) in enumerate(zip(specs, pieces, strict=True)):
            lo = r * s.shard_rows
            assert torch.equal(p[: s.valid_rows], local[lo : lo + s.valid_rows])
            assert not p[s.valid_rows :].any()


@settings(max_examples=300, deadline=None)
@given(weights())
def test_global_offsets_cover_global_shape_exactly_once(w):
    """Placing every (tp_rank, shard_rank) piece at its global offset fills global_shape with no gap
    and no overlap, and the result minus padding is the full weight."""
    full, mode, tp, kind, group, align = w
    specs = [spec_of(*w, t, r) for t in range(tp) for r in range(group)]
    shape = specs[0].global_shape
    assert all(s.global_shape == shape for s in specs)
    glob = torch.zeros(shape, dtype=full.dtype)
    count = torch.zeros(shape, dtype=torch.int64)
    for s in specs:
        idx = tuple(slice(o, o + n) for o, n in zip(s.global_offset, s.local_shape, strict=True))
        glob[idx] += take_shard(s, full)
        count[idx] += 1
    assert bool((count == 1).all())
    rows, padded = specs[0].tp_local_shape[0], specs[0].padded_rows
    if mode in ("column", "vocab"):
        assert shape[0] == tp * padded
        trimmed = torch.cat([glob[t * padded : t * padded + rows] for t in range(tp)])
    else:
        assert shape[0] == padded
        trimmed = glob[:rows]
    assert torch.equal(trimmed, full)
    if mode == "row":
        assert shape[1] == full.shape[1]


def test_known_spec():
    """linear_qkv of hidden 48 over a folded group of 4 at align 16: 144 rows pad to 192, 48 each."""
    s = ShardSpec((144, 48), "column", 1, 0, "weight", 4, 3, 16)
    assert (s.padded_rows, s.shard_rows, s.valid_rows, s.local_shape) == (192, 48, 0, (48, 48))
    assert s.global_offset == (144, 0) and s.global_shape == (192, 48)
    s = ShardSpec((64, 128), "row", 2, 1, "weight", 2, 1, 16)
    assert s.tp_local_shape == (64, 64) and s.global_offset == (32, 64) and s.global_shape == (64, 128)


# -- buffers over fake per-rank groups ------------------------------------------------------------

MODEL = dict(vocab_size=64, hidden=24, num_heads=2, ffn_hidden=40, num_layers=2, seq_length=12)


@st.composite
def setups(draw):
    tp, cp, g, dp = draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 2, 3])), draw(
        st.sampled_from([1, 2])), draw(st.sampled_from([1, 2]))
    if tp * cp * g * dp > 8:
        dp = 1
    per_tp = cp * g * dp
    experts = draw(st.sampled_from([0, 2]))
    eg = draw(st.sampled_from([d for d in range(1, per_tp + 1) if per_tp % d == 0])) if experts else 1
    par = ParallelConfig(tp=tp, cp=cp, gtp_remat=g, dp=dp, fold_cp=cp > 1 and draw(st.booleans()),
                         expert_gtp_remat=eg)
    model = ModelConfig(**MODEL, num_experts=experts, gtp_align=draw(st.sampled_from([1, 4, 16])))
    return par, model, draw(st.sampled_from([1, 700, 5000, 10**8]))


def build_world(par: ParallelConfig, model: ModelConfig, bucket_size: int):
    out = []
    for rank in range(par.world_size):
        groups = fake_groups(par, rank)
        m = GPTModel(model, par, groups)
        out.append((groups, m, build_buffers(m, groups, bucket_size)))
    return out


@settings(max_examples=25, deadline=None)
@given(setups())
def test_buffer_layout(setup):
    par, model, bucket_size = setup
    for groups, m, bufs in build_world(par, model, bucket_size):
        assert sum(len(b.slots) for b in bufs) == len(list(m.parameters()))
        for buf in bufs:
            k = buf.key
            dense_gtp = [is_gtp_dense(s.param) for s in buf.slots]
            assert k.excludes_cp == (par.fold_cp and all(dense_gtp))
            assert all(s.param.is_expert == k.is_expert for s in buf.slots)
            want = topo.EXPERT_DP if k.is_expert else (topo.DP if k.excludes_cp else topo.DP_CP)
            assert buf.dp_kind == want and buf.dp_group is groups[want]
            assert buf.divisor == buf.dp_group.size == (
                par.expert_dp if k.is_expert else par.dp if k.excludes_cp else par.dp * par.cp)
            # Buckets are contiguous, cover the buffer, and split evenly over the DP group.
            assert buf.buckets[0].start == 0 and buf.buckets[-1].end == buf.numel
            for a, b in zip(buf.buckets, buf.buckets[1:]):
                assert a.end == b.start
            for b in buf.buckets:
                assert b.numel % math.lcm(buf.dp_group.size, BUCKET_PAD) == 0
                assert b.numel_unpadded <= b.numel
                assert buf.local_numel(b) * buf.dp_group.size == b.numel
                lo, hi = buf.owned_range(b)
                assert lo == b.start + buf.dp_group.rank * buf.local_numel(b) and hi <= b.end
            # Slots: aligned, disjoint, inside their bucket's unpadded part, in reverse model order.
            prev_end = 0
            for s in buf.slots:
                b = buf.buckets[s.bucket]
                assert s.start % PARAM_ALIGN == 0 and s.start >= prev_end
                assert b.start <= s.start and s.end <= b.start + b.numel_unpadded
                assert s.end - s.start == s.param.numel() and s.valid_numel <= s.param.numel()
                prev_end = s.end
                # param and main_grad are views into the flat buffers, holding the initial shard.
                assert s.param.data_ptr() == buf.param_data[s.start :].data_ptr()
                assert s.param.main_grad.data_ptr() == buf.grad_data[s.start :].data_ptr()
                full = full_init(s.name, s.param.spec.full_shape, model.seed, model.num_layers)
                want_val = take_shard(s.param.spec, full)
                assert torch.equal(s.param.detach(), want_val)
            names = [n for n, p in m.named_parameters() if any(s.param is p for s in buf.slots)]
            assert [s.name for s in buf.slots] == names[::-1]


def _layout(buf):
    return (buf.key, buf.numel, [(b.start, b.end) for b in buf.buckets], [(s.name, s.start) for s in buf.slots])


@settings(max_examples=25, deadline=None)
@given(setups())
def test_dp_group_members_agree_on_layout(setup):
    """A bucket reduce-scatter needs the same layout on every member of the buffer's DP group."""
    par, model, bucket_size = setup
    world = build_world(par, model, bucket_size)
    for _, _, bufs in world:
        for i, buf in enumerate(bufs):
            for peer in buf.dp_group.ranks:
                assert _layout(world[peer][2][i]) == _layout(buf)


@settings(max_examples=25, deadline=None)
@given(setups())
def test_every_gradient_element_is_counted_exactly_once(setup):
    """The exactly-once rule: over all ranks, the counted ranges of the owned slices hit every real
    element of every parameter once and no padding element ever."""
    par, model, bucket_size = setup
    world = build_world(par, model, bucket_size)
    counts: dict[str, torch.Tensor] = {}
    for _, _, bufs in world:
        for buf in bufs:
            for b in buf.buckets:
                lo, hi = buf.owned_range(b)
                mask = torch.zeros(hi - lo, dtype=torch.bool)
                for a, e in buf.count_ranges(b):
                    assert 0 <= a < e <= hi - lo
                    mask[a:e] = True
                for s in b.slots:
                    spec = s.param.spec
                    local = torch.zeros(s.param.numel(), dtype=torch.int64)
                    a, e = max(lo, s.start), min(hi, s.end)
                    if a < e:
                        local[a - s.start : e - s.start] = mask[a - lo : e - lo].long()
                    glob = counts.setdefault(s.name, torch.zeros(spec.global_shape, dtype=torch.int64))
                    idx = tuple(slice(o, o + n) for o, n in zip(spec.global_offset, spec.local_shape, strict=True))
                    glob[idx] += local.view(spec.local_shape)
    _, m0, _ = world[0]
    assert set(counts) == {n for n, _ in m0.named_parameters()}
    for name, p in m0.named_parameters():
        spec = p.spec
        want = torch.zeros(spec.global_shape, dtype=torch.int64)
        rows, padded = spec.tp_local_shape[0], spec.padded_rows
        if spec.tp_mode in ("column", "vocab"):
            for t in range(spec.tp_size):
                want[t * padded : t * padded + rows] = 1
        else:
            want[:rows] = 1
        assert torch.equal(counts[name], want), name


@pytest.mark.parametrize("fold", [False, True])
def test_folded_shards_differ_across_cp_peers(fold):
    """Folding gives CP peers different dense shards (the reason their optimizer keys must differ)."""
    par = ParallelConfig(cp=2, gtp_remat=2, dp=2, fold_cp=fold)
    model = ModelConfig(**MODEL)
    world = build_world(par, model, 10**8)
    p0 = dict(world[0][1].named_parameters())["decoder.layers.0.self_attention.linear_qkv.weight"]
    p1 = dict(world[1][1].named_parameters())["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert torch.equal(p0, p1) != fold
    assert p0.shape[0] == p0.spec.padded_rows // (4 if fold else 2)
