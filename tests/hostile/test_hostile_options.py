"""Hostile option values and MoE expert-TP layouts (``--etp``, ``ckpt plan``, size options,
the launcher's ``--async-save-staging``), in forked children (:mod:`runner`), by class:

* topology values for ``reshard`` and ``plan`` (``--etp``, ``--ep``, ``--tp``, ``--pp``, ``--cp``,
  ``--dp``, ``--bucket-size``, ``--decoder-first/last-pipeline-num-layers``): 0, negative, 2**62, not
  integers, values that do not divide the experts, heads, ffn, layers or ranks, ``--etp`` on a dense
  megatron-core checkpoint and on ours;
* size values for ``--max-memory``, ``--max-shard-size``, ``--max-bytes`` and
  ``--async-save-staging``: 0, -1, ``5XB``, ``1e400``, ``99999999PB``, ``99999999TB`` (over 2^63),
  5000 digits, another script's digits;
* megatron-core MoE checkpoints whose stored chunks disagree on expert TP (:mod:`moe_corpus`):
  every command that lays parameters out refuses them; the ones that need no layout (``verify``,
  ``export --to hf``) give exactly what they give for the fixture they were cut from.

Each refusal: exit 1 or 2, one line naming the option (or key) and the fix, no traceback, peak RSS
under 512 MB, within the time limit, no outside open, the input unchanged (:func:`test_hostile._check`)
and nothing at DST. ``plan`` answers a target it cannot reach with exit 0 and the verdict
``impossible``, never with a command that would fail.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from make_corpus import Case  # noqa: E402
from moe_corpus import (  # noqa: E402
    EP1_CASES,
    EP1_GROUP_CASES,
    MEGATRON,
    MOE_CASES,
    build_ep1,
    build_ep1_groups,
    build_moe,
)
from test_hostile import CKPT_TIMEOUT_S, LOAD_TIMEOUT_S, _check, _run_batch  # noqa: E402

REPO = HERE.parents[1]
HUGE = str(2**62)
MOE, DENSE, OURS = "pair_moe_tp2_etp2_dp_reshardable", "tp2_dp2_dp_reshardable", "fold_cp2_g2_dp2"
BASES = {MOE: MEGATRON / MOE, DENSE: MEGATRON / DENSE, OURS: REPO / "fixtures" / "gtp" / OURS}

# (name, base, extra flags, words the one line must hold); each runs as ckpt reshard SRC DST FLAGS
RESHARD = [
    ("etp_zero", MOE, ["--etp", "0"], "--etp"), ("etp_negative", MOE, ["--etp", "-1"], "--etp"),
    ("etp_huge", MOE, ["--etp", HUGE], "expert TP (--etp)"), ("etp_fraction", MOE, ["--etp", "1.5"], "--etp"),
    ("etp_word", MOE, ["--etp", "two"], "--etp"), ("etp_long_form_zero", MOE, ["--expert-tensor-parallel-size", "0"],
                                                    "--expert-tensor-parallel-size"),
    ("etp_not_dividing_ranks", MOE, ["--etp", "3"], "does not divide the 4 ranks"),
    ("etp_not_dividing_ffn", MOE, ["--dp", "3", "--ep", "2", "--etp", "3"], "does not split over expert TP 3"),
    ("etp_on_dense", DENSE, ["--etp", "2"], "has no experts"),
    ("etp_on_ours", OURS, ["--etp", "2"], "--etp: is for megatron-core sources"),
    ("ep_huge", MOE, ["--ep", HUGE], "does not divide its 4 experts"),
    ("ep_not_dividing_experts", MOE, ["--ep", "3"], "--ep 3 does not divide its 4 experts"),
    ("ep_zero", MOE, ["--ep", "0"], "--ep"),
    ("tp_huge", MOE, ["--tp", HUGE], "over 1048576"),
    ("tp_not_dividing_heads", MOE, ["--tp", "3"], "does not split over TP 3"),
    ("pp_huge", MOE, ["--pp", HUGE], "over 1048576"), ("cp_huge", MOE, ["--cp", HUGE], "over 1048576"),
    ("dp_huge", MOE, ["--dp", HUGE], "over 1048576"), ("dp_huge_ours", OURS, ["--dp", HUGE], "over 1048576"),
    ("pp_not_dividing_layers", DENSE, ["--pp", "3"], "do not split evenly over PP 3"),
    ("bucket_size_zero", MOE, ["--bucket-size", "0"], "--bucket-size"),
    # the target's uneven pipeline split (Megatron's --decoder-first/last-pipeline-num-layers)
    ("first_layers_zero", DENSE, ["--pp", "2", "--decoder-first-pipeline-num-layers", "0"],
     "--decoder-first-pipeline-num-layers"),
    ("first_layers_word", DENSE, ["--pp", "2", "--decoder-first-pipeline-num-layers", "x"],
     "--decoder-first-pipeline-num-layers"),
    ("last_layers_negative", DENSE, ["--pp", "2", "--decoder-last-pipeline-num-layers", "-3"],
     "--decoder-last-pipeline-num-layers"),
    ("first_layers_huge", DENSE, ["--pp", "2", "--decoder-first-pipeline-num-layers", HUGE], "do not split over PP 2"),
    ("first_layers_over_layers", DENSE, ["--pp", "2", "--decoder-first-pipeline-num-layers", "5"],
     "do not split over PP 2"),
    ("first_layers_at_pp1", DENSE, ["--decoder-first-pipeline-num-layers", "1"], "at PP 1"),
    ("first_layers_on_ours", OURS, ["--decoder-first-pipeline-num-layers", "1"], "is for megatron-core sources"),
    ("max_memory_zero", MOE, ["--max-memory", "0"], "--max-memory"),
    ("max_memory_unit", MOE, ["--max-memory", "5XB"], "5XB"),
    ("max_memory_over_2_63", MOE, ["--max-memory", "99999999TB"], "over 2^63 - 1 bytes"),
    ("max_memory_5000_digits", MOE, ["--max-memory", "9" * 5000], "is not a size"),
]
# commands besides reshard, with the size options they take: (name, base, argv after "ckpt", words)
OTHERS = [
    ("shard_size_zero", OURS, ["export", "{src}", "{dst}/hf", "--to", "hf", "--max-shard-size", "0"], "0 bytes"),
    ("shard_size_over_2_63", OURS, ["export", "{src}", "{dst}/hf", "--to", "hf", "--max-shard-size", "99999999TB"],
     "over 2^63 - 1 bytes"),
    ("shard_size_other_digits", OURS, ["export", "{src}", "{dst}/hf", "--to", "hf", "--max-shard-size", "\u0665GB"],
     "is not a size"),
    ("max_bytes_exponent", OURS, ["show", "{src}", "embedding.word_embeddings.weight", "--max-bytes", "1e400"],
     "--max-bytes"),
    ("max_bytes_negative", OURS, ["show", "{src}", "embedding.word_embeddings.weight", "--max-bytes", "-1"],
     "--max-bytes"),
    ("max_bytes_petabytes", OURS, ["diff", "{src}", "{src}", "--max-bytes", "99999999PB"], "99999999PB"),
    ("plan_etp_on_ours", OURS, ["plan", "{src}", "--etp", "2", "--read-gbps", "1"], "--etp: is for megatron-core"),
    ("plan_etp_zero", MOE, ["plan", "{src}", "--etp", "0", "--read-gbps", "1"], "--etp"),
]
# plan targets it cannot reach: exit 0, verdict impossible, no command, the reason's words
PLAN_IMPOSSIBLE = [
    ("plan_etp_not_dividing", MOE, ["--tp", "2", "--dp", "2", "--ep", "2", "--etp", "3"], "does not divide"),
    ("plan_etp_huge", MOE, ["--tp", "2", "--dp", "2", "--ep", "2", "--etp", HUGE], "does not divide"),
    ("plan_ep_not_dividing", MOE, ["--tp", "2", "--dp", "2", "--ep", "3"], "--ep 3 does not divide"),
    ("plan_tp_not_dividing", MOE, ["--tp", "3", "--dp", "2", "--ep", "2"], "does not split over TP 3"),
    ("plan_dp_huge", MOE, ["--tp", "2", "--dp", HUGE], "over 1048576"),
    ("plan_pp_huge", DENSE, ["--pp", HUGE], "over 1048576"),
    ("plan_dp_huge_ours", OURS, ["--cp", "2", "--dp", HUGE], "over 1048576"),
    ("plan_first_layers_huge", DENSE, ["--pp", "2", "--decoder-first-pipeline-num-layers", HUGE],
     "do not split over PP 2"),
    ("plan_first_layers_over_layers", DENSE, ["--pp", "2", "--decoder-first-pipeline-num-layers", "5"],
     "do not split over PP 2"),
]
MOE_REFUSING = [["inspect", "--params", "{src}"], ["plan", "{src}", "--ep", "1", "--dp", "4", "--read-gbps", "1"],
                ["reshard", "{src}", "{dst}/reshard-etp", "--ep", "1", "--etp", "2", "--dp", "1"],
                ["export", "{src}", "{dst}/fr", "--to", "fully_reshardable"],
                ["export", "{src}", "{dst}/hf", "--to", "hf", "--optimizer"]]  # the MoE optimizer's HF export
# the commands that lay out an EP 1 checkpoint's dense buffer (reshard to the chained pair and at EP 1)
EP1_REFUSING = [["inspect", "--params", "{src}"],
                ["reshard", "{src}", "{dst}/reshard-ep2", "--tp", "1", "--dp", "2", "--ep", "2", "--etp", "1"],
                ["reshard", "{src}", "{dst}/reshard-ep1", "--tp", "1", "--dp", "2", "--ep", "1", "--etp", "1"],
                ["export", "{src}", "{dst}/hf", "--to", "hf", "--optimizer"]]
STAGING = ["0", "-1", "5XB", "1e400", "99999999PB", "99999999TB", "9" * 5000, "\u0665GB"]


def _case(root: Path, dst_root: Path, name: str, base: Path, commands: list[list[str]], words: str) -> Case:
    folder = root / name
    it = folder / "run" / "iter_0000002"
    shutil.copytree(next(base.glob("iter_*")), it)
    (folder / "run" / "latest_checkpointed_iteration.txt").write_text("2")
    dst = dst_root / name
    dst.mkdir(parents=True)
    cmds = [[a.replace("{src}", str(folder / "run")).replace("{dst}", str(dst)) for a in argv] for argv in commands]
    return Case(name, "options", "run", cmds, False, dir=str(folder), notes={"dst": str(dst), "words": words})


def _build(root: Path, dst_root: Path) -> list[Case]:
    cases = [_case(root, dst_root, n, BASES[b], [["reshard", "{src}", "{dst}/out", *f]], w) for n, b, f, w in RESHARD]
    cases += [_case(root, dst_root, n, BASES[b], [argv], w) for n, b, argv, w in OTHERS]
    cases += [_case(root, dst_root, n, BASES[b], [["plan", "{src}", *f, "--read-gbps", "1", "--format", "json"]], w)
              for n, b, f, w in PLAN_IMPOSSIBLE]
    for name, (fixture, _, _) in MOE_CASES.items():
        case = _case(root, dst_root, name, MEGATRON / fixture, MOE_REFUSING, "cannot establish the parameter layout")
        build_moe(name, Path(case.dir) / "run" / "iter_0000002")
        cases.append(case)
    for name, (fixture, words) in EP1_CASES.items():
        case = _case(root, dst_root, name, MEGATRON / fixture, EP1_REFUSING, words)
        build_ep1(name, Path(case.dir) / "run" / "iter_0000002")
        cases.append(case)
    for name, words in EP1_GROUP_CASES.items():  # reshard to the chained pair makes the expert groups from them
        case = _case(root, dst_root, name, MEGATRON / "pair_qwen2moe_tp2_ep1_dp_reshardable", [EP1_REFUSING[1]], words)
        build_ep1_groups(name, Path(case.dir) / "run" / "iter_0000002")
        cases.append(case)
    return cases


@pytest.fixture(scope="module")
def options(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict]:
    root = tmp_path_factory.mktemp("hostile-options")
    cases = _build(root, tmp_path_factory.mktemp("hostile-options-dst"))  # DSTs outside the corpus
    results = _run_batch("ckpt", root, cases, lambda c: c.commands, CKPT_TIMEOUT_S)
    return results, {c.name: c for c in cases}


def _refused(options: tuple[dict, dict], job: str) -> None:
    results, cases = options
    r, case = results[job], cases[job.rsplit("-", 1)[0]]
    _check(r, "ckpt: error: ", CKPT_TIMEOUT_S, False)
    assert case.notes["words"] in r["stderr"], (r["argv"], r["stderr"])
    dst = Path(case.notes["dst"])
    assert list(dst.iterdir()) == [], f"{r['argv']}: left {sorted(p.name for p in dst.iterdir())} at DST"


@pytest.mark.parametrize("job", [f"{n}-0" for n, _, _, _ in RESHARD + OTHERS])
def test_a_hostile_option_value_is_refused(options: tuple[dict, dict], job: str) -> None:
    _refused(options, job)


@pytest.mark.parametrize("job", [f"{n}-{i}" for n in MOE_CASES for i in range(len(MOE_REFUSING))])
def test_expert_chunks_that_disagree_on_expert_tp_are_refused(options: tuple[dict, dict], job: str) -> None:
    _refused(options, job)


@pytest.mark.parametrize("job", [f"{n}-{i}" for n in EP1_CASES for i in range(len(EP1_REFUSING))])
def test_an_ep1_buffer_that_disagrees_with_the_shared_expert_layout_is_refused(options: tuple[dict, dict],
                                                                                job: str) -> None:
    """EP 1 with expert TP = TP (experts and the shared expert in the dense buffer): a bucket longer than the
    parameters' layout, or one chunk across the shared expert's linear_fc1 and gate_weight, is refused by every
    command that lays the buffer out, naming the key."""
    _refused(options, job)


@pytest.mark.parametrize("job", [f"{n}-0" for n in EP1_GROUP_CASES])
def test_ep1_param_groups_the_expert_groups_cannot_be_made_from_are_refused(options: tuple[dict, dict],
                                                                           job: str) -> None:
    """Reshard from EP 1 to the chained pair leaves the no-decay group out of the expert optimizer's groups on the
    pickle's opcodes: a ``wd_mult`` that is no float, or a no-decay group first (the kept group's keys then refer to
    its memo entries), is refused in one line, nothing written."""
    _refused(options, job)


@pytest.mark.parametrize("job", [f"{n}-0" for n, _, _, _ in PLAN_IMPOSSIBLE])
def test_plan_calls_an_unreachable_target_impossible(options: tuple[dict, dict], job: str) -> None:
    results, cases = options
    r, case = results[job], cases[job.rsplit("-", 1)[0]]
    assert r["exit"] == 0 and r["stderr"] == "" and not r["audit"] and not r["changed"], r
    assert r["maxrss_mb"] < 512 and r["seconds"] < CKPT_TIMEOUT_S, r
    doc = json.loads(r["stdout"])
    assert doc["verdict"] == "impossible" and doc["commands"] == [] and doc["ranks"] == [], doc
    assert case.notes["words"] in doc["reason"], doc["reason"]


@pytest.mark.parametrize("name", sorted(MOE_CASES))
def test_commands_that_need_no_layout_read_the_recut_experts_as_the_fixture(name: str, tmp_path: Path) -> None:
    """The re-cut copy holds the fixture's elements, chunked otherwise: ``verify --data`` passes and
    ``export --to hf`` (whole model tensors, any chunking) writes the same tensors as from the fixture."""
    import torch
    from safetensors.torch import load_file

    from ckpt_tool.cli import run

    fixture = MEGATRON / MOE_CASES[name][0]
    it = tmp_path / "run" / "iter_0000002"
    shutil.copytree(fixture / "iter_0000002", it)
    build_moe(name, it)
    assert run(["verify", "--data", str(it)]) == 0
    assert run(["export", str(it), str(tmp_path / "hf-recut"), "--to", "hf", "--names", "megatron"]) == 0
    assert run(["export", str(fixture), str(tmp_path / "hf-fixture"), "--to", "hf", "--names", "megatron"]) == 0
    shards = sorted(p.name for p in (tmp_path / "hf-fixture").glob("*.safetensors"))
    assert shards and shards == sorted(p.name for p in (tmp_path / "hf-recut").glob("*.safetensors"))
    for shard in shards:
        a, b = load_file(tmp_path / "hf-fixture" / shard), load_file(tmp_path / "hf-recut" / shard)
        assert a.keys() == b.keys() and all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)


@pytest.fixture(scope="module")
def staging(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """``python -m gtp_runtime.train --async-save --async-save-staging V`` for each hostile V, one rank."""
    root = tmp_path_factory.mktemp("hostile-staging")
    cases = []
    for i, value in enumerate(STAGING):
        folder = root / f"staging{i}"
        (folder / "run").mkdir(parents=True)
        argv = ["--nproc-per-node", "1", "--steps", "1", "--device", "cpu", "--save", str(folder / "run" / "ckpt"),
                "--async-save", f"--async-save-staging={value}"]
        cases.append(Case(f"staging{i}", "options", "run", [argv], False, dir=str(folder)))
    results = _run_batch("train", root, cases, lambda c: c.commands, LOAD_TIMEOUT_S)
    return {"results": results, "root": root}


@pytest.mark.parametrize("i", range(len(STAGING)))
def test_a_hostile_staging_size_is_refused_before_any_rank(staging: dict, i: int) -> None:
    r = staging["results"][f"staging{i}-0"]
    _check(r, "error: ", LOAD_TIMEOUT_S, False)
    assert "--async-save-staging: " in r["stderr"] and repr(STAGING[i][:60]) in r["stderr"], r
    assert r["seconds"] < 10, r  # refused while parsing the flags, before any rank or process group starts
    assert list((staging["root"] / f"staging{i}" / "run").iterdir()) == [], "something was saved"
