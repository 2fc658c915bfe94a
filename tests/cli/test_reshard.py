"""``ckpt reshard`` on real runtime checkpoints: A -> B -> A is bit-identical on every tensor, the
per-parameter state of A and B is bit-identical, and the offline per-parameter view equals what
the live optimizer holds (brute force, on gloo ranks)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from reshard_cases import DENSE, MOE, live_state, make_source

from ckpt_tool.copying import WEIGHT_STATE
from ckpt_tool.copying.source import Source, open_source
from ckpt_tool.reshard.engine import reshard
from gtp_format.check.verify import verify
from gtp_format.layout.config import ParallelConfig as P
from gtp_format.names import STATES
from gtp_format.reader.boxes import BoxReader
from gtp_format.reader.checkpoint import open_checkpoint
from gtp_format.views.records import full_box

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "gtp"
FOLD8 = P(cp=2, gtp_remat=2, dp=2, fold_cp=True)

# (id, source: a fixture name or (par, model, bf16, layout) to train, target topology, target layout)
CASES = [
    ("fold-to-unfold", "fold_cp2_g2_dp2", P(cp=2, gtp_remat=2, dp=2), None),
    ("dp2-to-dp1", "fold_cp2_g2_dp2_st", P(cp=2, gtp_remat=2, fold_cp=True), "torch_dist"),
    ("cp2-to-cp4", (P(cp=2, dp=2, fold_cp=True), DENSE, False, "torch_dist"), P(cp=4, fold_cp=True), None),
    ("gtp2-to-gtp1", (P(gtp_remat=2, dp=2), DENSE, False, "torch_dist"), P(dp=4), None),
    ("tp1-to-tp2", (P(gtp_remat=2), DENSE, False, "torch_dist"), P(tp=2), "safetensors"),
    ("moe", (P(tp=2, cp=2, fold_cp=True), MOE, False, "torch_dist"),
     P(cp=2, gtp_remat=2, fold_cp=True, expert_gtp_remat=2), None),
    ("bf16", (P(cp=2, gtp_remat=2, fold_cp=True), DENSE, True, "safetensors"), P(tp=2, cp=2, dp=2), "torch_dist"),
]


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = {}
    for name, src, _, _ in CASES:
        if isinstance(src, str):
            out[name] = FIXTURES / src
        else:
            par, model, bf16, layout = src
            out[name] = make_source(tmp_path_factory.mktemp(name), par, model, bf16, layout)
    return out


def all_tensors(path: Path) -> dict[str, np.ndarray]:
    ckpt = open_checkpoint(path)
    reader = BoxReader(ckpt)
    return {k: reader.read_box(k, (0,) * len(e.shape), e.shape) for k, e in ckpt.entries.items()
            if e.shape is not None}


def per_param(src: Source) -> dict[tuple[str, str], np.ndarray]:
    out = {}
    for name, view in src.views.items():
        for state in (*STATES, WEIGHT_STATE):
            out[(name, state)] = src.read_full_box(view, state, (0,) * len(view.full_shape), view.full_shape)
    return out


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_a_to_b_to_a_is_bit_identical(case: tuple, sources: dict[str, Path], tmp_path: Path) -> None:
    name, _, target, layout = case
    a = sources[name]
    b, back = tmp_path / "b", tmp_path / "a2"
    reshard(a, b, target, layout, workers=2)
    result = verify(open_checkpoint(b), data=True)
    assert result.ok, [p for p in result.problems if p.severity == "error"][:3]
    src_a, src_b = open_source(a), open_source(b)
    assert src_b.manifest.topology == target
    pa, pb = per_param(src_a), per_param(src_b)
    assert pa.keys() == pb.keys()
    bad = [k for k in pa if not same_bits(pa[k], pb[k])]
    assert not bad, bad[:5]
    assert src_a.manifest.topology is not None
    reshard(b, back, src_a.manifest.topology, src_a.manifest.layout, max_memory=1 << 24, workers=1)
    ta, tb = all_tensors(a), all_tensors(back)
    assert ta.keys() == tb.keys()
    differ = [k for k in ta if not same_bits(ta[k], tb[k])]
    assert not differ, differ[:5]


def _check_view_against_live(path: Path, par: P, model, bf16: bool) -> None:  # noqa: ANN001
    src = open_source(path)
    full = per_param(src)
    live = live_state(path, par, model, bf16, src.manifest.bucket_size or 0)
    assert {n for n, *_ in live} == set(src.views)
    for name, tp_rank, shard_rank, states in live:
        view = src.views[name]
        holder = next(h for h in view.holders if (h.spec.tp_rank, h.spec.shard_rank) == (tp_rank, shard_rank))
        off, size = full_box(holder.spec)
        box = tuple(slice(o, o + s) for o, s in zip(off, size))
        for state, value in states.items():
            want = full[(name, state)][box]
            assert want.tobytes() == np.ascontiguousarray(value).tobytes(), (name, state, tp_rank, shard_rank)
        assert math.prod(size) == states["param"].size


@pytest.mark.slow
def test_view_equals_live_optimizer_fold(sources: dict[str, Path]) -> None:
    _check_view_against_live(sources["fold-to-unfold"], FOLD8, open_source(sources["fold-to-unfold"]).manifest.model,
                             False)


@pytest.mark.slow
def test_view_equals_live_optimizer_moe_tp2(sources: dict[str, Path]) -> None:
    _check_view_against_live(sources["moe"], P(tp=2, cp=2, fold_cp=True), MOE, False)

