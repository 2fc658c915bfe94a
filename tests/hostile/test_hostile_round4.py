"""Round 4 (issue 40), class 4: work bounded by a declared number rather than by what is stored.

Each case runs in a forked child (:mod:`runner`), measured as the hostile corpus is
(:func:`test_hostile._check`: one line, no traceback, peak RSS under 512 MB, the time limit, no
outside open, the input unchanged), plus nothing at DST:

* megatron-core checkpoints of about 1 MB whose stacked keys declare 300,000 layers, all of them
  empty (shape ``(N, 0)``: the round-3 bound took a zero-byte span as stored), or each backed by a
  sparse tail; and a fully_reshardable MoE checkpoint whose expert keys declare two million
  (layer, expert) pairs: ``inspect --params`` and ``export --to hf`` built one entry per declared
  layer (18.7 GB and 138 s for 3 million on main);
* ``plan`` and ``reshard`` at a world just under the 2^20-rank cap, of a 1 MB source: ``plan``
  answered ``needs_reshard`` (the reshard took 1.2 GB and 120 s);
* the launcher given ``--num-layers 100000`` (or a vocabulary, or a world, that no machine of this
  size holds): it built layer after layer with no error line.
"""

from __future__ import annotations

import json
import os
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
from test_hostile import CKPT_TIMEOUT_S, LOAD_TIMEOUT_S, _check, _run_batch  # noqa: E402

REPO = HERE.parents[1]
MEGATRON = REPO / "fixtures" / "megatron"
DENSE = MEGATRON / "tp2_dp2_dp_reshardable"
MOE_FR = MEGATRON / "pair_moe_ep2_dp_reshardable_fully_reshardable"
OURS = REPO / "fixtures" / "gtp" / "fold_cp2_g2_dp2"
LAYERS = 300_000
VIEWS = [["inspect", "--params", "{src}"], ["export", "{src}", "{dst}/hf", "--to", "hf"]]


def _edit(it: Path, fn: Callable[[object, Path], None]) -> None:
    md = pickle.loads((it / ".metadata").read_bytes())  # our own fixture copy: trusted
    fn(md, it)
    (it / ".metadata").write_bytes(pickle.dumps(md))


def _stacked(md: object) -> list[tuple[str, object]]:
    return [(k, v) for k, v in md.state_dict_metadata.items()  # type: ignore[attr-defined]
            if k.startswith("decoder.layers.") and hasattr(v, "size")]


def empty_layers(md: object, it: Path) -> None:
    """Every stacked key: ``(300000, 0, ...)`` in one chunk of zero bytes."""
    for _, v in _stacked(md):
        size = type(v.size)
        v.size = size([LAYERS] + [0] * (len(v.size) - 1))
        v.chunks[:] = [replace(v.chunks[0], offsets=size([0] * len(v.size)), sizes=v.size)]


def layers_behind_holes(md: object, it: Path) -> None:
    """Every stacked key: ``(300000, 1)`` in one chunk whose bytes are a sparse tail of a data file."""
    path = it / "__0_0.distcp"
    at = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(at + 8 * LAYERS * len(_stacked(md)))
    for n, (k, v) in enumerate(_stacked(md)):
        size = type(v.size)
        v.size = size([LAYERS, 1])
        v.chunks[:] = [replace(v.chunks[0], offsets=size([0, 0]), sizes=v.size)]
        i, s = next((i, s) for i, s in md.storage_data.items() if i.fqn == k)  # type: ignore[attr-defined]
        md.storage_data = {j: t for j, t in md.storage_data.items() if j.fqn != k}  # type: ignore[attr-defined]
        md.storage_data[replace(i, offset=size([0, 0]), index=0)] = replace(  # type: ignore[attr-defined]
            s, relative_path="__0_0.distcp", offset=at + n * 8 * LAYERS, length=8 * LAYERS)


def expert_pairs(md: object, it: Path) -> None:
    """Every expert key of a MoE checkpoint: 2 layers x 1,000,000 experts of zero elements, in one chunk."""
    for k, v in md.state_dict_metadata.items():  # type: ignore[attr-defined]
        if k.startswith("decoder.layers.mlp.experts.experts.") and hasattr(v, "size"):
            size = type(v.size)
            v.size = size([2, 1_000_000] + [0] * (len(v.size) - 2))
            v.chunks[:] = [replace(v.chunks[0], offsets=size([0] * len(v.size)), sizes=v.size)]
            i, s = next((i, s) for i, s in md.storage_data.items() if i.fqn == k)  # type: ignore[attr-defined]
            md.storage_data = {j: t for j, t in md.storage_data.items() if j.fqn != k}  # type: ignore[attr-defined]
            md.storage_data[replace(i, offset=v.chunks[0].offsets, index=0)] = s  # type: ignore[attr-defined]


# (name, base, builder, commands, words)
VIEW_CASES = [
    # the fixture's args record 2 layers: the model description (args against stored shapes) may refuse first
    ("megatron_300k_empty_layers", DENSE, empty_layers, VIEWS,
     ("declares 300000 layers but stores chunks for 1", "its tensors must describe one model")),
    ("megatron_300k_layers_behind_holes", DENSE, layers_behind_holes, VIEWS,
     ("bytes its data files store", "its tensors must describe one model")),
    ("megatron_moe_2m_expert_pairs", MOE_FR, expert_pairs, [VIEWS[1]], "bytes its data files store"),
]
PLANS = [
    ("plan_world_under_cap_ours", OURS, ["plan", "{src}", "--cp", "2", "--dp", "262143"]),
    ("plan_world_under_cap_megatron", DENSE, ["plan", "{src}", "--tp", "2", "--dp", "524287"]),
    ("plan_world_over_elements_megatron", DENSE, ["plan", "{src}", "--tp", "2", "--dp", "50000"]),
]
RESHARDS = [
    ("reshard_world_under_cap_ours", OURS, ["reshard", "{src}", "{dst}/out", "--cp", "2", "--dp", "262143"]),
    ("reshard_world_under_cap_megatron", DENSE, ["reshard", "{src}", "{dst}/out", "--tp", "2", "--dp", "524287"]),
]
# launcher flags: (name, argv after the common ones, words)
LAUNCHER = [
    ("train_100k_layers", ["--num-layers", "100000", "--hidden", "8", "--num-heads", "1", "--ffn-hidden", "8"],
     "--num-layers 100000 is over 4096"),
    ("train_vocab_of_a_billion", ["--vocab-size", "1000000000"], "need at least"),
    ("train_hidden_of_a_million", ["--hidden", "1048576", "--num-heads", "1", "--ffn-hidden", "1048576"],
     "need at least"),
]


def _case(root: Path, dst_root: Path, name: str, base: Path, commands: list[list[str]], words: str,
          build: Callable[[object, Path], None] | None = None) -> Case:
    folder = root / name
    it = folder / "run" / "iter_0000002"
    shutil.copytree(next(base.glob("iter_*")), it)
    (folder / "run" / "latest_checkpointed_iteration.txt").write_text("2")
    if build is not None:
        _edit(it, build)
    dst = dst_root / name
    dst.mkdir(parents=True)
    cmds = [[a.replace("{src}", str(folder / "run")).replace("{dst}", str(dst)) for a in argv] for argv in commands]
    return Case(name, "memory", "run", cmds, False, dir=str(folder), notes={"dst": str(dst), "words": words})


@pytest.fixture(scope="module")
def declared(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict]:
    root = tmp_path_factory.mktemp("hostile-round4")
    dst_root = tmp_path_factory.mktemp("hostile-round4-dst")  # DSTs outside the corpus
    cases = [_case(root, dst_root, n, b, c, w, fn) for n, b, fn, c, w in VIEW_CASES]
    cases += [_case(root, dst_root, n, b, [[*argv, "--read-gbps", "1", "--format", "json"]], "would hold nothing")
              for n, b, argv in PLANS]
    cases += [_case(root, dst_root, n, b, [argv], "would hold nothing") for n, b, argv in RESHARDS]
    results = _run_batch("ckpt", root, cases, lambda c: c.commands, CKPT_TIMEOUT_S)
    return results, {c.name: c for c in cases}


def _refused(declared: tuple[dict, dict], job: str) -> None:
    results, cases = declared
    r, case = results[job], cases[job.rsplit("-", 1)[0]]
    _check(r, "ckpt: error: ", CKPT_TIMEOUT_S, False)
    words = case.notes["words"]
    assert any(w in r["stderr"] for w in ((words,) if isinstance(words, str) else words)), (r["argv"], r["stderr"])
    dst = Path(case.notes["dst"])
    assert list(dst.iterdir()) == [], f"{r['argv']}: left {sorted(p.name for p in dst.iterdir())} at DST"


@pytest.mark.parametrize("job", [f"{n}-{i}" for n, _, _, c, _ in VIEW_CASES for i in range(len(c))])
def test_a_per_parameter_view_is_bounded_by_the_stored_bytes(declared: tuple[dict, dict], job: str) -> None:
    _refused(declared, job)


@pytest.mark.parametrize("job", [f"{n}-0" for n, _, _ in RESHARDS])
def test_reshard_to_a_world_the_data_cannot_fill_is_refused(declared: tuple[dict, dict], job: str) -> None:
    _refused(declared, job)


@pytest.mark.parametrize("job", [f"{n}-0" for n, _, _ in PLANS])
def test_plan_calls_a_world_the_data_cannot_fill_impossible(declared: tuple[dict, dict], job: str) -> None:
    results, cases = declared
    r = results[job]
    assert r["exit"] == 0 and r["stderr"] == "" and not r["audit"] and not r["changed"], r
    assert r["maxrss_mb"] < 512 and r["seconds"] < CKPT_TIMEOUT_S, r
    doc = json.loads(r["stdout"])
    assert doc["verdict"] == "impossible" and doc["commands"] == [] and doc["ranks"] == [], doc
    assert "some rank would hold nothing" in doc["reason"], doc["reason"]


def test_plan_still_answers_a_world_the_data_fills() -> None:
    """The bound is the model's elements (96,768 in this fixture): DP 2 x TP 2 is as saved."""
    from gtp_format.layout.config import target_world_problem
    from gtp_format.reader.checkpoint import open_checkpoint

    ckpt = open_checkpoint(DENSE)
    n = ckpt.model_elements()
    assert 0 < n < 200_000
    assert target_world_problem({"--tp": 2, "--dp": n // 2}, n) is None
    assert "would hold nothing" in (target_world_problem({"--tp": 2, "--dp": n // 2 + 1}, n) or "")


@pytest.fixture(scope="module")
def launcher(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("hostile-round4-train")
    cases = []
    for name, flags, _ in LAUNCHER:
        folder = root / name
        (folder / "run").mkdir(parents=True)
        argv = ["--nproc-per-node", "1", "--steps", "1", "--device", "cpu", *flags]
        cases.append(Case(name, "memory", "run", [argv], False, dir=str(folder)))
    return _run_batch("train", root, cases, lambda c: c.commands, LOAD_TIMEOUT_S)


@pytest.mark.parametrize("i", range(len(LAUNCHER)))
def test_the_launcher_refuses_sizes_no_machine_of_this_size_holds(launcher: dict, i: int) -> None:
    name, _, words = LAUNCHER[i]
    r = launcher[f"{name}-0"]
    _check(r, "error: ", LOAD_TIMEOUT_S, False)  # no process started (the audit hook), under 512 MB
    assert words in r["stderr"], r
    assert r["seconds"] < 20, r  # refused from the flags, before any rank builds a layer


@pytest.mark.parametrize("flags", [["--nproc-per-node", "65536", "--dp", "65536"],
                                   ["--nproc-per-node", "16384", "--dp", "16384", "--num-layers", "4096", "--hidden",
                                    "8", "--num-heads", "1", "--ffn-hidden", "8"]])
def test_the_local_launcher_refuses_a_world_no_machine_of_this_size_holds(flags: list[str], tmp_path: Path) -> None:
    """The spawning launcher (the runner's children are torchrun ranks of a world of one): refused
    before any rank process starts."""
    import subprocess
    import time

    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "gtp_runtime.train", "--steps", "1", "--device", "cpu", *flags],
                       cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and r.stdout == "", r
    assert len(r.stderr.splitlines()) == 1 and "need at least" in r.stderr and "Traceback" not in r.stderr, r
    assert time.monotonic() - t0 < 60, r


def test_the_fit_bound_never_refuses_what_fits() -> None:
    """The bound is a lower bound of the need: the default model, and 4096 layers on one rank of a
    64 GiB host, pass."""
    from gtp_format.layout.config import ModelConfig
    from gtp_runtime.fits import fit_problem

    small = ModelConfig(vocab_size=256, hidden=64, num_layers=2, num_heads=4, ffn_hidden=128)
    assert fit_problem(small, 8, 8, 4, 4 << 30) is None
    deep = replace(small, num_layers=4096, hidden=8, num_heads=1, ffn_hidden=8)
    assert fit_problem(deep, 1, 1, 4, 64 << 30) is None
    assert "over 4096" in (fit_problem(replace(deep, num_layers=4097), 1, 1, 4, 1 << 50) or "")
    big = replace(small, vocab_size=10 ** 9)  # 128e9 parameters: 512 GB of fp32 weights
    assert fit_problem(big, 1, 1, 4, 64 << 30, gpu=8 * (80 << 30)) is None  # 8 x 80 GiB cards hold them
    assert "need at least" in (fit_problem(big, 1, 1, 4, 64 << 30) or "")
