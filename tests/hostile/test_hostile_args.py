"""megatron-core checkpoints whose ``common_state`` args lie about the model (:mod:`args_corpus`).

Every command that reads the model description (``inspect``, ``inspect --params``) refuses each in
one line naming the arg and the tensor it disagrees with, exit 2, in a forked child
(:mod:`runner`): no traceback, peak RSS under 512 MB whatever the args declare (``num_layers`` =
2^40 included), no open outside the checkpoint, the input unchanged. The unedited args of the
same fixtures describe the model with every field checked (``test_the_fixtures_args_agree``).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from args_corpus import ARGS_CASES, MEGATRON, VIEW_ONLY, set_args  # noqa: E402
from make_corpus import Case  # noqa: E402
from test_hostile import CKPT_TIMEOUT_S, _check, _run_batch  # noqa: E402

COMMANDS = [["inspect", "{src}"], ["inspect", "--params", "{src}"]]
VIEW_COMMANDS = [["inspect", "--params", "{src}"], ["reshard", "{src}", "{dst}", "--pp", "1"]]


@pytest.fixture(scope="module")
def lying(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("hostile-args")
    cases = []
    for name, (fixture, changes, _) in ARGS_CASES.items():
        folder = root / name
        it = folder / "run" / "iter_0000002"
        shutil.copytree(MEGATRON / fixture / "iter_0000002", it)
        (folder / "run" / "latest_checkpointed_iteration.txt").write_text("2")
        set_args(it, changes)
        dst = root.parent / f"{root.name}-dst" / name / "out"  # outside the corpus
        dst.parent.mkdir(parents=True)
        cmds = [[a.replace("{src}", str(folder / "run")).replace("{dst}", str(dst)) for a in argv]
                for argv in (VIEW_COMMANDS if name in VIEW_ONLY else COMMANDS)]
        cases.append(Case(name, "args", "run", cmds, False, dir=str(folder)))
    return _run_batch("ckpt", root, cases, lambda c: c.commands, CKPT_TIMEOUT_S)


@pytest.mark.parametrize("job", [f"{n}-{i}" for n in ARGS_CASES for i in range(len(COMMANDS))])
def test_args_that_lie_about_the_model_are_refused_naming_the_arg(lying: dict, job: str) -> None:
    r = lying[job]
    _check(r, "ckpt: error: ", CKPT_TIMEOUT_S, False)
    if job.rsplit("-", 1)[0] in VIEW_ONLY:
        assert "cannot establish the parameter layout" in r["stderr"] and "common_state args" not in r["stderr"]
        for words in ARGS_CASES[job.rsplit("-", 1)[0]][2]:
            assert words in r["stderr"], (words, r["stderr"])
        assert not any(Path(a).exists() for a in r["argv"] if a.endswith("/out")), r["argv"]
        return
    assert r["exit"] == 2, r
    for words in ARGS_CASES[job.rsplit("-", 1)[0]][2]:
        assert words in r["stderr"], (words, r["stderr"])
    assert "common_state args" in r["stderr"], r["stderr"]


def test_the_fixtures_args_agree() -> None:
    """The fixtures' own args pass the same checks; what they lack is inferred and says so."""
    from gtp_format.megatron.args import describe_model
    from gtp_format.reader.checkpoint import open_checkpoint

    model = describe_model(open_checkpoint(MEGATRON / "pair_moe_ep2_dp_reshardable"))
    assert (model.num_layers, model.hidden_size, model.num_attention_heads, model.num_query_groups,
            model.kv_channels, model.num_experts, model.moe_ffn_hidden_size) == (1, 32, 4, 4, 8, 4, 32)
    assert model.sources["num_attention_heads"] == "args" and "normalization" in model.inferred
    assert (model.normalization, model.position_embedding_type, model.untied, model.gated_linear_unit) == (
        "LayerNorm", "learned_absolute", False, False)
    untied = describe_model(open_checkpoint(MEGATRON / "pair_untied_pp2_dp_reshardable"))
    assert untied.untied is True and "untied" in untied.inferred
    llama3 = describe_model(open_checkpoint(MEGATRON / "pair_llama3_rope_tp2_dp_reshardable"))
    assert (llama3.use_rope_scaling, llama3.rope_scaling_factor, llama3.rotary_base) == (True, 32.0, 500000)
    assert "Llama 3 RoPE scaling x32" in llama3.describe()


@pytest.mark.parametrize("impl", ["local", None])
def test_grouped_gemm_on_the_local_spec_is_sequential(tmp_path: Path, impl: str | None) -> None:
    """The local spec builds SequentialMLP whatever --moe-grouped-gemm says: its view is the fixture's own.
    Without a recorded transformer_impl (Megatron-LM's default is Transformer Engine) it is refused."""
    from gtp_format.errors import FormatError
    from gtp_format.megatron.view import megatron_views
    from gtp_format.reader.checkpoint import open_checkpoint

    it = tmp_path / "iter_0000002"
    shutil.copytree(MEGATRON / "pair_moe_ep2_dp_reshardable" / "iter_0000002", it)
    set_args(it, {"moe_grouped_gemm": True, **({"transformer_impl": impl} if impl else {})})
    if impl is None:
        with pytest.raises(FormatError, match="TEGroupedMLP"):
            megatron_views(open_checkpoint(it), experts=True)
        return
    ours = megatron_views(open_checkpoint(it), experts=True)
    theirs = megatron_views(open_checkpoint(MEGATRON / "pair_moe_ep2_dp_reshardable" / "iter_0000002"), experts=True)
    assert ours.keys() == theirs.keys() and all(ours[k] == theirs[k] for k in ours)
