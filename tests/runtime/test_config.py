"""Validation: one test per refused shape, in the library and through the launcher command line.

Every message is one line and names the fix.
"""

from __future__ import annotations

import subprocess

import launcher_cases as lc
import pytest

from gtp_format.layout.config import ConfigError, ModelConfig, ParallelConfig, check_buffer_cp_degrees
from gtp_runtime import train


def refused(fn, *args, **kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        fn(*args, **kwargs)
    msg = str(info.value)
    assert "\n" not in msg
    return msg


# -- ParallelConfig ------------------------------------------------------------------------------


def test_valid_shapes_pass():
    ParallelConfig(cp=2, gtp_remat=2, dp=2, fold_cp=True).validate(8)
    ParallelConfig(tp=2, cp=2, fold_cp=True, expert_gtp_remat=2).validate(4, num_experts=4)
    ParallelConfig(average_in_collective=True).validate(1)  # nothing sharded: averaging is allowed
    ParallelConfig(cp=2, average_in_collective=True).validate(2)  # CP without folding shards nothing


def test_world_size_mismatch():
    msg = refused(ParallelConfig(cp=2, gtp_remat=2, dp=2).validate, 4)
    assert "world size 4 != tp*cp*gtp_remat*dp = 1*2*2*2 = 8" in msg
    assert "launch 8 ranks" in msg


@pytest.mark.parametrize("field", ["tp", "cp", "gtp_remat", "dp", "expert_gtp_remat"])
def test_non_positive_size(field):
    msg = refused(ParallelConfig(**{field: 0}).validate)
    assert f"--{field.replace('_', '-')} must be a positive integer, got 0" in msg


def test_fold_cp_needs_cp():
    msg = refused(ParallelConfig(gtp_remat=2, fold_cp=True).validate, 2)
    assert "--fold-cp needs --cp > 1" in msg and "drop --fold-cp" in msg


def test_average_in_collective_refused_with_gtp_remat():
    msg = refused(ParallelConfig(cp=2, gtp_remat=2, average_in_collective=True).validate, 4)
    assert "GTP_remat is active" in msg
    assert "drop --average-in-collective" in msg


def test_average_in_collective_refused_with_fold_at_gtp_remat_1():
    """The shape upstream missed (NVIDIA/Megatron-LM#6886): gtp_remat == 1 but folding makes dense GTP active."""
    par = ParallelConfig(cp=2, gtp_remat=1, fold_cp=True, average_in_collective=True)
    assert par.dense_gtp_active and par.weight_group_size == 2
    msg = refused(par.validate, 2)
    assert "fold_cp at gtp_remat=1 shards dense weights over the CP group" in msg
    assert "drop --average-in-collective" in msg


def test_average_in_collective_refused_with_expert_gtp_only():
    msg = refused(ParallelConfig(dp=2, expert_gtp_remat=2, average_in_collective=True).validate, 2)
    assert "GTP_remat is active" in msg


def test_expert_gtp_must_divide_world_over_tp():
    msg = refused(ParallelConfig(cp=3, expert_gtp_remat=2).validate, 3, num_experts=2)
    assert "--expert-gtp-remat 2 must divide world/tp = 3" in msg
    ParallelConfig(cp=3, expert_gtp_remat=2).validate(3)  # no experts: the expert grid is unused


# -- buffers -------------------------------------------------------------------------------------


def test_mixed_cp_degrees_in_one_buffer():
    msg = refused(check_buffer_cp_degrees, "gbuf_idx_0", {2, 4})
    assert "gbuf_idx_0 mixes params with CP-excluded divisors [2, 4]" in msg
    assert "different buffers" in msg
    assert check_buffer_cp_degrees("gbuf_idx_1", {4}) == 4


# -- ModelConfig ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("model", "par", "words"),
    [
        (ModelConfig(seq_length=30), ParallelConfig(cp=2), "--seq-length 30 must be a multiple of 2*cp = 4"),
        (ModelConfig(num_heads=4), ParallelConfig(tp=3), "--num-heads 4 must be a multiple of --tp 3"),
        (ModelConfig(hidden=66, num_heads=4), ParallelConfig(), "--hidden 66 must be a multiple of --num-heads 4"),
        (ModelConfig(num_heads=4, ffn_hidden=126), ParallelConfig(tp=4), "--ffn-hidden 126 must be a multiple of"),
        (ModelConfig(num_heads=4, vocab_size=250), ParallelConfig(tp=4), "--vocab-size 250 must be a multiple of"),
        (ModelConfig(num_experts=2, moe_topk=3), ParallelConfig(), "--moe-topk 3 must be in 1..2"),
        (ModelConfig(num_experts=2, moe_topk=0), ParallelConfig(), "--moe-topk 0 must be in 1..2"),
    ],
)
def test_model_validation(model, par, words):
    assert words in refused(model.validate, par)


def test_valid_model_shapes_pass():
    ModelConfig(num_heads=2, ffn_hidden=130).validate(ParallelConfig(tp=2))
    ModelConfig(seq_length=24).validate(ParallelConfig(cp=3))
    ModelConfig(num_experts=4, moe_topk=4).validate(ParallelConfig())


def test_seq_length_message_explains_the_chunks():
    msg = refused(ModelConfig(seq_length=36).validate, ParallelConfig(cp=4))
    assert "2*cp chunks" in msg


# -- through the launcher ------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(lc.CLI_ERRORS))
def test_launcher_exits_2_on_config_error(name):
    argv, words = lc.CLI_ERRORS[name]
    p = subprocess.run([*lc.LAUNCHER, *argv], cwd=lc.REPO, env=lc.env(), capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 2, (p.stdout, p.stderr)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), p.stderr
    for w in words:
        assert w in lines[0]
    assert p.stdout == ""  # no rank started, nothing trained


def test_launcher_help():
    p = subprocess.run([*lc.LAUNCHER, *lc.HELP], cwd=lc.REPO, env=lc.env(), capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0
    assert "--fold-cp" in p.stdout and "torchrun --nproc-per-node 2" in p.stdout


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--tp", "0"], "--tp must be a positive integer, got 0"),  # used to crash with ZeroDivisionError
        (["--nproc-per-node", "3", "--cp", "2"], "world size 3 is not a multiple of tp*cp*gtp_remat = 2; pass --dp"),
        (["--dp", "2", "--expert-gtp-remat", "3", "--num-experts", "2"], "--expert-gtp-remat 3 must divide"),
        (["--num-experts", "2", "--moe-topk", "3"], "--moe-topk 3 must be in 1..2"),
        (["--num-heads", "0"], "--num-heads must be a positive integer, got 0"),  # used to divide by zero
        (["--micro-batch", "0"], "--micro-batch must be positive"),  # used to crash inside the ranks
        (["--async-save-staging", "1GiB"], "add --async-save or drop --async-save-staging"),  # was ignored
        (["--async-save", "--async-save-staging", "1.5"], "not a whole number of bytes"),  # was read as 1 byte
    ],
)
def test_main_returns_2_in_process(argv, words, capsys):
    """The same entry point, called in-process (cheap): exit code 2 and the message on stderr."""
    assert train.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and words in err
