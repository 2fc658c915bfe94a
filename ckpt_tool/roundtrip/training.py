"""``verify-roundtrip`` without PATH: train on local ranks, save, load in fresh processes, resume.

The default run is the shape the format exists for: 8 CPU ranks, tp1 cp2 gtp_remat2 dp2 with CP
folded, small buckets so every buffer has several, 3 steps, save, load, 2 more steps. Each rank
compares its own state after the load with what it held at save time, and after resuming with
an uninterrupted run (:func:`gtp_runtime.roundtrip.resume_phase`); the parent collects the
per-rank summaries into rows.
"""

from __future__ import annotations

import os
import tempfile
import time

from ckpt_tool.roundtrip import jobs
from ckpt_tool.roundtrip.rows import Outcome, ProgressBars, no_progress, row
from gtp_format.errors import EXIT_CHECK_FAILED, FormatError
from gtp_format.layout.config import ConfigError, ModelConfig, ParallelConfig, infer_dp
from gtp_format.work import sigterm_raises
from gtp_runtime.lr_schedule import LRConfig
from gtp_runtime.optimizer import AdamConfig
from gtp_runtime.training import TrainConfig

DEFAULT_STEPS = 3
DEFAULT_RESUME_STEPS = 2
SELF_TEST_BUCKET_SIZE = 10_000  # small buckets, so the self-test's tiny model spans several
DEFAULT_TOPOLOGY = {"tp": 1, "cp": 2, "gtp_remat": 2, "dp": 2}


def train_config(tp: int | None = None, cp: int | None = None, gtp_remat: int | None = None, dp: int | None = None,
                 fold_cp: bool | None = None, nproc: int | None = None,
                 bucket_size: int = SELF_TEST_BUCKET_SIZE, optimizer: str = "adam") -> tuple[TrainConfig, int]:
    """The run's config and world size: the launcher's model and optimizer defaults, sizes given or
    :data:`DEFAULT_TOPOLOGY` (``dp`` from ``nproc`` when only that is given), folded unless
    ``fold_cp`` is False; ``optimizer`` ``adam`` or ``muon`` (the launcher's ``--optimizer``). Refusals
    are the launcher's :class:`ConfigError` lines."""
    tp = DEFAULT_TOPOLOGY["tp"] if tp is None else tp
    cp = DEFAULT_TOPOLOGY["cp"] if cp is None else cp
    gtp_remat = DEFAULT_TOPOLOGY["gtp_remat"] if gtp_remat is None else gtp_remat
    if dp is None:
        dp = DEFAULT_TOPOLOGY["dp"] if nproc is None else infer_dp(tp, cp, gtp_remat, nproc)
    par = ParallelConfig(tp=tp, cp=cp, gtp_remat=gtp_remat, dp=dp, fold_cp=fold_cp is None or fold_cp)
    world = nproc or par.world_size
    par.validate(world)
    model = ModelConfig()
    model.validate(par)
    if optimizer not in ("adam", "muon"):
        raise ConfigError(f"--optimizer {optimizer!r} is not one of adam, muon")
    # The launcher's default schedule (constant at --lr) and data (the stdlib corpus), spelled out as
    # the launcher spells them, so that both build the same config.
    adam = AdamConfig()
    return TrainConfig(par=par, model=model, adam=adam, bucket_size=bucket_size, optimizer=optimizer,
                       lr=LRConfig(max_lr=adam.lr)), world


def run(cfg: TrainConfig, world: int, layout: str = "torch_dist", steps: int = DEFAULT_STEPS,
        more: int = DEFAULT_RESUME_STEPS, progress: ProgressBars = no_progress) -> Outcome:
    """Train ``steps``, save, load in fresh ranks, resume ``more`` steps; raises :class:`FormatError`
    (exit 1) naming the failing rank when a rank fails."""
    from gtp_runtime import launch

    seconds: dict[str, float] = {}
    t_start = time.perf_counter()
    with sigterm_raises(), tempfile.TemporaryDirectory(prefix="ckpt-roundtrip-") as tmp, \
            progress(2, "round trip", "phases") as advance:  # SIGTERM removes tmp, as an error does
        root, dump = os.path.join(tmp, "checkpoints"), os.path.join(tmp, "dump")
        os.makedirs(dump)
        phase = "training and saving"
        try:
            t0 = time.perf_counter()
            launch.run_local_ranks(world, jobs.save_job, (cfg, root, dump, steps, more, layout), tmp, "save")
            seconds["train+save"] = time.perf_counter() - t0
            advance(1)
            phase = "loading in fresh processes and resuming"
            t0 = time.perf_counter()
            reports = launch.run_local_ranks(world, jobs.resume_job, (cfg, root, dump), tmp, "resume")
            seconds["load+resume"] = time.perf_counter() - t0
            advance(1)
        except launch.LaunchError as e:
            raise FormatError(str(e)) from None
        except launch.RankFailure as e:
            raise FormatError(f"round trip failed while {phase} ({cfg.par.describe()}, {world} ranks): {e}",
                              EXIT_CHECK_FAILED) from None
    seconds["total"] = time.perf_counter() - t_start
    reports.sort(key=lambda r: r["rank"])
    checks = [row("optimizer state after load", r["rank"], [(r["rank"], r["loaded"]["optimizer"])])
              for r in reports]
    checks += [row("model params after load", r["rank"], [(r["rank"], r["loaded"]["model"])]) for r in reports]
    checks.append(row("resume losses", 0, [(0, reports[0]["resume"]["losses"])], "steps"))
    checks.append(row("resume grad norms", 0, [(0, reports[0]["resume"]["grad_norms"])], "steps"))
    checks.append(row("resume params", "all", [(r["rank"], r["resume"]["model"]) for r in reports]))
    checks.append(row("resume optimizer state", "all", [(r["rank"], r["resume"]["optimizer"]) for r in reports]))
    doc = {
        "mode": "train", "ok": all(c["ok"] for c in checks),
        "config": {"parallel": cfg.par.to_dict(), "world_size": world, "layout": layout, "steps": steps,
                   "resume_steps": more, "bucket_size": cfg.bucket_size, "micro_batch": cfg.micro_batch,
                   "param_dtype": str(cfg.param_dtype), "model": cfg.model.to_dict(), "optimizer": cfg.optimizer},
        "passed": sum(c["ok"] for c in checks), "failed": sum(not c["ok"] for c in checks),
        "resume_losses": reports[0]["losses"], "checks": checks,
        "seconds": {k: round(v, 3) for k, v in seconds.items()},
    }
    return Outcome(doc, f"verify-roundtrip: {cfg.par.describe()} on {world} ranks, {cfg.optimizer}, {layout}, {steps} "
                        f"steps, save, "
                        f"load in fresh processes, {more} more steps")
