"""Every launcher command line the test suite executes, in one place.

``test_parity.py`` and ``test_config.py`` run exactly these argv lists (they parametrize over the
dicts below), and ``test_launcher_flags.py`` checks that together they use every option
``gtp_runtime.train.build_parser()`` registers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LAUNCHER = [sys.executable, "-m", "gtp_runtime.train"]
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))

# Distributed runs compared against the fp32 reference (``--check-reference --steps 5``). Model
# flags vary across cases so that each option changes a run that is actually checked.
# The 8-rank fold/nofold pair uses hidden 48 / ffn 80: rows that are not multiples of
# align*group, so shards carry tail padding (some shards are all padding) and the memory ratio
# is not exactly 1/CP.
PADDED_MODEL = ["--hidden", "48", "--ffn-hidden", "80"]
PARITY = {
    "cp2-g1-dp1-fold": ["--nproc-per-node", "2", "--cp", "2", "--fold-cp", "--seed", "7", "--device", "cpu"],
    # Synchronous weight gathers (no prefetch of the neighbour's all-gather).
    "cp2-g1-dp2-fold": ["--nproc-per-node", "4", "--cp", "2", "--dp", "2", "--fold-cp", "--micro-batch", "1",
                        "--lr", "2e-3", "--no-gather-prefetch"],
    "cp2-g2-dp2-fold": ["--nproc-per-node", "8", "--cp", "2", "--gtp-remat", "2", "--dp", "2", "--fold-cp",
                        *PADDED_MODEL],
    "cp2-g2-dp2-nofold": ["--nproc-per-node", "8", "--cp", "2", "--gtp-remat", "2", "--dp", "2", *PADDED_MODEL],
    # Weight-gradient reduce-scatters completed inside backward (not overlapped up to the step).
    "tp2-cp2-g1-fold": ["--nproc-per-node", "4", "--tp", "2", "--cp", "2", "--fold-cp", "--num-heads", "2",
                        "--vocab-size", "128", "--weight-decay", "0.1", "--no-overlap-grad-reduce"],
    # Dense weights fold over cp (weight group = cp at g=1); experts shard over their own group of 2.
    "moe-cp2-dp2-fold": ["--nproc-per-node", "4", "--cp", "2", "--dp", "2", "--fold-cp", "--num-experts", "4",
                         "--moe-topk", "2", "--expert-gtp-remat", "2", "--num-layers", "2", "--gtp-align", "8"],
    # Small buckets: every large param gets its own bucket, each padded to the dp_cp size.
    "cp2-dp2-nofold-buckets": ["--nproc-per-node", "4", "--cp", "2", "--dp", "2", "--bucket-size", "2000",
                               "--clip-grad", "0.5", "--seq-length", "64"],
    # Fused regions (eager on CPU: the same functions torch.compile fuses on CUDA) and the chunked
    # linear cross-entropy, folded: the weight gradient of the output layer takes the
    # reduce-scatter path.
    "cp2-g1-fold-fused": ["--nproc-per-node", "2", "--cp", "2", "--fold-cp", "--fused", "compile", "--seed", "5"],
    "tp2-cp2-g2-fold": ["--nproc-per-node", "8", "--tp", "2", "--cp", "2", "--gtp-remat", "2", "--fold-cp"],
    # Muon (issue 16): whole-matrix Newton-Schulz on an owner rank, momentum shards gathered from
    # every rank of tp x weight group x buffer DP. Folded and unfolded with tail padding (unfolded
    # under a warmup + cosine schedule, which scales Muon's rate by AdamW's factor); then TP2, MoE
    # (experts never fold) and gtp_remat 1 with fold in one 8-rank run.
    "muon-cp2-g2-dp2-fold": ["--nproc-per-node", "8", "--cp", "2", "--gtp-remat", "2", "--dp", "2", "--fold-cp",
                             "--optimizer", "muon", *PADDED_MODEL],
    "muon-cp2-g2-dp2-nofold": ["--nproc-per-node", "8", "--cp", "2", "--gtp-remat", "2", "--dp", "2",
                               "--optimizer", "muon", "--muon-lr", "0.03", "--lr-warmup-iters", "2",
                               "--lr-decay-style", "cosine", "--lr-decay-iters", "5", "--min-lr", "1e-4",
                               *PADDED_MODEL],
    "muon-tp2-cp2-g1-dp2-fold-moe": ["--nproc-per-node", "8", "--tp", "2", "--cp", "2", "--dp", "2", "--fold-cp",
                                     "--optimizer", "muon", "--muon-momentum", "0.9", "--num-experts", "2",
                                     "--expert-gtp-remat", "2", "--num-heads", "2", "--gtp-align", "8"],
}
PARITY_ARGS = ["--check-reference", "--steps", "5"]
EIGHT_RANK = {name for name, argv in PARITY.items() if argv[1] == "8"}

# Other distributed runs, each with the exit code it must give.
OTHER_RUNS = {
    # The checker can fail: a parameter tolerance no fp32 run meets. Exit 1, worst param named.
    "tiny-param-tol": (["--nproc-per-node", "2", "--cp", "2", "--fold-cp", "--steps", "2", "--check-reference",
                        "--reference-param-tol", "1e-12"], 1),
    # bf16 params (fp32 grads and master state) against the fp32 reference, at bf16 tolerances.
    "bf16": (["--nproc-per-node", "2", "--cp", "2", "--fold-cp", "--bf16", "--steps", "5", "--check-reference",
              "--reference-tol", "1e-2", "--reference-param-tol", "0.25"], 0),
    # Plain training (Trainer.train_step), no reference beside it; same model as cp2-g1-dp1-fold.
    "train-only-nofold": (["--nproc-per-node", "2", "--cp", "2", "--seed", "7", "--steps", "5"], 0),
}

# Checkpoint flags through the launcher (test_launcher_checkpoint.py). ``{ckpt}`` is replaced by a
# per-session folder. The save run trains 4 steps saving at 2 and 4; the load run resumes at 2.
CKPT_MODEL = ["--nproc-per-node", "2", "--cp", "2", "--fold-cp"]
CHECKPOINT_RUNS = {
    "save": ([*CKPT_MODEL, "--steps", "4", "--save", "{ckpt}", "--save-interval", "2", "--ckpt-layout",
              "torch_dist", "--optimizer-sharding", "dp_reshardable"], 0),
    "load": ([*CKPT_MODEL, "--steps", "4", "--load", "{ckpt}/iter_0000002"], 0),
    # A gather-everything format with a folded buffer mixes CP peers' shards: refused, naming the fix.
    "refuse-fully-reshardable": ([*CKPT_MODEL, "--steps", "1", "--save", "{ckpt}-refused", "--optimizer-sharding",
                                  "fully_reshardable"], 2),
}

# Muon checkpoints (test_muon_checkpoint.py), in order: save at 2 and 4, resume at 2, load refused
# as Adam, a gather-everything format refused with a folded buffer, then (after `ckpt reshard` to
# dp 1 into ``{resharded}``) resume at the new DP size.
MUON_MODEL = ["--nproc-per-node", "4", "--cp", "2", "--dp", "2", "--fold-cp", "--optimizer", "muon",
              "--bucket-size", "3000"]
MUON_CHECKPOINT_RUNS = {
    "save": ([*MUON_MODEL, "--steps", "4", "--save", "{ckpt}", "--save-interval", "2"], 0),
    "load": ([*MUON_MODEL, "--steps", "4", "--load", "{ckpt}/iter_0000002"], 0),
    "load-as-adam": ([*MUON_MODEL[:-4], *MUON_MODEL[-2:], "--steps", "4", "--load", "{ckpt}"], 2),
    "refuse-dp-zero-gather-scatter": ([*MUON_MODEL, "--steps", "1", "--save", "{ckpt}-refused",
                                       "--optimizer-sharding", "dp_zero_gather_scatter"], 2),
}
MUON_RESHARDED_LOAD = (["--nproc-per-node", "2", "--cp", "2", "--dp", "1", "--fold-cp", "--optimizer", "muon",
                        "--bucket-size", "3000", "--steps", "4", "--load", "{resharded}"], 0)

# ``--load`` of a damaged copy of fixtures/gtp/fold_cp2_g2_dp2 (test_load_refusals.py): refused by
# the launcher before any rank starts. The flags are the fixture's model and topology.
FIXTURE_MODEL = ["--nproc-per-node", "8", "--cp", "2", "--gtp-remat", "2", "--dp", "2", "--fold-cp", "--hidden", "32",
                 "--num-layers", "2", "--num-heads", "4", "--ffn-hidden", "64", "--seq-length", "16",
                 "--vocab-size", "128", "--bucket-size", "4000", "--micro-batch", "1", "--device", "cpu"]
LOAD_REFUSED = [*FIXTURE_MODEL, "--steps", "3", "--load", "{ckpt}"]

# A rank that crashes (GTP_FAULT_INJECT=before_write:1:raise) under the launcher and under torchrun
# (test_launcher_failures.py): one line naming rank 1, its traceback in its log file.
CRASH_RUN = [*CKPT_MODEL, "--steps", "1", "--save", "{ckpt}"]
CRASH_ENV = {"GTP_FAULT_INJECT": "before_write:1:raise"}

# Data and schedule runs (test_data_launcher.py). ``{ckpt}`` and ``{flat}`` are replaced by per-test
# paths; ``{flat}`` is a flat uint16 token file of real text. The save run trains 6 steps saving at 3
# and 6; the load run resumes at 3 and must give the same rows, bit for bit.
SCHEDULE = ["--lr-warmup-iters", "2", "--lr-decay-style", "cosine", "--lr-decay-iters", "6", "--min-lr", "1e-4"]
FLAT_DATA = ["--data-path", "{flat}", "--data-dtype", "uint16", "--split", "9,1", "--data-seed", "3",
             "--eval-interval", "2", "--eval-iters", "1"]
DATA_RUNS = {
    # A warmup + linear decay schedule, distributed against the fp32 reference fed the same lr.
    "schedule-reference": (["--nproc-per-node", "2", "--cp", "2", "--fold-cp", "--steps", "5", "--check-reference",
                            "--lr", "3e-3", "--lr-warmup-iters", "2", "--lr-decay-style", "linear",
                            "--lr-decay-iters", "4", "--min-lr", "1e-4"], 0),
    # A dataset written by genuine megatron-core, 4 ranks (2 lanes), against the reference.
    "megatron-data-reference": (["--nproc-per-node", "4", "--cp", "2", "--dp", "2", "--fold-cp", "--data-path",
                                 "fixtures/megatron/indexed/bytes_uint8", "--seq-length", "16", "--split", "1,0",
                                 "--micro-batch", "1", "--steps", "3", "--check-reference"], 0),
    "flat-save": ([*CKPT_MODEL, *FLAT_DATA, *SCHEDULE, "--steps", "6", "--save", "{ckpt}", "--save-interval", "3"], 0),
    "flat-load": ([*CKPT_MODEL, *FLAT_DATA, *SCHEDULE, "--steps", "6", "--load", "{ckpt}/iter_0000003"], 0),
    # Resuming on another data order would not continue the run: refused, naming the flags.
    "flat-load-other-seed": ([*CKPT_MODEL, *FLAT_DATA[:-6], "--data-seed", "4", *SCHEDULE, "--steps", "6",
                              "--load", "{ckpt}/iter_0000003"], 2),
    # Token ids past --vocab-size (uint16 ids up to 50,000): one line, exit 2.
    "vocab-too-small": ([*CKPT_MODEL, "--data-path", "fixtures/megatron/indexed/tokens_uint16", "--seq-length", "8",
                         "--steps", "1"], 2),
}

# Runs started by torchrun (``--master-port`` is added at run time); the launcher runs as one rank.
TORCHRUN_RUNS = {
    "torchrun-cp2-fold": (["--nproc-per-node", "2"], ["--cp", "2", "--fold-cp", "--steps", "2", "--check-reference"]),
}

# Launches refused before any rank starts: (argv, exit code, words the one-line error must contain).
CLI_ERRORS = {
    "world-size-mismatch": (["--nproc-per-node", "4", "--cp", "2", "--dp", "1"],
                            ["world size 4 != tp*cp*gtp_remat*dp", "launch 2 ranks"]),
    "fold-without-cp": (["--fold-cp"], ["--fold-cp needs --cp > 1", "drop --fold-cp"]),
    "average-with-gtp": (["--cp", "2", "--gtp-remat", "2", "--average-in-collective"],
                         ["GTP_remat is active", "drop --average-in-collective"]),
    "average-with-fold-at-g1": (["--cp", "2", "--fold-cp", "--average-in-collective"],
                                ["fold_cp at gtp_remat=1", "CP group", "drop --average-in-collective"]),
    "seq-not-multiple-of-2cp": (["--cp", "3", "--seq-length", "32"], ["--seq-length 32", "2*cp = 6"]),
    "heads-not-multiple-of-tp": (["--tp", "3", "--num-heads", "4"], ["--num-heads 4 must be a multiple of --tp 3"]),
    "no-such-data": (["--data-path", "runs/no/such/prefix"], ["runs/no/such/prefix", "check --data-path"]),
    "bad-split": (["--split", "0,1"], ["--split '0,1'", "train > 0"]),
    "decay-inside-warmup": (["--lr-decay-style", "linear", "--lr-warmup-iters", "5", "--lr-decay-iters", "5"],
                            ["--lr-decay-iters 5 must exceed --lr-warmup-iters 5"]),
    "eval-without-valid": (["--eval-interval", "2", "--split", "1,0"], ["needs a valid split"]),
    # Choices that used to fail only after the ranks started, or to write somewhere unexpected.
    "fully-reshardable-folded": (["--nproc-per-node", "2", "--cp", "2", "--fold-cp", "--optimizer-sharding",
                                  "fully_reshardable"], ["'fully_reshardable'", "CP-folded", "use 'dp_reshardable'"]),
    "global-batch-not-the-product": (["--nproc-per-node", "2", "--dp", "2", "--micro-batch-size", "2",
                                      "--global-batch-size", "8"], ["--global-batch-size 8 != micro-batch 2", "= 4"]),
    "async-save-to-another-scheme": (["--save", "gs://bucket/run", "--async-save"],
                                     ["--save 'gs://bucket/run'", "gs:// is not supported"]),
    "load-from-a-bad-bucket": (["--load", "s3://Bucket/run"], ["'Bucket' is not a bucket name"]),
    "save-to-a-one-slash-url": (["--save", "s3:/bucket/run"], ["two slashes", "./s3:/bucket/run"]),
    "save-to-another-scheme": (["--save", "gs://bucket/run"], ["gs:// is not supported"]),
}


HELP = ["--help"]  # test_config runs it: exit 0, usage and examples on stdout
# test_async_save resumes an async checkpoint with these (asynchronously again, within a staging cap)
ASYNC_SAVE = ["--async-save", "--async-save-staging", "1GiB"]
VERSION = ["--version"]  # test_cli_family runs it: exit 0, the version
# test_lineage resumes a folder that fails the lineage checks with this (refused without it)
LINEAGE_OVERRIDE = ["--no-check-lineage"]


@dataclass
class RunResult:
    name: str
    cmd: list[str]
    returncode: int
    stdout: str
    stderr: str
    log: dict | None

    def explain(self) -> str:
        head = f"{' '.join(self.cmd)}\nrc={self.returncode}"
        return f"{head}\n--- stdout\n{self.stdout}\n--- stderr\n{self.stderr[-4000:]}"


def env() -> dict[str, str]:
    e = dict(os.environ)
    e["PYTHONPATH"] = str(REPO) + os.pathsep + e.get("PYTHONPATH", "")
    e.setdefault("OMP_NUM_THREADS", "1")
    return e


def run(name: str, cmd: list[str], log_json: Path | None, timeout: float = 600) -> RunResult:
    if log_json is not None:
        cmd = [*cmd, "--log-json", str(log_json)]
    p = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=timeout)
    log = json.loads(log_json.read_text()) if log_json is not None and log_json.exists() else None
    return RunResult(name, cmd, p.returncode, p.stdout, p.stderr, log)


def executed_argvs() -> list[list[str]]:
    """Every launcher argv the suite runs (the part after ``-m gtp_runtime.train``)."""
    log = ["--log-json", "<tmp>/run.json"]  # test_parity passes it to every distributed run
    out = [[*argv, *PARITY_ARGS, *log] for argv in PARITY.values()]
    out += [[*argv, *log] for argv, _ in OTHER_RUNS.values()]
    out += [[*argv, *log] for _, argv in TORCHRUN_RUNS.values()]
    out += [[*argv, *log] for argv, _ in CHECKPOINT_RUNS.values()]
    out += [[*argv, *log] for argv, _ in [*MUON_CHECKPOINT_RUNS.values(), MUON_RESHARDED_LOAD]]
    out += [[*argv, *log] for argv, _ in DATA_RUNS.values()]
    out += [argv for argv, _ in CLI_ERRORS.values()]
    out += [LOAD_REFUSED, CRASH_RUN]
    out += [HELP, VERSION, ASYNC_SAVE, LINEAGE_OVERRIDE]
    return out
