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
command line (upstream, NVIDIA/Megatron-LM#6886 as reviewed, read a flag that was never registered with its parser).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import sys
from typing import Any

import torch
import torch.distributed as dist

from gtp_format import __version__
from gtp_format.errors import FormatError
from gtp_format.layout.config import ConfigError, ModelConfig, ParallelConfig, infer_dp
from gtp_format.names import ITER_DIR_RE
from gtp_format.numbers import NumberError, OneLineParser, float_flag, int_flag
from gtp_format.storage.base import storage_for
from gtp_format.storage.location import parse_location
from gtp_format.text import safe_text
from gtp_format.work import Terminated
from gtp_runtime.data.indexed import DataError
from gtp_runtime.data.source import DataConfig
from gtp_runtime.data.vocab import tokenizer_vocab_size
from gtp_runtime.launch import LaunchError, RankFailure, run_local_ranks
from gtp_runtime.lr_schedule import LRConfig
from gtp_runtime.muon import MuonConfig
from gtp_runtime.optimizer import AdamConfig
from gtp_runtime.sharding import env_knobs
from gtp_runtime.training import TrainConfig, Trainer

# Imported once by the fork server the ranks are forked from (see gtp_runtime.launch).
PRELOAD = ("torch", "torch.distributed", "gtp_runtime.training", "gtp_runtime.parity", "gtp_runtime.checkpoint.io")
# CP > 1 on CPU attends through torch.nn.attention.bias, whose import pulls in torch._dynamo (0.9 s of
# CPU each time): imported once where the ranks are forked from (this launcher or a fork server), not per rank.
CP_PRELOAD = ("torch.nn.attention.bias",)
DEFAULT_VOCAB = 256  # the byte tokenizer
COLLECTIVE_TIMEOUT_S = 1800.0  # torch's default process-group timeout; a dead peer is noticed sooner

EXAMPLES = """examples:
  python -m gtp_runtime.train --nproc-per-node 8 --cp 2 --gtp-remat 2 --dp 2 --fold-cp --steps 5
  python -m gtp_runtime.train --nproc-per-node 4 --tp 2 --cp 2 --fold-cp --check-reference
  python -m gtp_runtime.train --nproc-per-node 4 --cp 2 --dp 2 --fold-cp --optimizer muon --check-reference
  torchrun --nproc-per-node 2 -m gtp_runtime.train --cp 2 --fold-cp --steps 10
  python -m gtp_runtime.train --nproc-per-node 2 --cp 2 --fold-cp --data-path data/corpus --vocab-size 4096 \
      --steps 200 --lr 3e-4 --lr-warmup-iters 20 --lr-decay-style cosine --min-lr 3e-5 --eval-interval 50
"""


INT, FLOAT = int_flag(), float_flag()  # ASCII, finite, within int64: argparse's int/float take any script


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Examples kept as written, and ``(default: X)`` on every flag whose help does not say it already."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default:" in text or action.default is argparse.SUPPRESS or not action.option_strings:
            return text
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            return f"{text} (default: off)" if isinstance(action, argparse._StoreTrueAction) else text
        return f"{text} (default: %(default)s)"


def build_parser() -> argparse.ArgumentParser:
    """Every flag, with help and its default. Where Megatron-LM has a twin, its name is an alias
    (``--tensor-model-parallel-size`` for ``--tp``, ``--train-iters`` for ``--steps``, ...), so a
    Megatron command line's parallelism, model, schedule and checkpoint flags carry over as written."""
    ap = OneLineParser(prog="python -m gtp_runtime.train", description=__doc__.split("\n\n")[1],
                                 epilog=EXAMPLES, formatter_class=_HelpFormatter)
    ap.add_argument("--version", action="version", version=f"gtp-train {__version__}")
    g = ap.add_argument_group("parallelism")
    g.add_argument("--nproc-per-node", type=INT, default=None, help="ranks to spawn (default: tp*cp*gtp_remat*dp)")
    g.add_argument("--tp", "--tensor-model-parallel-size", type=INT, default=1, help="tensor-parallel size")
    g.add_argument("--cp", "--context-parallel-size", type=INT, default=1, help="context-parallel size")
    g.add_argument("--gtp-remat", type=INT, default=1,
                   help="GTP_remat group size: each dense weight is sharded over this many ranks (ZeRO-3 per weight)")
    g.add_argument("--dp", type=INT, default=None, help="replicate degree (default: world / (tp*cp*gtp_remat))")
    g.add_argument("--fold-cp", action="store_true", help="shard dense weights over cp x gtp_remat (opt-in)")
    g.add_argument("--expert-gtp-remat", type=INT, default=1, help="GTP_remat group size of the expert weights")
    g.add_argument("--average-in-collective", action="store_true",
                   help="average inside the collective (refused with GTP_remat active)")
    g.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: CUDA (NCCL) where there is a GPU, else CPU (gloo)")
    m = ap.add_argument_group("model")
    m.add_argument("--vocab-size", type=INT, default=None,
                   help="vocabulary size (default: the size of PREFIX.tokenizer.json next to --data-path, else 256)")
    m.add_argument("--hidden", "--hidden-size", type=INT, default=64, help="hidden size")
    m.add_argument("--num-layers", type=INT, default=2, help="transformer layers")
    m.add_argument("--num-heads", "--num-attention-heads", type=INT, default=4, help="attention heads")
    m.add_argument("--ffn-hidden", "--ffn-hidden-size", type=INT, default=128, help="MLP hidden size")
    m.add_argument("--seq-length", type=INT, default=32, help="tokens per sequence")
    m.add_argument("--num-experts", type=INT, default=0, help="MoE experts per layer (0: dense MLP)")
    m.add_argument("--moe-topk", "--moe-router-topk", type=INT, default=1, help="experts each token is routed to")
    m.add_argument("--gtp-align", type=INT, default=16, help="rows of a GTP shard are padded to a multiple of this")
    m.add_argument("--seed", type=INT, default=1234, help="initialisation seed")
    m.add_argument("--bf16", action="store_true", help="bf16 params, fp32 grads and optimizer state")
    t = ap.add_argument_group("training")
    t.add_argument("--steps", "--train-iters", type=INT, default=5,
                   help="train until this iteration (counts loaded iterations)")
    t.add_argument("--micro-batch", "--micro-batch-size", type=INT, default=2, help="sequences per data lane and step")
    t.add_argument("--global-batch-size", type=INT, default=None,
                   help="sequences per step; must equal micro-batch x gtp_remat x dp, as there is no gradient "
                   "accumulation (default: that product)")
    t.add_argument("--lr", type=FLOAT, default=1e-3, help="AdamW's peak learning rate")
    t.add_argument("--weight-decay", type=FLOAT, default=0.01, help="decoupled weight decay")
    t.add_argument("--clip-grad", type=FLOAT, default=1.0, help="clip the global gradient norm to this")
    t.add_argument("--optimizer", choices=("adam", "muon"), default="adam",
                   help="adam: AdamW everywhere; muon: Muon for the linears, AdamW for embeddings, output, norms")
    t.add_argument("--muon-lr", type=FLOAT, default=0.02,
                   help="Muon's peak learning rate (--lr is AdamW's; the --lr-* schedule scales both)")
    t.add_argument("--muon-momentum", type=FLOAT, default=0.95, help="Muon's (Nesterov) momentum")
    t.add_argument("--lr-warmup-iters", type=INT, default=0, help="linear warmup from 0 to --lr over this many steps")
    t.add_argument("--lr-decay-style", choices=("constant", "linear", "cosine"), default="constant",
                   help="learning-rate decay after the warmup")
    t.add_argument("--lr-decay-iters", type=INT, default=None, help="decay to --min-lr by this step (default: --steps)")
    t.add_argument("--min-lr", type=FLOAT, default=0.0, help="learning rate at the end of the decay")
    t.add_argument("--eval-interval", type=INT, default=0, help="validation loss every N steps (0: never)")
    t.add_argument("--eval-iters", type=INT, default=2, help="validation batches per evaluation")
    t.add_argument("--bucket-size", "--ddp-bucket-size", type=INT, default=40_000_000,
                   help="elements per gradient bucket")
    t.add_argument("--no-gather-prefetch", action="store_true",
                   help="gather each GTP weight only when it is needed (no prefetch of the next one)")
    t.add_argument("--no-overlap-grad-reduce", action="store_true",
                   help="finish each weight-gradient reduce-scatter inside backward")
    t.add_argument("--fused", choices=("auto", "none", "compile", "liger"), default="auto",
                   help="fused element-wise kernels: torch.compile regions, Liger-Kernel, or none; auto is "
                   "compile on CUDA (50%% MFU on 2 x H200 against 43%% unfused) and none on CPU, where the "
                   "fp32 path stays exact (default: auto)")
    t.add_argument("--check-reference", action="store_true", help="compare against the fp32 reference")
    t.add_argument("--reference-tol", type=FLOAT, default=1e-5,
                   help="max relative error of losses, grad norms and gradients vs the reference")
    t.add_argument("--reference-param-tol", type=FLOAT, default=1e-3,
                   help="max relative error of params after Adam steps vs the reference")
    d = ap.add_argument_group("data")
    d.add_argument("--data-path", default=None,
                   help="PREFIX of PREFIX.bin/.idx (Megatron) or a flat .bin of tokens (default: Python stdlib)")
    d.add_argument("--data-dtype", choices=("uint16", "uint32"), default="uint16", help="tokens of a flat .bin")
    d.add_argument("--split", default="98,2", help="train,valid document ratio")
    d.add_argument("--data-seed", type=INT, default=None, help="document/sample shuffle seed (default: --seed)")
    c = ap.add_argument_group("checkpointing")
    c.add_argument("--save", default=None, help="folder (or s3://BUCKET/PREFIX) to save checkpoints under, as "
                   "iter_XXXXXXX/ (default: no saving)")
    c.add_argument("--save-interval", type=INT, default=None,
                   help="save every K iterations, and at the end (default: at the end only)")
    c.add_argument("--load", default=None, help="checkpoint folder, or its parent (follows latest) (default: a "
                   "fresh start)")
    c.add_argument("--no-check-lineage", action="store_true",
                   help="resume even when the checkpoint's lineage checks fail (a stale or foreign iteration, a marker "
                        "that names the wrong one, optimizer state that restarted; `ckpt log RUN` shows them) "
                        "(default: refuse)")
    c.add_argument("--ckpt-layout", "--ckpt-format", choices=("torch_dist", "safetensors"), default="torch_dist",
                   help="torch_dist: Megatron's DCP layout; safetensors: the pickle-free layout")
    c.add_argument("--async-save", action="store_true",
                   help="return from a save once this rank's state is copied to host memory (pinned on CUDA) and "
                        "write the files in the background (for s3://, the upload too); the latest marker moves once "
                        "every rank's are durable and uploaded (default: off)")
    c.add_argument("--async-save-staging", default=None, metavar="SIZE",
                   help="most host memory for --async-save's staging buffers, e.g. 24GiB or 25GB (default: the rank's "
                        "checkpoint bytes); allocated once, reused by every save")
    c.add_argument("--optimizer-sharding", default="dp_reshardable",
                   choices=("dp_reshardable", "fully_reshardable", "dp_zero_gather_scatter"),
                   help="Megatron's distributed-optimizer checkpoint formats; only dp_reshardable is implemented "
                   "(the others are refused before any rank starts)")
    t.add_argument("--log-json", default=None, help="write per-step rows and a summary to this file (rank 0) "
                   "(default: none)")
    return ap


def resolve(args: argparse.Namespace, world: int | None) -> tuple[TrainConfig, int]:
    """Turn parsed flags into a validated config and the world size."""
    if args.dp is None:
        args.dp = infer_dp(args.tp, args.cp, args.gtp_remat, world or args.nproc_per_node)
    par = ParallelConfig(tp=args.tp, cp=args.cp, gtp_remat=args.gtp_remat, dp=args.dp, fold_cp=args.fold_cp,
                         expert_gtp_remat=args.expert_gtp_remat, average_in_collective=args.average_in_collective)
    world = world or args.nproc_per_node or par.world_size
    par.validate(world, args.num_experts)
    try:  # tuning variables the ranks read at import: ASCII integers in range, refused here in one line
        env_knobs()
    except NumberError as e:
        raise ConfigError(f"{e}; unset it or give an integer") from None
    if args.vocab_size is None:  # the prepared dataset's tokenizer says it (gtp_runtime.data.vocab)
        args.vocab_size = (tokenizer_vocab_size(args.data_path) if args.data_path else None) or DEFAULT_VOCAB
    model = ModelConfig(vocab_size=args.vocab_size, hidden=args.hidden, num_layers=args.num_layers,
                        num_heads=args.num_heads, ffn_hidden=args.ffn_hidden, seq_length=args.seq_length,
                        num_experts=args.num_experts, moe_topk=args.moe_topk, gtp_align=args.gtp_align,
                        seed=args.seed)
    model.validate(par)
    if args.async_save_staging is not None:
        from gtp_format.sizes import parse_size

        if not args.async_save:  # it would be ignored: the run would not do what its command line says
            raise ConfigError("--async-save-staging sizes the staging buffers of --async-save; add --async-save "
                              "or drop --async-save-staging")

        try:
            # parsed here, once: run_rank hands the bytes to the async saver (an int passes parse_size as is)
            args.async_save_staging = parse_size(args.async_save_staging)
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
                      fused=_fused(args))
    return cfg, world


def uses_cuda(args: argparse.Namespace) -> bool:
    """Whether the ranks run on CUDA: ``--device cuda``, or ``auto`` where a GPU is there (one rule for
    the device, the NCCL backend, the launcher's GPU count and ``--fused auto``)."""
    return args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())


def _fused(args: argparse.Namespace) -> str | None:
    """``--fused auto``: compile where the ranks run on CUDA (the bf16 parity and the compiled-vs-unfused
    losses hold there: tests/runtime/test_gpu_one.py), unfused on CPU (the exact fp32 path)."""
    if args.fused == "auto":
        return "compile" if uses_cuda(args) else None
    return None if args.fused == "none" else args.fused


def refuse_unfit(args: argparse.Namespace, cfg: TrainConfig, world: int, local: int) -> None:
    """Refuse model and world sizes this machine cannot hold (:mod:`gtp_runtime.fits`), before any
    rank builds a layer: a lower bound of what ``local`` ranks need against host and GPU memory."""
    from gtp_runtime.fits import fit_problem, host_memory

    gpu = 0
    if uses_cuda(args):
        gpu = sum(torch.cuda.get_device_properties(i).total_memory
                  for i in range(min(local, torch.cuda.device_count())))
    problem = fit_problem(cfg.model, world, local, cfg.param_dtype.itemsize, host_memory(), gpu)
    if problem is not None:
        raise ConfigError(problem)


def refuse_impossible(args: argparse.Namespace, cfg: TrainConfig) -> None:
    """Refuse, before any rank starts, choices that could only fail later (or silently do the wrong thing)."""
    from gtp_runtime.checkpoint.errors import sharding_refusal

    if args.optimizer_sharding != "dp_reshardable":
        sharding_refusal(args.optimizer_sharding, cfg.par.fold_cp and cfg.par.cp > 1, "load" if args.load else "save")
    if args.global_batch_size is not None and args.global_batch_size != cfg.global_batch_size:
        raise ConfigError(f"--global-batch-size {args.global_batch_size} != micro-batch {cfg.micro_batch} x "
                          f"gtp_remat {cfg.par.gtp_remat} x dp {cfg.par.dp} = {cfg.global_batch_size}: there is no "
                          "gradient accumulation; drop it or change --micro-batch-size")
    for flag, value in (("--save", args.save), ("--load", args.load)):
        if value:  # the one location parser: a bad URL is refused here, never turned into a local folder's name
            try:
                where = parse_location(value, flag)
            except FormatError as e:
                raise ConfigError(e.message) from None
            try:  # a bad profile or setting (raised) names the flag too, as a missing credential does
                problem = storage_for(where).settings_problem(writing=flag == "--save")
            except FormatError as e:
                problem = e.message
            if problem is not None:
                raise ConfigError(f"{flag} {where}: {problem}")  # before any rank trains for nothing


def _nothing_to_train(args: argparse.Namespace, it: int | None) -> str | None:
    """The line to end with when the checkpoint ``--load`` found is already at or past ``--steps``.

    Megatron's ``--train-iters`` counts loaded iterations too, so such a run has nothing to do;
    it used to start every rank and exit 0 without a word.
    """
    if args.check_reference:
        return None
    if it is None or it < args.steps:
        return None
    return (f"nothing to train: {safe_text(args.load)} is at iteration {it}, already at or past --steps "
            f"(--train-iters) {args.steps}; pass --steps N with N > {it} to train on")


def _device(args: argparse.Namespace, local_rank: int) -> torch.device:
    use_cuda = uses_cuda(args)
    if use_cuda:
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def run_rank(args: argparse.Namespace, cfg: TrainConfig) -> int:
    """Body of one rank once the default process group exists. Returns the exit code."""
    from gtp_runtime.checkpoint.async_save import AsyncCheckpointer
    from gtp_runtime.checkpoint.io import check_sharding, load_checkpoint, save_checkpoint
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
        say(f"loaded {safe_text(folder)} at iteration {trainer.iteration}", flush=True)
        done = _nothing_to_train(args, trainer.iteration)  # under torchrun: the launcher did not check
        if done:
            say(done, flush=True)
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
            saver = AsyncCheckpointer(args.async_save_staging)  # bytes: resolve parsed the size
            saver.prepare(trainer)  # pinning happens here, once, not inside the first save's step
        while trainer.iteration < args.steps:
            r = trainer.train_step()
            if saver and (done := saver.poll()):
                say(f"saved {safe_text(done)}", flush=True)
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
                        say(f"saved {safe_text(done)}", flush=True)
                    say(f"saving {safe_text(folder)} in the background ({saver.blocking_s * 1e3:.0f} ms blocked)",
                        flush=True)
                else:
                    folder = save_checkpoint(trainer, args.save, args.ckpt_layout, args.optimizer_sharding)
                    say(f"saved {safe_text(folder)}", flush=True)
        if saver and (done := saver.close()):
            say(f"saved {safe_text(done)}", flush=True)
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
        cfg, world = resolve(args, int(os.environ["WORLD_SIZE"]))
        local = os.environ.get("LOCAL_WORLD_SIZE", "")
        refuse_unfit(args, cfg, world, int(local) if local.isascii() and local.isdigit() else 1)
        refuse_impossible(args, cfg)
        if args.load and not args.no_check_lineage:  # what the launcher's preflight checks, on every rank
            from gtp_runtime.checkpoint.verified import check_lineage, open_verified

            check_lineage(open_verified(args.load)[0])
        use_cuda = uses_cuda(args)
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


def spawn(args: argparse.Namespace, world: int, cfg: TrainConfig) -> int:
    """Run ``world`` local ranks of this launcher and return the worst exit code.

    Ranks come from :mod:`gtp_runtime.launch`: rank 0's step lines reach this process's stdout;
    a failing rank is reported in one line naming it, its traceback kept in its log file.
    Training has no deadline; a failed rank's peers are stopped a few seconds after it.
    """
    use_cuda = uses_cuda(args)
    preload = PRELOAD + (CP_PRELOAD if cfg.par.cp > 1 and not use_cuda else ())
    warm = None
    if args.save:  # every rank's first save loads the statistics loop of its dtypes (numba: 0.3-1.4 s a process)
        from gtp_format.dtypes import by_name, from_torch
        from gtp_format.integrity.stats import warm_up

        dtypes = [from_torch(cfg.param_dtype), by_name("float32")]
        warm = functools.partial(warm_up, dtypes)
    try:
        codes = run_local_ranks(world, _spawned_rank, (args,), tag="train", timeout=COLLECTIVE_TIMEOUT_S,
                                deadline=None, backend="nccl" if use_cuda else "gloo", stdout="inherit",
                                preload=preload, warm=warm)
    except RankFailure as e:
        print(f"error: {safe_text(e.line())}", file=sys.stderr, flush=True)
        return 2 if e.clean else 1
    except LaunchError as e:  # no rank ran (a TMPDIR too long for the fork server's socket)
        print(f"error: {safe_text(str(e))}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt as e:  # SIGINT, or SIGTERM (gtp_runtime.lifeline): every rank is stopped
        term = isinstance(e, Terminated)
        print(f"error: {'terminated (SIGTERM)' if term else 'interrupted'}: stopped every rank; an iteration "
              "being saved was not committed" + (f", resume with --load {safe_text(args.save)}" if args.save else ""),
              file=sys.stderr, flush=True)
        return 143 if term else 130
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
        refuse_unfit(args, cfg, world, world)  # every rank runs here (spawn)
        refuse_impossible(args, cfg)
        check_data(cfg, args.eval_interval)
        if args.load:
            # The checkpoint is opened and verified here, before any rank exists; the ranks load
            # the folder found here (a newer ``latest`` written meanwhile does not change it).
            args.load = str(preflight(args.load, cfg, args.optimizer_sharding, lineage=not args.no_check_lineage))
            m = ITER_DIR_RE.match(os.path.basename(os.path.normpath(args.load)))
            done = _nothing_to_train(args, int(m.group(1)) if m else None)
            if done:
                print(done, flush=True)
                return 0
    except (ConfigError, CheckpointError, DataError, OSError) as e:
        print(f"error: {describe(e)}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - a reader's unexpected failure on a hostile file: one line, no traceback
        print(f"error: unexpected {type(root_cause(e)).__name__} before any rank started: {describe(e)}",
              file=sys.stderr)
        return 2
    return spawn(args, world, cfg)


def cli() -> None:
    """Console-script entry point (``gtp-train`` in pyproject.toml)."""
    sys.exit(main())


if __name__ == "__main__":
    cli()
