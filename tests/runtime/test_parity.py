"""Distributed runs through the launcher (real gloo ranks) against the fp32 reference.

Each configuration in ``launcher_cases`` is launched once per session, as a subprocess, and its
``--log-json`` is checked here. The 8-rank runs carry ``@pytest.mark.slow`` for selection only.
"""

from __future__ import annotations

import math
import re
import socket
from pathlib import Path

import launcher_cases as lc
import pytest
import torch
from fake_groups import fake_groups

from gtp_format.layout.config import ModelConfig, ParallelConfig
from gtp_format.layout.shard import ShardSpec
from gtp_runtime.buffers import build_buffers
from gtp_runtime.model import GPTModel
from gtp_runtime.parity import check_against_reference, relative_error
from gtp_runtime.reference import param_names, param_shape
from gtp_runtime.train import build_parser, resolve
from gtp_runtime.training import TrainConfig, Trainer

REL = 1e-5
_DENSE_COLUMN = ("linear_qkv.weight", "linear_fc1.weight", "output_layer.weight")
_DENSE_ROW = ("linear_proj.weight", "linear_fc2.weight")


def config_of(argv: list[str]) -> TrainConfig:
    cfg, _ = resolve(build_parser().parse_args(argv), None)
    return cfg


def expected_dense_bytes(cfg: TrainConfig) -> int:
    """Per-rank bytes of dense GTP weight shards plus their fp32 grads, from ShardSpec alone.

    Dense GTP weights are the non-expert linears and the output layer; each shard is
    ``padded_rows / weight_group_size`` rows of the TP-local weight. All shards have the same
    size, so any rank's answer is every rank's answer.
    """
    par, m = cfg.par, cfg.model
    param_bytes = torch.empty((), dtype=cfg.param_dtype).element_size()
    total = 0
    for name in param_names(m):
        if ".experts." in name or not name.endswith(_DENSE_COLUMN + _DENSE_ROW):
            continue
        mode = "row" if name.endswith(_DENSE_ROW) else "column"
        spec = ShardSpec(param_shape(m, name), mode, par.tp, 0, "weight", par.weight_group_size, 0, m.gtp_align)
        total += math.prod(spec.local_shape) * (param_bytes + 4)
    return total


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def launch(tmp_path_factory):
    """``launch(name)`` runs the named case once per session and returns its RunResult."""
    done: dict[str, lc.RunResult] = {}
    tmp = tmp_path_factory.mktemp("runs")

    def get(name: str) -> lc.RunResult:
        if name not in done:
            log = tmp / f"{name}.json"
            if name in lc.PARITY:
                cmd = [*lc.LAUNCHER, *lc.PARITY[name], *lc.PARITY_ARGS]
            elif name in lc.OTHER_RUNS:
                cmd = [*lc.LAUNCHER, *lc.OTHER_RUNS[name][0]]
            else:
                tr_args, argv = lc.TORCHRUN_RUNS[name]
                cmd = [lc.TORCHRUN, *tr_args, "--master-port", str(free_port()), "-m", "gtp_runtime.train", *argv]
            done[name] = lc.run(name, cmd, log)
        return done[name]

    return get


def assert_matches_reference(res: lc.RunResult, steps: int, rel: float = REL) -> list[dict]:
    assert res.returncode == 0, res.explain()
    assert "reference check PASSED" in res.stdout, res.explain()
    log = res.log
    assert log is not None and log["exit_code"] == 0
    rows = log["rows"]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for r in rows:
        assert math.isfinite(r["loss"])
        assert abs(r["loss"] - r["ref_loss"]) <= rel * abs(r["ref_loss"]), r
        assert abs(r["grad_norm"] - r["ref_grad_norm"]) <= rel * r["ref_grad_norm"], r
        assert r["worst"]["error"] <= 1.0, r
    return rows


def parity_params():
    return [pytest.param(n, marks=pytest.mark.slow) if n in lc.EIGHT_RANK else n for n in lc.PARITY]


@pytest.mark.parametrize("name", parity_params())
def test_parity_against_reference(launch, name):
    argv = lc.PARITY[name]
    cfg = config_of(argv)
    res = launch(name)
    rows = assert_matches_reference(res, steps=5)
    # The exactly-once rule: zero counts over the world equal the reference's, at every step, up to
    # reference elements within tolerance of zero (reduction order can make those exactly zero).
    assert all(abs(r["zeros"] - r["ref_zeros"]) <= r["ref_near_zeros"] for r in rows), rows
    assert rows[-1]["loss"] < rows[0]["loss"], rows
    # The launcher ran the topology the flags describe, and holds the padding-exact dense bytes.
    assert res.log["config"] == cfg.par.to_dict()
    assert res.log["dense_weight_grad_bytes"] == expected_dense_bytes(cfg)
    assert f"world={cfg.par.world_size}" in res.stdout
    if "--device" in argv:
        assert "device=cpu" in res.stdout
    # Per-rank peak RSS from every worker, each above its pre-model peak.
    rss, start = res.log["max_rss_kb"], res.log["start_rss_kb"]
    assert len(rss) == len(start) == cfg.par.world_size
    assert all(0 < s <= m for s, m in zip(start, rss, strict=True))


def test_small_buckets_case_really_has_several_buckets():
    """The bucket case must exercise multi-bucket buffers, or it tests nothing new."""
    cfg = config_of(lc.PARITY["cp2-dp2-nofold-buckets"])
    groups = fake_groups(cfg.par, 0)
    bufs = build_buffers(GPTModel(cfg.model, cfg.par, groups), groups, cfg.bucket_size)
    assert sum(len(b.buckets) for b in bufs) >= 8
    assert all(len(b.buckets) >= 2 for b in bufs)


def test_moe_case_folds_dense_but_not_experts():
    cfg = config_of(lc.PARITY["moe-cp2-dp2-fold"])
    groups = fake_groups(cfg.par, 0)
    bufs = build_buffers(GPTModel(cfg.model, cfg.par, groups), groups, cfg.bucket_size)
    kinds = {(b.key.is_expert, b.key.excludes_cp): b.dp_kind for b in bufs}
    assert kinds == {(False, True): "dp", (False, False): "dp_cp", (True, False): "expert_dp"}


@pytest.mark.slow
def test_folding_divides_dense_bytes_by_cp(launch):
    """Same 8 ranks, fold vs no fold: dense weight+grad bytes per rank drop to 1/CP up to padding."""
    fold, nofold = launch("cp2-g2-dp2-fold"), launch("cp2-g2-dp2-nofold")
    assert fold.returncode == 0 and nofold.returncode == 0, fold.explain() + nofold.explain()
    cfg_f, cfg_n = config_of(lc.PARITY["cp2-g2-dp2-fold"]), config_of(lc.PARITY["cp2-g2-dp2-nofold"])
    got_f, got_n = fold.log["dense_weight_grad_bytes"], nofold.log["dense_weight_grad_bytes"]
    assert (got_f, got_n) == (expected_dense_bytes(cfg_f), expected_dense_bytes(cfg_n))
    # Unpadded, folding divides by CP exactly; the tail padding to align*group rows (64 rows
    # folded, 32 unfolded for hidden 48 / ffn 80) is what keeps the ratio above 1/CP here.
    unpadded = sum(math.prod(param_shape(cfg_f.model, n)) for n in param_names(cfg_f.model)
                   if n.endswith(_DENSE_COLUMN + _DENSE_ROW)) * 8
    assert got_n >= unpadded // 2 and got_f >= unpadded // 4
    assert 1 / cfg_f.par.cp < got_f / got_n < 0.65


def test_folding_divides_dense_bytes_by_cp_exactly_without_padding(launch):
    """2 ranks, default model (every dense dim a multiple of align*group): exactly 1/CP."""
    fold, nofold = launch("cp2-g1-dp1-fold"), launch("train-only-nofold")
    assert fold.returncode == 0 and nofold.returncode == 0, fold.explain() + nofold.explain()
    got_f, got_n = fold.log["dense_weight_grad_bytes"], nofold.log["dense_weight_grad_bytes"]
    assert got_f * 2 == got_n
    assert got_n == expected_dense_bytes(config_of(lc.OTHER_RUNS["train-only-nofold"][0]))


def test_train_step_path_matches_reference_losses(launch):
    """Plain training (no reference beside it) reproduces the reference losses of the same model."""
    res, ref = launch("train-only-nofold"), launch("cp2-g1-dp1-fold")
    assert res.returncode == 0, res.explain()
    rows, ref_rows = res.log["rows"], ref.log["rows"]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    for r, q in zip(rows, ref_rows, strict=True):
        assert r["seconds"] > 0
        assert abs(r["loss"] - q["ref_loss"]) <= REL * q["ref_loss"], (r, q)
        assert abs(r["grad_norm"] - q["ref_grad_norm"]) <= REL * q["ref_grad_norm"], (r, q)
        assert abs(r["num_zeros"] - q["ref_zeros"]) <= q["ref_near_zeros"]
    assert rows[-1]["loss"] < rows[0]["loss"]


_FAILED = re.compile(r"reference check FAILED: worst error (\S+)x its tolerance \((param@\d+), ([\w.]+)\)")


def test_checker_fails_on_tiny_param_tolerance(launch):
    res = launch("tiny-param-tol")
    assert res.returncode == 1, res.explain()
    m = _FAILED.search(res.stdout)
    assert m, res.explain()
    assert float(m.group(1)) > 1.0
    cfg = config_of(lc.OTHER_RUNS["tiny-param-tol"][0])
    assert m.group(3) in param_names(cfg.model)
    assert res.log["exit_code"] == 1
    assert res.log["rows"][-1]["worst"]["name"] in param_names(cfg.model)


def test_torchrun_launch(launch):
    res = launch("torchrun-cp2-fold")
    rows = assert_matches_reference(res, steps=2)
    assert all(abs(r["zeros"] - r["ref_zeros"]) <= r["ref_near_zeros"] for r in rows)
    assert res.log["config"] == ParallelConfig(cp=2, fold_cp=True).to_dict()


def test_bf16_trains_within_bf16_tolerance(launch):
    res = launch("bf16")
    rows = assert_matches_reference(res, steps=5, rel=5e-3)  # bf16 rounding: ~1e-3 on losses and norms
    losses = [r["loss"] for r in rows]
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0] and min(losses[2:]) < min(losses[:2])
    # bf16 rounding may flip a tiny gradient to exactly 0; counts stay within a handful.
    assert all(abs(r["zeros"] - r["ref_zeros"]) <= min(r["ref_near_zeros"], 1e-3 * r["ref_zeros"]) for r in rows)
    # bf16 params (2 bytes) with fp32 main grads (4 bytes).
    cfg = config_of(lc.OTHER_RUNS["bf16"][0])
    assert cfg.param_dtype == torch.bfloat16
    assert res.log["dense_weight_grad_bytes"] == expected_dense_bytes(cfg)


# -- the checker itself, in-process on a world of one ---------------------------------------------


@pytest.fixture
def world_of_one(tmp_path: Path):
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _tiny_trainer() -> Trainer:
    model = ModelConfig(hidden=32, num_layers=1, num_heads=2, ffn_hidden=64, seq_length=16)
    return Trainer(TrainConfig(par=ParallelConfig(), model=model))


def test_checker_passes_and_fails_on_zero_count(world_of_one, monkeypatch):
    """A zero count off by more than the reference's near-zero elements must fail the check.

    (A flat mismatch used to score exactly 1.0x tol, which passed.)"""
    rows, worst = check_against_reference(_tiny_trainer(), 1, 1e-5, 1e-3)
    assert worst.error <= 1.0 and rows[0]["zeros"] == rows[0]["ref_zeros"]
    slack = rows[0]["ref_near_zeros"]

    for extra, fails in ((slack, False), (slack + 1, True)):
        trainer = _tiny_trainer()
        real = trainer.optimizer.grad_stats

        def miscounted(real=real, extra=extra):
            s = real()
            s.num_zeros += extra
            return s

        monkeypatch.setattr(trainer.optimizer, "grad_stats", miscounted)
        rows, worst = check_against_reference(trainer, 1, 1e-5, 1e-3)
        assert rows[0]["zeros"] == rows[0]["ref_zeros"] + extra
        assert (worst.error > 1.0) == fails
        if fails:
            assert worst.what == "zeros@1"


def test_relative_error_of_an_all_padding_shard():
    """A shard that is entirely tail padding compares zero rows: no error, no crash."""
    assert relative_error(torch.empty(0, 4), torch.empty(0, 4)) == 0.0
    assert relative_error(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.5])) == pytest.approx(0.2)
