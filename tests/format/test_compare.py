"""The comparison engine against brute force: element by element in Python, key by key on whole tensors.

The brute force spells the rules out literally (bitwise: the element's bytes; tolerance: equal bits,
both NaN, or a finite ``|a - b| <= atol + rtol * |b|``), so the engine's shortcuts (bits first, chunk
pairs instead of whole tensors, index arithmetic across chunk offsets) are checked against them.
"""

from __future__ import annotations

import cmath
import json
import math
import subprocess
import sys
from fnmatch import fnmatchcase
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gtp_format.compare import BITWISE, EXACT, KeyFilter, Rule, TensorSource, compare
from gtp_format.compare.records import CHUNKS, DTYPE, ONLY_IN_A, ONLY_IN_B, SHAPE, VALUES, Tally
from gtp_format.compare.sources import tensor_entry
from gtp_format.compare.values import compare_values, unravel
from gtp_format.errors import FormatError
from gtp_format.model import Chunk, Entry

REPO = Path(__file__).resolve().parents[2]
FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
INTS = (torch.int64, torch.int32, torch.uint8, torch.bool)
COMPLEX = (torch.complex64,)
SPECIAL = (0.0, -0.0, 1.0, -1.5, 2.0, 1e-3, 3.25, float("nan"), float("inf"), float("-inf"))
BIG = 2**53  # float64 rounds 2**53 + 1 to 2**53: equal bits must decide, not float64 values


# -- brute force -------------------------------------------------------------------------------------


def _element_bytes(t: torch.Tensor) -> list[bytes]:
    flat = t.reshape(-1)
    if flat.is_complex():
        flat = torch.view_as_real(flat)
    raw = flat.contiguous().view(torch.uint8).reshape(t.numel(), -1) if t.numel() else torch.empty(0, 1)
    return [bytes(row.tolist()) for row in raw]


def _isnan(x: object) -> bool:
    return cmath.isnan(x) if isinstance(x, complex) else isinstance(x, float) and math.isnan(x)


def _dist(x: object, y: object) -> float:
    if isinstance(x, complex):
        return abs(x - y)
    if isinstance(x, float):
        return abs(x - float(y))
    return float(abs(int(x) - int(y)))  # integers: exact, then rounded once


def brute(a: torch.Tensor, b: torch.Tensor, rule: Rule) -> tuple[int, float | None, int | None]:
    ba, bb = _element_bytes(a), _element_bytes(b)
    va, vb = a.reshape(-1).tolist(), b.reshape(-1).tolist()
    differ = []
    for i, (x, y) in enumerate(zip(va, vb)):
        if ba[i] == bb[i]:
            continue
        if not rule.bitwise:
            if x == y or (_isnan(x) and _isnan(y)):
                continue
            err = _dist(x, y)
            if math.isfinite(err) and err <= rule.atol + rule.rtol * abs(y):
                continue
        differ.append(i)
    dists = [_dist(va[i], vb[i]) for i in differ]
    dists = [d for d in dists if math.isfinite(d)]
    return len(differ), (max(dists) if dists else None), (differ[0] if differ else None)


# -- generators --------------------------------------------------------------------------------------


def _nan_payload(t: torch.Tensor, i: int) -> None:
    """Give element ``i`` (a NaN after this) a different NaN payload than the default one."""
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    t.view(-1)[i] = float("nan")
    t.view(ints).view(-1)[i] += 1


@st.composite
def tensor_pairs(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor]:
    dtype = draw(st.sampled_from(FLOATS + INTS + COMPLEX))
    shape = tuple(draw(st.lists(st.integers(0, 4), min_size=0, max_size=3)))
    n = math.prod(shape)
    if dtype.is_floating_point or dtype.is_complex:
        pool = st.sampled_from(SPECIAL)
    elif dtype == torch.bool:
        pool = st.sampled_from((0, 1))
    elif dtype == torch.uint8:
        pool = st.integers(0, 255)
    elif dtype == torch.int64:
        pool = st.sampled_from((0, 1, -7, BIG, BIG + 1, -(2**63), 2**63 - 1))
    else:
        pool = st.integers(-(2**31), 2**31 - 1)
    values = draw(st.lists(pool, min_size=n, max_size=n))
    if dtype.is_complex:
        imag = draw(st.lists(pool, min_size=n, max_size=n))
        a = torch.complex(torch.tensor(values, dtype=torch.float32), torch.tensor(imag, dtype=torch.float32))
    else:
        a = torch.tensor(values, dtype=torch.float64 if dtype.is_floating_point else torch.int64).to(dtype)
    a = a.reshape(shape)
    b = a.clone()
    for i in draw(st.lists(st.integers(0, max(n - 1, 0)), max_size=4)) if n else []:
        op = draw(st.sampled_from(("replace", "nudge", "negate", "payload")))
        flat = b.view(-1)
        if op == "replace":
            flat[i] = torch.tensor(draw(pool)).to(dtype)
        elif op == "nudge" and not dtype == torch.bool:
            flat[i] += 1
        elif op == "negate" and dtype != torch.bool and dtype != torch.uint8:
            flat[i] = -flat[i]
        elif op == "payload" and dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
            _nan_payload(b, i)
    return a, b


rules = st.one_of(st.just(BITWISE), st.just(EXACT),
                  st.builds(Rule.tolerance, st.sampled_from((0.0, 1e-3, 0.5)), st.sampled_from((0.0, 1e-3, 1.0))))


@settings(max_examples=400, deadline=None)
@given(pair=tensor_pairs(), rule=rules)
def test_values_match_brute_force(pair: tuple[torch.Tensor, torch.Tensor], rule: Rule):
    a, b = pair
    if not rule.exact and a.dtype == torch.int64:
        a, b = a.clamp(-(2**40), 2**40), b.clamp(-(2**40), 2**40)  # with a tolerance, int64 is compared as float64
    got = compare_values(a, b, rule)
    want = brute(a, b, rule)
    assert (got.differing, got.first) == (want[0], want[2])
    assert got.max_abs_diff == (None if want[1] is None else pytest.approx(want[1], rel=1e-12))


def test_value_rules_on_the_cases_that_matter():
    z = torch.tensor([0.0, 1.0])
    neg = torch.tensor([-0.0, 1.0])
    assert compare_values(z, neg, EXACT).differing == 0
    assert compare_values(z, neg, BITWISE) == (1, 0.0, 0)
    big = torch.tensor([BIG], dtype=torch.int64)
    assert float(big) == float(big + 1)  # why equality is decided on the bits
    assert compare_values(big, big + 1, EXACT) == (1, 1.0, 0)
    nan_a, nan_b = torch.tensor([float("nan")]), torch.tensor([float("nan")])
    _nan_payload(nan_b, 0)
    assert compare_values(nan_a, nan_b, EXACT).differing == 0
    assert compare_values(nan_a, nan_b, BITWISE) == (1, None, 0)  # no finite distance between NaNs
    c = torch.tensor([1 + 2j, 3 + 4j])
    assert compare_values(c, c + torch.tensor([0, 1j]), EXACT) == (1, 1.0, 1)  # one complex element, one index
    with pytest.raises(ValueError, match="bitwise comparison has no tolerance"):
        Rule(bitwise=True, atol=1e-3)
    with pytest.raises(ValueError, match="equal shapes"):
        compare_values(z, torch.zeros(3), EXACT)


# -- the engine on chunked sides -------------------------------------------------------------------


class Chunked:
    """A side whose tensors are cut into the given boxes (chunk values are slices of the tensor)."""

    def __init__(self, tensors: dict[str, torch.Tensor], boxes: dict[str, list[tuple]], name: str) -> None:
        self.name, self.tensors = name, tensors
        self.entries = {}
        for k, t in tensors.items():
            e = tensor_entry(k, t)
            chunks = tuple(Chunk(i, off, size, None) for i, (off, size) in enumerate(boxes[k]))
            self.entries[k] = Entry(k, e.kind, e.shape, e.dtype, chunks)

    def chunk(self, entry: Entry, chunk: Chunk) -> torch.Tensor:
        index = tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))
        return self.tensors[entry.key][index]

    def whole(self, entry: Entry, max_bytes: int) -> torch.Tensor:
        return self.tensors[entry.key]


def _cuts(draw: st.DrawFn, n: int) -> list[tuple[int, int]]:
    inner = sorted(set(draw(st.lists(st.integers(1, max(n - 1, 1)), max_size=3)))) if n > 1 else []
    edges = [0, *inner, n]
    return [(lo, hi - lo) for lo, hi in zip(edges, edges[1:])]


def _boxes(draw: st.DrawFn, shape: tuple[int, int]) -> list[tuple]:
    return [((r0, c0), (rn, cn)) for r0, rn in _cuts(draw, shape[0]) for c0, cn in _cuts(draw, shape[1])]


@st.composite
def sides(draw: st.DrawFn) -> tuple[Chunked, Chunked, KeyFilter]:
    ta, tb, ba, bb = {}, {}, {}, {}
    for k in ("dec.a", "dec.b", "opt.x", "opt.y", "meta"):
        shape = (draw(st.integers(1, 6)), draw(st.integers(1, 5)))
        n = shape[0] * shape[1]
        a = torch.tensor(draw(st.lists(st.sampled_from(SPECIAL[:7] + (float("nan"),)), min_size=n, max_size=n)))
        a = a.reshape(shape)
        b = a.clone()
        for _ in range(draw(st.integers(0, 6))):
            i, j = draw(st.integers(0, shape[0] - 1)), draw(st.integers(0, shape[1] - 1))
            b[i, j] += draw(st.sampled_from((1.0, 0.5)))
        change = draw(st.sampled_from(("none", "none", "shape", "dtype", "only_a", "only_b")))
        if change == "shape":
            b = torch.cat([b, b[:1]])
        elif change == "dtype":
            b = b.double()
        if change != "only_b":
            ta[k], ba[k] = a, _boxes(draw, shape)
        if change != "only_a":
            tb[k] = b
            same = change == "none" and draw(st.integers(0, 3)) > 0  # mostly the chunk-pair path
            bb[k] = ba[k] if same else _boxes(draw, tuple(b.shape))
    select = KeyFilter.of(draw(st.lists(st.sampled_from(("dec.*", "opt.?", "*")), max_size=2)),
                          draw(st.lists(st.sampled_from(("*.b", "meta", "opt.*")), max_size=1)))
    return Chunked(ta, ba, "A"), Chunked(tb, bb, "B"), select


@settings(max_examples=200, deadline=None)
@given(s=sides(), rule=rules)
def test_engine_matches_brute_force_on_whole_tensors(s: tuple[Chunked, Chunked, KeyFilter], rule: Rule):
    a, b, select = s
    report = compare(a, b, rule, select=select, chunks=True)
    keys = sorted(k for k in a.tensors.keys() | b.tensors.keys()
                  if (not select.keys or any(fnmatchcase(k, g) for g in select.keys))
                  and not any(fnmatchcase(k, g) for g in select.ignore))
    assert [r.key for r in report] == keys
    for r in report:
        x, y = a.tensors.get(r.key), b.tensors.get(r.key)
        by_code = {d.code: d for d in r.differences}
        if x is None or y is None:
            assert set(by_code) == {ONLY_IN_B if x is None else ONLY_IN_A}
            continue
        if x.shape != y.shape or x.dtype != y.dtype:
            assert set(by_code) == {SHAPE if x.shape != y.shape else DTYPE}
            continue
        boxes_a, boxes_b = ([(c.offsets, c.sizes) for c in s.entries[r.key].chunks] for s in (a, b))
        assert (CHUNKS in by_code) == (sorted(boxes_a) != sorted(boxes_b))
        count, max_abs, first = brute(x, y, rule)
        if not count:
            assert VALUES not in by_code
            continue
        d = by_code[VALUES]
        assert (d.differing, d.numel) == (count, x.numel())
        assert d.first_index == unravel(first, tuple(x.shape))  # first in row-major order, whatever the chunks
        assert d.max_abs_diff == (None if max_abs is None else pytest.approx(max_abs))
    t = report.tally()
    assert t.differing == sum(d.differing for d in report.differences())


def test_keyfilter_ignore_wins_and_empty_selects_everything():
    f = KeyFilter.of(["decoder.*", "optimizer.*"], ["*.bias"])
    assert f("decoder.l0.weight") and f("optimizer.x") and not f("decoder.l0.bias") and not f("embedding.w")
    assert KeyFilter()("anything") and KeyFilter.of(None, ["x*"])("y") and not KeyFilter.of(None, ["x*"])("xy")
    assert not KeyFilter.of(["Decoder.*"])("decoder.w")  # case-sensitive, like the keys
    with pytest.raises(FormatError, match="--keys 'nope.\\*' matches no key of A") as e:
        KeyFilter.of(["nope.*"]).require_match(["decoder.w"], where="A")
    assert e.value.exit_code == 2
    KeyFilter().require_match([], where="A")  # everything: never an error


def test_tally_and_records_are_json_ready():
    report = compare(TensorSource({"k": torch.zeros(2, 3), "gone": torch.zeros(1)}),
                     TensorSource({"k": torch.tensor([[0.0, 0, 0], [0, 5, 0]])}), EXACT)
    t = report.tally()
    assert (t.keys, t.elements, t.differing, t.max_abs_diff) == (2, 7, 2, 5.0)
    doc = json.loads(json.dumps(t.to_dict()))
    assert [(d["code"], d["key"], d["first_index"]) for d in doc["diffs"]] == [("only_in_a", "gone", None),
                                                                              ("values", "k", [1, 1])]
    assert report.only_in_a == ["gone"] and [r.key for r in report.common] == ["k"]
    assert "first at index [1, 1]" in report.differences([VALUES])[0].detail
    assert isinstance(Tally().to_dict()["diffs"], list)


METADATA_ONLY = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is blocked in this test")
sys.meta_path.insert(0, Block())
from gtp_format.compare import CheckpointSource, compare
from gtp_format.reader.checkpoint import open_checkpoint
a = CheckpointSource(open_checkpoint("fixtures/gtp/fold_cp2_g2_dp2"))
b = CheckpointSource(open_checkpoint("fixtures/gtp/fold_cp2_g2_dp2_st"))
same = compare(a, a, values=False, chunks=True)
other = compare(a, b, values=False, chunks=True)
assert "torch" not in sys.modules
print(len(same.results), same.ok, sorted({d.code for d in other.differences()}))
"""


def test_metadata_comparison_runs_without_torch():
    proc = subprocess.run([sys.executable, "-c", METADATA_ONLY], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    count, ok, codes = proc.stdout.split(maxsplit=2)
    assert int(count) > 20 and ok == "True"
    assert set(eval(codes)) <= {"chunks"}  # the same tensors, laid out as safetensors
