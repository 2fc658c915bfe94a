"""``export --to hf --optimizer`` of a crafted megatron-core ``fully_reshardable`` save.

The export reads each optimizer state from its per-parameter key (``optimizer.state.<state>.<model key>``) at
the weight's box (:func:`ckpt_tool.copying.weights.full_state_views`); a state key at another shape than its
parameter would be read as other elements, or past its end. Each case is a genuine fixture with one state
key's entry rewritten in ``.metadata`` (consistently: its chunks and storage index too, so the gate passes it)
and runs in a forked child (:mod:`runner`), measured as the hostile corpus is (:func:`test_hostile._check`: one
line, exit 1 or 2, no traceback, peak RSS under 512 MB, the time limit, no outside open, the input unchanged),
plus the line names the key and nothing is at DST.
"""

from __future__ import annotations

import pickle
import shutil
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from make_corpus import Case  # noqa: E402
from test_hostile import CKPT_TIMEOUT_S, _check, _run_batch  # noqa: E402

REPO = HERE.parents[1]
MEGATRON = REPO / "fixtures" / "megatron"
DENSE = MEGATRON / "pair_tp2_dp2_dp_reshardable_fully_reshardable"
MOE = MEGATRON / "pair_mixtral_ep2_dp_reshardable_fully_reshardable"
NORM = "optimizer.state.exp_avg.decoder.final_layernorm.weight"
EXPERT = "optimizer.state.param.decoder.layers.mlp.experts.experts.linear_fc2.weight"
QKV = "optimizer.state.exp_avg_sq.decoder.layers.self_attention.linear_qkv.weight"


def _split_last(key: str) -> Callable[[object], None]:
    """``key``'s last axis ``d`` becomes ``(d / 2, 2)``: the same bytes, every chunk and index entry with it."""
    def edit(md: object) -> None:
        v = md.state_dict_metadata[key]  # type: ignore[attr-defined]
        size = type(v.size)
        v.size = size([*v.size[:-1], v.size[-1] // 2, 2])
        v.chunks[:] = [replace(c, offsets=size([*c.offsets[:-1], c.offsets[-1] // 2, 0]),
                               sizes=size([*c.sizes[:-1], c.sizes[-1] // 2, 2])) for c in v.chunks]
        data = md.storage_data  # type: ignore[attr-defined]
        md.storage_data = {(replace(i, offset=size([*i.offset[:-1], i.offset[-1] // 2, 0])) if i.fqn == key else i): s
                           for i, s in data.items()}  # type: ignore[attr-defined]
    return edit


def _drop(key: str) -> Callable[[object], None]:
    def edit(md: object) -> None:
        del md.state_dict_metadata[key]  # type: ignore[attr-defined]
        md.storage_data = {i: s for i, s in md.storage_data.items() if i.fqn != key}  # type: ignore[attr-defined]
    return edit


# (name, base, edit, words the line must hold)
CASES = [
    ("fr_state_shape_dense", DENSE, _split_last(NORM), (f"{NORM!r} is [16, 2] float32", "implies [32] float32")),
    ("fr_state_shape_expert", MOE, _split_last(EXPERT),
     (f"{EXPERT!r} is [1, 4, 32, 16, 2] float32", "implies [1, 4, 32, 32] float32")),
    ("fr_state_missing", DENSE, _drop(QKV), (f"{QKV!r} is missing",)),
]


def _case(root: Path, dst_root: Path, name: str, base: Path, edit: Callable[[object], None],
          words: tuple[str, ...]) -> Case:
    folder = root / name
    it = folder / "run" / "iter_0000002"
    shutil.copytree(next(base.glob("iter_*")), it)
    (folder / "run" / "latest_checkpointed_iteration.txt").write_text("2")
    md = pickle.loads((it / ".metadata").read_bytes())  # our own copy of a fixture: trusted
    edit(md)
    (it / ".metadata").write_bytes(pickle.dumps(md))
    dst = dst_root / name
    dst.mkdir(parents=True)
    cmd = ["export", str(folder / "run"), str(dst / "hf"), "--to", "hf", "--optimizer"]
    return Case(name, "integrity", "run", [cmd], False, dir=str(folder), notes={"dst": str(dst), "words": words})


@pytest.fixture(scope="module")
def crafted(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict]:
    root = tmp_path_factory.mktemp("hostile-fr-optimizer")
    dst_root = tmp_path_factory.mktemp("hostile-fr-optimizer-dst")  # DSTs outside the corpus
    cases = [_case(root, dst_root, *spec) for spec in CASES]
    results = _run_batch("ckpt", root, cases, lambda c: c.commands, CKPT_TIMEOUT_S)
    return results, {c.name: c for c in cases}


@pytest.mark.parametrize("job", [f"{name}-0" for name, _, _, _ in CASES])
def test_a_state_key_that_disagrees_with_its_parameter_is_refused(crafted: tuple[dict, dict], job: str) -> None:
    results, cases = crafted
    r, case = results[job], cases[job.rsplit("-", 1)[0]]
    _check(r, "ckpt: error: ", CKPT_TIMEOUT_S, False)
    assert r["exit"] == 2 and all(w in r["stderr"] for w in case.notes["words"]), (r["argv"], r["stderr"])
    dst = Path(case.notes["dst"])
    assert list(dst.iterdir()) == [], f"{r['argv']}: left {sorted(p.name for p in dst.iterdir())} at DST"
