"""Launcher: ``python -m gtp_runtime.train --nproc-per-node N --tp .. --cp .. --gtp-remat .. [--fold-cp]``.

Spawns N local ranks itself (gloo on CPU, NCCL when CUDA is there) or, when started by
``torchrun`` (``RANK``/``WORLD_SIZE`` in the environment), runs as that one rank. Trains on
``--data-path`` (a Megatron indexed dataset or a flat token file) or, by default, on the source
files of Python's standard library, and prints one line per step. ``--check-reference`` also runs the single-process
fp32 reference on the same global batches and exits 1, naming the worst parameter, if any
gradient, loss or parameter differs beyond tolerance.

A failing rank ends the run with one line on stderr naming it (``error: rank 3: ...``); its full
traceback is in its log file, whose path the line gives. ``--load`` opens and verifies the
checkpoint (the checks of ``ckpt verify``) before any rank starts, and refuses it in one line.

Every flag is parsed here and nowhere else, and every flag is exercised by a test through this
command line (upstream once read a flag that was never registered with its parser).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
from typing import Any

import torch
import torch.distributed as dist

from gtp_format.errors import FormatError
from gtp_format.layout.config import ConfigError, ModelConfig, ParallelConfig, infer_dp
from gtp_runtime.data.indexed import DataError
from gtp_runtime.data.source import DataConfig
from gtp_runtime.launch import RankFailure, run_local_ranks
from gtp_runtime.lr_schedule import LRConfig
from gtp_runtime.muon import MuonConfig
from gtp_runtime.optimizer import AdamConfig
from gtp_runtime.training import TrainConfig, Trainer

# Imported once by the fork server the ranks are forked from (see gtp_runtime.launch).
PRELOAD = ("torch", "torch.distributed", "gtp_runtime.training", "gtp_runtime.parity", "gtp_runtime.checkpoint.io")
COLLECTIVE_TIMEOUT_S = 1800.0  # torch's default process-group timeout; a dead peer is noticed sooner

EXAMPLES = """examples:
  python -m gtp_runtime.train --nproc-per-node 8 --cp 2 --gtp-remat 2 --dp 2 --fold-cp --steps 5
  python -m gtp_runtime.train --nproc-per-node 4 --tp 2 --cp 2 --fold-cp --check-reference
  python -m gtp_runtime.train --nproc-per-node 4 --cp 2 --dp 2 --fold-cp --optimizer muon --check-reference
  torchrun --nproc-per-node 2 -m gtp_runtime.train --cp 2 --fold-cp --steps 10
  python -m gtp_runtime.train --nproc-per-node 2 --cp 2 --fold-cp --data-path data/corpus --vocab-size 4096 \
      --steps 200 --lr 3e-4 --lr-warmup-iters 20 --lr-decay-style cosine --min-lr 3e-5 --eval-interval 50
"""


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m gtp_runtime.train", description=__doc__.split("\n\n")[1],
                                 epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = ap.add_argument_group("parallelism")
    g.add_argument("--nproc-per-node", type=int, default=None, help="ranks to spawn (default: tp*cp*gtp_remat*dp)")
    g.add_argument("--tp", type=int, default=1)
    g.add_argument("--cp", type=int, default=1)
    g.add_argument("--gtp-remat", type=int, default=1)
    g.add_argument("--dp", type=int, default=None, help="replicate degree (default: world / (tp*cp*gtp_remat))")
    g.add_argument("--fold-cp", action="store_true", help="shard dense weights over cp x gtp_remat (opt-in)")
    g.add_argument("--expert-gtp-remat", type=int, default=1)
    g.add_argument("--average-in-collective", action="store_true",
                   help="average inside the collective (refused with GTP_remat active)")
    g.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    m = ap.add_argument_group("model")
    m.add_argument("--vocab-size", type=int, default=256)
    m.add_argument("--hidden", type=int, default=64)
    m.add_argument("--num-layers", type=int, default=2)
    m.add_argument("--num-heads", type=int, default=4)
    m.add_argument("--ffn-hidden", type=int, default=128)
    m.add_argument("--seq-length", type=int, default=32)
    m.add_argument("--num-experts", type=int, default=0)
    m.add_argument("--moe-topk", type=int, default=1)
    m.add_argument("--gtp-align", type=int, default=16)
    m.add_argument("--seed", type=int, default=1234)
    m.add_argument("--bf16", action="store_true", help="bf16 params, fp32 grads and optimizer state")
    t = ap.add_argument_group("training")
    t.add_argument("--steps", type=int, default=5,
                   help="train until this iteration (Megatron's --train-iters; counts loaded iterations)")
    t.add_argument("--micro-batch", type=int, default=2)
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--weight-decay", type=float, default=0.01)
    t.add_argument("--clip-grad", type=float, default=1.0)
    t.add_argument("--optimizer", choices=("adam", "muon"), default="adam",
                   help="adam: AdamW everywhere; muon: Muon for the linears, AdamW for embeddings, output, norms")
    t.add_argument("--muon-lr", type=float, default=0.02,
                   help="Muon's peak learning rate (--lr is AdamW's; the --lr-* schedule scales both)")
    t.add_argument("--muon-momentum", type=float, default=0.95, help="Muon's (Nesterov) momentum")
    t.add_argument("--lr-warmup-iters", type=int, default=0, help="linear warmup from 0 to --lr over this many steps")
    t.add_argument("--lr-decay-style", choices=("constant", "linear", "cosine"), default="constant")
    t.add_argument("--lr-decay-iters", type=int, default=None, help="decay to --min-lr by this step (default --steps)")
    t.add_argument("--min-lr", type=float, default=0.0)
    t.add_argument("--eval-interval", type=int, default=0, help="validation loss every N steps (0: never)")
    t.add_argument("--eval-iters", type=int, default=2, help="validation batches per evaluation")
    t.add_argument("--bucket-size", type=int, default=40_000_000, help="elements per gradient bucket")
    t.add_argument("--no-gather-prefetch", action="store_true",
                   help="gather each GTP weight only when it is needed (no prefetch of the next one)")
    t.add_argument("--no-overlap-grad-reduce", action="store_true",
                   help="finish each weight-gradient reduce-scatter inside backward")
    t.add_argument("--fused", choices=("compile", "liger"), default=None,
                   help="fused element-wise kernels: torch.compile regions (eager off CUDA) or Liger-Kernel")
    t.add_argument("--check-reference", action="store_true", help="compare against the fp32 reference")
    t.add_argument("--reference-tol", type=float, default=1e-5,
                   help="max relative error of losses, grad norms and gradients vs the reference")
    t.add_argument("--reference-param-tol", type=float, default=1e-3,
                   help="max relative error of params after Adam steps vs the reference")
    d = ap.add_argument_group("data")
    d.add_argument("--data-path", default=None,
                   help="PREFIX of PREFIX.bin/.idx (Megatron) or a flat .bin of tokens (default: Python stdlib)")
    d.add_argument("--data-dtype", choices=("uint16", "uint32"), default="uint16", help="tokens of a flat .bin")
    d.add_argument("--split", default="98,2", help="train,valid document ratio (Megatron's --split)")
    d.add_argument("--data-seed", type=int, default=None, help="document/sample shuffle seed (default: --seed)")
    c = ap.add_argument_group("checkpointing")
    c.add_argument("--save", default=None, help="folder to save checkpoints under (iter_XXXXXXX/)")
    c.add_argument("--save-interval", type=int, default=None, help="save every K iterations (and at the end)")
    c.add_argument("--load", default=None, help="checkpoint folder, or its parent (follows latest)")
    c.add_argument("--ckpt-layout", choices=("torch_dist", "safetensors"), default="torch_dist")
    c.add_argument("--async-save", action="store_true",
                   help="return from a save once this rank's state is copied to host memory (pinned on CUDA) and "
                        "write the files in the background; the latest marker moves once every rank's are durable")
    c.add_argument("--async-save-staging", default=None, metavar="SIZE",
                   help="most host memory for --async-save's staging buffers, e.g. 24G (default: the rank's "
                        "checkpoint bytes); allocated once, reused by every save")
    c.add_argument("--optimizer-sharding", default="dp_reshardable",
                   choices=("dp_reshardable", "fully_reshardable", "dp_zero_gather_scatter"))
    t.add_argument("--log-json", default=None, help="write per-step rows and a summary to this file (rank 0)")
    return ap


def resolve(args: argparse.Namespace, world: int | None) -> tuple[TrainConfig, int]:
    """Turn parsed flags into a validated config and the world size."""
    if args.dp is None:
        args.dp = infer_dp(args.tp, args.cp, args.gtp_remat, world or args.nproc_per_node)
    par = ParallelConfig(tp=args.tp, cp=args.cp, gtp_remat=args.gtp_remat, dp=args.dp, fold_cp=args.fold_cp,
                         expert_gtp_remat=args.expert_gtp_remat, average_in_collective=args.average_in_collective)
    world = world or args.nproc_per_node or par.world_size
    par.validate(world, args.num_experts)
    model = ModelConfig(vocab_size=args.vocab_size, hidden=args.hidden, num_layers=args.num_layers,
                        num_heads=args.num_heads, ffn_hidden=args.ffn_hidden, seq_length=args.seq_length,
                        num_experts=args.num_experts, moe_topk=args.moe_topk, gtp_align=args.gtp_align,
                        seed=args.seed)
    model.validate(par)
    if args.async_save_staging is not None:
        from gtp_runtime.checkpoint.staging import parse_size

        try:
            parse_size(args.async_save_staging)
        except ValueError as e:
            raise ConfigError(f"--async-save-staging: {e}") from None
    if args.micro_batch < 1 or args.steps < 0:
        raise ConfigError(f"--micro-batch must be positive and --steps non-negative, got {args.micro_batch} and "
                          f"{args.steps}")
    adam = AdamConfig(lr=args.lr, weight_decay=args.weight_decay, clip_grad=args.clip_grad)
    muon = MuonConfig(lr=args.muon_lr, momentum=args.muon_momentum, weight_decay=args.weight_decay)
    lr = LRConfig(max_lr=args.lr, min_lr=args.min_lr, warmup_iters=args.lr_warmup_iters,
                  decay_style=args.lr_decay_style,
                  decay_iters=args.lr_decay_iters if args.lr_decay_iters is not None
                  else (0 if args.lr_decay_style == "constant" else args.steps))  # Megatron: --train-iters
    lr.validate()
    data = DataConfig(path=args.data_path, flat_dtype=args.data_dtype, split=args.split, seed=args.data_seed)
    data.weights()
    if args.eval_interval < 0 or args.eval_iters < 1:
        raise ConfigError(f"--eval-interval {args.eval_interval} must be >= 0 and --eval-iters {args.eval_iters} >= 1")
    cfg = TrainConfig(par=par, model=model, adam=adam, optimizer=args.optimizer, muon=muon,
                      micro_batch=args.micro_batch, bucket_size=args.bucket_size, data=data, lr=lr,
                      param_dtype=torch.bfloat16 if args.bf16 else torch.float32,
                      prefetch=not args.no_gather_prefetch, overlap_grad_reduce=not args.no_overlap_grad_reduce,
                      fused=args.fused)
    return cfg, world


def _device(args: argparse.Namespace, local_rank: int) -> torch.device:
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if use_cuda:
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def run_rank(args: argparse.Namespace, cfg: TrainConfig) -> int:
    """Body of one rank once the default process group exists. Returns the exit code."""
    from gtp_runtime.checkpoint.async_save import AsyncCheckpointer
    from gtp_runtime.checkpoint.io import check_sharding, load_checkpoint, save_checkpoint
    from gtp_runtime.checkpoint.staging import parse_size
    from gtp_runtime.parity import check_against_reference

    rank = dist.get_rank()
    rss_start_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # peak before the model exists
    device = _device(args, int(os.environ.get("LOCAL_RANK", rank)))
    trainer = Trainer(cfg, device=device)
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"gtp_runtime: {cfg.par.describe()} world={cfg.par.world_size} device={device.type} "
        f"dense weight+grad bytes/rank={trainer.dense_weight_grad_bytes()}", flush=True)
    rows: list[dict[str, Any]] = []
    code = 0
    if args.load:
        folder = load_checkpoint(trainer, args.load, args.optimizer_sharding)
        say(f"loaded {folder} at iteration {trainer.iteration}", flush=True)
    elif args.save or args.optimizer_sharding != "dp_reshardable":
        check_sharding(trainer, args.optimizer_sharding, "save")
    if args.check_reference:
        ref_rows, worst = check_against_reference(trainer, args.steps, args.reference_tol,
                                                   args.reference_param_tol)
        for r in ref_rows:
            say(f"step {r['step']:4d} | loss {r['loss']:.6f} (ref {r['ref_loss']:.6f}) | grad_norm "
                f"{r['grad_norm']:.6f} (ref {r['ref_grad_norm']:.6f}) | zeros {r['zeros']} (ref {r['ref_zeros']}) "
                f"| worst {r['worst'].what} {r['worst'].name} {r['worst'].error:.2f}x tol", flush=True)
            rows.append({k: (vars(v) if k == "worst" else v) for k, v in r.items()})
        ok = worst.error <= 1.0
        say(f"reference check {'PASSED' if ok else 'FAILED'}: worst error {worst.error:.3f}x its tolerance "
            f"({worst.what}, {worst.name or '-'})", flush=True)
        code = 0 if ok else 1
    else:
        saver = None
        if args.save and args.async_save:
            staging = args.async_save_staging
            saver = AsyncCheckpointer(parse_size(staging) if staging is not None else None)
        while trainer.iteration < args.steps:
            r = trainer.train_step()
            if saver and (done := saver.poll()):
                say(f"saved {done}", flush=True)
            say(f"step {r.step:4d} | loss {r.loss:.6f} | grad_norm {r.grad_norm:.6f} | zeros {r.num_zeros} "
                f"| lr {r.lr:.3e} | {r.seconds * 1e3:.1f} ms", flush=True)
            rows.append(vars(r))
            if args.eval_interval and (trainer.iteration % args.eval_interval == 0 or trainer.iteration == args.steps):
                rows[-1]["valid_loss"] = trainer.evaluate(args.eval_iters)
                say(f"step {r.step:4d} | validation loss {rows[-1]['valid_loss']:.6f}", flush=True)
            last = trainer.iteration == args.steps
            if args.save and (last or (args.save_interval and trainer.iteration % args.save_interval == 0)):
                if saver:
                    folder, done = saver.save(trainer, args.save, args.ckpt_layout, args.optimizer_sharding)
                    if done:
                        say(f"saved {done}", flush=True)
                    say(f"saving {folder} in the background ({saver.blocking_s * 1e3:.0f} ms blocked)", flush=True)
                else:
                    folder = save_checkpoint(trainer, args.save, args.ckpt_layout, args.optimizer_sharding)
                    say(f"saved {folder}", flush=True)
        if saver and (done := saver.close()):
            say(f"saved {done}", flush=True)
    if args.log_json:
        # Per-rank peak RSS (KiB on Linux), gathered so rank 0 can log every rank's.
        rss: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(rss, (rss_start_kb, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss))
    if args.log_json and rank == 0:
        with open(args.log_json, "w") as f:
            json.dump({"config": cfg.par.to_dict(), "rows": rows, "exit_code": code,
                       "dense_weight_grad_bytes": trainer.dense_weight_grad_bytes(),
                       "max_rss_kb": [r[1] for r in rss], "start_rss_kb": [r[0] for r in rss]}, f, indent=1)
    return code


def _spawned_rank(args: argparse.Namespace) -> int:
    """Body of one rank started by :func:`spawn`; the launcher made the process group."""
    cfg, _ = resolve(args, dist.get_world_size())
    return run_rank(args, cfg)


def _run_initialised(args: argparse.Namespace) -> int:
    """One rank started by torchrun: join its group, run, and fail with one line naming this rank."""
    from gtp_runtime.checkpoint.errors import CheckpointSaveError
    from gtp_runtime.checkpoint.io import CheckpointError
    from gtp_runtime.last_resort import report_failure

    rank = int(os.environ["RANK"])
    try:
        cfg, _ = resolve(args, int(os.environ["WORLD_SIZE"]))
        use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
        torch.set_num_threads(1) if not use_cuda else None
        dist.init_process_group("nccl" if use_cuda else "gloo")
        return run_rank(args, cfg)
    except CheckpointSaveError as e:  # every rank raises the same gathered line: rank 0 prints it; a failure, exit 1
        report_failure(rank, e, known=True)
        return 1
    except (CheckpointError, ConfigError, FormatError, DataError) as e:
        return report_failure(rank, e, known=True)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException: one line, no traceback
        return report_failure(rank, e, known=False)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def check_data(cfg: TrainConfig, eval_interval: int) -> None:
    """Open the data once before any rank starts: a bad file is one line and exit 2, and the
    default corpus is prepared here instead of by every rank at once."""
    from gtp_runtime.data.source import DataSource

    m = cfg.model
    source = DataSource(cfg.data, m.seq_length, m.vocab_size, m.seed)
    if eval_interval and source.valid is None:
        raise DataError(f"{source.data.name}: --eval-interval needs a valid split, but --split {cfg.data.split} "
                        "leaves it no documents")


def spawn(args: argparse.Namespace, world: int) -> int:
    """Run ``world`` local ranks of this launcher and return the worst exit code.

    Ranks come from :mod:`gtp_runtime.launch`: rank 0's step lines reach this process's stdout;
    a failing rank is reported in one line naming it, its traceback kept in its log file.
    Training has no deadline; a failed rank's peers are stopped a few seconds after it.
    """
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    try:
        codes = run_local_ranks(world, _spawned_rank, (args,), tag="train", timeout=COLLECTIVE_TIMEOUT_S,
                                deadline=None, backend="nccl" if use_cuda else "gloo", stdout="inherit",
                                preload=PRELOAD)
    except RankFailure as e:
        print(f"error: {e.line()}", file=sys.stderr, flush=True)
        return 2 if e.clean else 1
    return max(codes)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return _run_initialised(args)
    from gtp_runtime.checkpoint.io import CheckpointError
    from gtp_runtime.checkpoint.verified import preflight
    from gtp_runtime.last_resort import describe, root_cause

    try:
        cfg, world = resolve(args, None)
        check_data(cfg, args.eval_interval)
        if args.load:
            # The checkpoint is opened and verified here, before any rank exists; the ranks load
            # the folder found here (a newer ``latest`` written meanwhile does not change it).
            args.load = str(preflight(args.load, cfg, args.optimizer_sharding))
    except (ConfigError, CheckpointError, DataError, OSError) as e:
        print(f"error: {describe(e)}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - a reader's unexpected failure on a hostile file: one line, no traceback
        print(f"error: unexpected {type(root_cause(e)).__name__} before any rank started: {describe(e)}",
              file=sys.stderr)
        return 2
    return spawn(args, world)


if __name__ == "__main__":
    sys.exit(main())
