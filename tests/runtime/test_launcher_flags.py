"""Every launcher flag is registered, exercised by the suite, and actually consumed.

Upstream (NVIDIA/Megatron-LM#6886, as reviewed) read a flag that was never registered with its parser, and validated
a flag in one entry point and not another; these tests make both mistakes fail here.
"""

from __future__ import annotations

import ast
import inspect

import launcher_cases as lc
import pytest
import torch

from gtp_runtime import train

# dest -> (baseline argv, argv with the flag, TrainConfig field, value the field must take).
CONFIG_FLAGS = {
    "nproc_per_node": ([], ["--nproc-per-node", "2"], "par.dp", 2),  # dp defaults to world/(tp*cp*g)
    "tp": ([], ["--tp", "2"], "par.tp", 2),
    "cp": ([], ["--cp", "2"], "par.cp", 2),
    "gtp_remat": ([], ["--gtp-remat", "2"], "par.gtp_remat", 2),
    "dp": ([], ["--dp", "2"], "par.dp", 2),
    "fold_cp": (["--cp", "2"], ["--cp", "2", "--fold-cp"], "par.fold_cp", True),
    "expert_gtp_remat": (["--dp", "2"], ["--dp", "2", "--expert-gtp-remat", "2"], "par.expert_gtp_remat", 2),
    "average_in_collective": ([], ["--average-in-collective"], "par.average_in_collective", True),
    "vocab_size": ([], ["--vocab-size", "128"], "model.vocab_size", 128),
    "hidden": ([], ["--hidden", "32"], "model.hidden", 32),
    "num_layers": ([], ["--num-layers", "3"], "model.num_layers", 3),
    "num_heads": ([], ["--num-heads", "2"], "model.num_heads", 2),
    "ffn_hidden": ([], ["--ffn-hidden", "96"], "model.ffn_hidden", 96),
    "seq_length": ([], ["--seq-length", "16"], "model.seq_length", 16),
    "num_experts": ([], ["--num-experts", "2"], "model.num_experts", 2),
    "moe_topk": (["--num-experts", "2"], ["--num-experts", "2", "--moe-topk", "2"], "model.moe_topk", 2),
    "gtp_align": ([], ["--gtp-align", "8"], "model.gtp_align", 8),
    "seed": ([], ["--seed", "7"], "model.seed", 7),
    "bf16": ([], ["--bf16"], "param_dtype", torch.bfloat16),
    "micro_batch": ([], ["--micro-batch", "3"], "micro_batch", 3),
    "lr": ([], ["--lr", "0.002"], "adam.lr", 0.002),
    "weight_decay": ([], ["--weight-decay", "0.1"], "adam.weight_decay", 0.1),
    "clip_grad": ([], ["--clip-grad", "0.5"], "adam.clip_grad", 0.5),
    "bucket_size": ([], ["--bucket-size", "1000"], "bucket_size", 1000),
    "no_gather_prefetch": ([], ["--no-gather-prefetch"], "prefetch", False),
    "no_overlap_grad_reduce": ([], ["--no-overlap-grad-reduce"], "overlap_grad_reduce", False),
    "data_path": ([], ["--data-path", "d/x"], "data.path", "d/x"),
    "data_dtype": ([], ["--data-dtype", "uint32"], "data.flat_dtype", "uint32"),
    "split": ([], ["--split", "9,1"], "data.split", "9,1"),
    "data_seed": ([], ["--data-seed", "9"], "data.seed", 9),
    "lr_warmup_iters": ([], ["--lr-warmup-iters", "2"], "lr.warmup_iters", 2),
    "lr_decay_style": ([], ["--lr-decay-style", "linear"], "lr.decay_style", "linear"),
    "lr_decay_iters": ([], ["--lr-decay-iters", "9"], "lr.decay_iters", 9),
    "min_lr": ([], ["--min-lr", "1e-4"], "lr.min_lr", 1e-4),
    "fused": ([], ["--fused", "compile"], "fused", "compile"),
    "optimizer": ([], ["--optimizer", "muon"], "optimizer", "muon"),
    "muon_lr": ([], ["--muon-lr", "0.03"], "muon.lr", 0.03),
    "muon_momentum": ([], ["--muon-momentum", "0.9"], "muon.momentum", 0.9),
}

# Flags that steer the run rather than the config, the value that must leave resolve() unchanged,
# and the test that observes their effect.
RUN_FLAGS = {
    "device": ["--device", "cpu"],  # test_parity: "device=cpu" in the header of cp2-g1-dp1-fold
    "steps": ["--steps", "2"],  # test_parity: number of rows
    "check_reference": ["--check-reference"],  # test_parity: PASSED/FAILED verdict and ref columns
    "reference_tol": ["--reference-tol", "0.1"],  # test_parity: bf16 run passes at bf16 tolerance
    "reference_param_tol": ["--reference-param-tol", "1e-12"],  # test_parity: exit 1 naming a param
    "log_json": ["--log-json", "x.json"],  # test_parity: every run's rows come from it
    "save": ["--save", "ckpt"],  # test_launcher_checkpoint: iter folders appear
    "save_interval": ["--save-interval", "2"],  # test_launcher_checkpoint: iter 2 and 4 saved
    "load": ["--load", "ckpt"],  # test_launcher_checkpoint: resumed rows equal the uninterrupted ones
    "ckpt_layout": ["--ckpt-layout", "safetensors"],  # test_launcher_checkpoint (torch_dist)
    "optimizer_sharding": ["--optimizer-sharding", "fully_reshardable"],  # test_launcher_checkpoint: refused
    "eval_interval": ["--eval-interval", "2"],  # test_data_launcher: valid_loss on rows 2, 4, 6
    "eval_iters": ["--eval-iters", "3"],  # test_data_launcher: the eval loop reads it (runs use 1)
    "global_batch_size": ["--global-batch-size", "2"],  # test_config: a mismatch is refused before any rank
    "async_save": ["--async-save"],  # test_async_save: saves return first, same files as a sync save
    # test_async_save: a cap too small is refused; without --async-save it is refused (test_config)
    "async_save_staging": ["--async-save", "--async-save-staging", "1GiB"],
    "no_check_lineage": ["--no-check-lineage"],  # test_lineage: a refused resume goes on with it
}


def actions():
    return [a for a in train.build_parser()._actions if a.option_strings]


def resolved(argv: list[str]):
    cfg, _ = train.resolve(train.build_parser().parse_args(argv), None)
    return cfg


def field(cfg, path: str):
    for part in path.split("."):
        cfg = getattr(cfg, part)
    return cfg


def test_every_flag_is_in_an_executed_command_line():
    used = {tok for argv in lc.executed_argvs() for tok in argv if tok.startswith("-")}
    missing = [a.option_strings for a in actions() if not used.intersection(a.option_strings)]
    assert not missing, f"flags no test runs: {missing}"


def test_executed_command_lines_parse():
    """Every argv the suite runs is a valid command line for the current parser (no stale flag)."""
    parser = train.build_parser()
    for argv in lc.executed_argvs():
        if argv not in (lc.HELP, lc.VERSION):
            parser.parse_args(argv)


def test_every_flag_is_classified():
    dests = {a.dest for a in actions()} - {"help", "version"}
    assert dests == set(CONFIG_FLAGS) | set(RUN_FLAGS)
    assert not set(CONFIG_FLAGS) & set(RUN_FLAGS)


@pytest.mark.parametrize("dest", sorted(CONFIG_FLAGS))
def test_resolve_consumes_config_flag(dest):
    base, argv, path, value = CONFIG_FLAGS[dest]
    before, after = resolved(base), resolved(argv)
    assert field(after, path) == value
    assert field(before, path) != value
    assert after != before


@pytest.mark.parametrize("dest", sorted(RUN_FLAGS))
def test_run_flag_leaves_config_alone_and_is_read(dest):
    assert resolved(RUN_FLAGS[dest]) == resolved([])
    assert train.build_parser().parse_args(RUN_FLAGS[dest]) != train.build_parser().parse_args([])
    assert dest in _args_reads(skip={"resolve"})


def _args_reads(skip: set[str]) -> set[str]:
    """Attributes read as ``args.<name>`` in train.py, outside the functions in ``skip``."""
    tree = ast.parse(inspect.getsource(train))
    out: set[str] = set()
    for fn in ast.walk(tree):
        if isinstance(fn, ast.FunctionDef) and fn.name not in skip:
            for node in ast.walk(fn):
                if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "args":
                    out.add(node.attr)
    return out


def test_every_args_attribute_read_is_registered():
    """Reading ``args.x`` for a flag nobody registered fails only at run time; catch it here."""
    dests = {a.dest for a in actions()}
    assert _args_reads(skip=set()) <= dests


def test_fused_auto_is_compile_on_cuda_and_none_on_cpu(monkeypatch):
    """``--fused auto`` (the default): the compiled regions where the ranks run on CUDA, the exact
    unfused fp32 path on CPU; ``--fused none`` is unfused everywhere."""
    assert resolved([]).fused is None and resolved(["--device", "cpu"]).fused is None
    assert resolved(["--fused", "none", "--device", "cuda"]).fused is None
    assert resolved(["--device", "cuda"]).fused == "compile"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolved([]).fused == "compile" and resolved(["--device", "cpu"]).fused is None
