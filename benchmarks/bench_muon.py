"""CPU benchmark: optimizer step time per parameter, Muon against Adam, and the bytes Muon adds.

For each layout it starts the ranks (gloo, :func:`gtp_runtime.launch.run_local_ranks`) once per
optimizer, runs one forward/backward and the gradient reduction, then times
``step_after_reduce`` (the optimizer's own work: update, Muon's two exchanges and Newton-Schulz,
the param all-gather) ``--reps`` times after one warm-up call, behind a barrier each time.
Reported: rank 0's median step time per model parameter, Muon / Adam in the same invocation;
the seconds Muon's exchanges took (exposed: gloo's ``all_to_all`` blocks); and the bytes they
sent per step, summed over ranks, measured by the runtime's counter and counted offline from the
layout (:func:`gtp_runtime.muon.exchange_bytes`; the two must agree exactly).

    python benchmarks/bench_muon.py --write-docs
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch
from docs_section import write_section
from tabulate import tabulate

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
DOC = REPO / "docs" / "performance.md"
SECTION = "{where}: Muon against Adam, optimizer step per parameter"

from gtp_format.layout.config import ModelConfig, ParallelConfig  # noqa: E402
from gtp_runtime.launch import run_local_ranks  # noqa: E402
from gtp_runtime.muon import exchange_bytes, muon_owned  # noqa: E402
from gtp_runtime.reference import param_names, param_shape  # noqa: E402

LAYOUTS = {
    "single": ParallelConfig(),
    "cp2-fold": ParallelConfig(cp=2, fold_cp=True),
    "dp2": ParallelConfig(dp=2),
    "cp2-dp2-fold": ParallelConfig(cp=2, dp=2, fold_cp=True),
    "cp2-g2-dp2-fold": ParallelConfig(cp=2, gtp_remat=2, dp=2, fold_cp=True),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layouts", default="single,cp2-dp2-fold,cp2-g2-dp2-fold", help=f"comma list of {sorted(LAYOUTS)}")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--ffn-hidden", type=int, default=2048)
    ap.add_argument("--num-layers", type=int, default=2)
    ap.add_argument("--num-heads", type=int, default=8)
    ap.add_argument("--vocab-size", type=int, default=1024)
    ap.add_argument("--bucket-size", type=int, default=40_000_000)
    ap.add_argument("--reps", type=int, default=5, help="timed optimizer steps after one warm-up")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cuda: NCCL, one GPU per rank (times synchronized; fp32 params)")
    ap.add_argument("--json", default=None, help="also write the rows to this JSON file")
    ap.add_argument("--from-json", default=None,
                    help="render (and with --write-docs, write) the report of an earlier --json run, e.g. a GPU one")
    ap.add_argument("--machine", default=None, help="with --from-json, when the file does not record the machine")
    ap.add_argument("--write-docs", action="store_true", help=f"update {DOC.relative_to(REPO)}")
    ap.add_argument("--smoke", action="store_true", help="tiny run (tests/benchmarks): cp2-fold, 1 rep")
    args = ap.parse_args(argv)
    if args.smoke:
        args.layouts, args.hidden, args.ffn_hidden, args.num_layers, args.num_heads = "cp2-fold", 32, 64, 1, 2
        args.vocab_size, args.reps, args.bucket_size = 128, 1, 3000
    return args


def _job(par: ParallelConfig, model: ModelConfig, bucket_size: int, reps: int, device: str) -> dict:
    """Both optimizers on the same ranks, one after the other (one start-up per layout)."""
    return {optimizer: _time_one(par, model, optimizer, bucket_size, reps, device) for optimizer in ("adam", "muon")}


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _time_one(par: ParallelConfig, model: ModelConfig, optimizer: str, bucket_size: int, reps: int,
              device: str) -> dict:
    import torch.distributed as dist

    from gtp_runtime.training import TrainConfig, Trainer

    cfg = TrainConfig(par=par, model=model, optimizer=optimizer, bucket_size=bucket_size, micro_batch=1)
    dev = torch.device("cuda", dist.get_rank()) if device == "cuda" else torch.device("cpu")
    trainer = Trainer(cfg, device=dev)
    opt = trainer.optimizer
    trainer.forward_backward(1)
    opt.reduce_grads()
    stats = opt.grad_stats()
    opt.step_after_reduce(stats)  # warm-up
    plan = getattr(opt, "plan", None)
    if plan is not None:
        plan.sent_bytes, plan.comm_seconds = 0, 0.0
    times = []
    for _ in range(reps):
        _sync()
        dist.barrier()
        t0 = time.perf_counter()
        opt.step_after_reduce(stats)
        _sync()
        times.append(time.perf_counter() - t0)
    return {"seconds": statistics.median(times), "params": sum(p.numel() for p in trainer.model.parameters()),
            "sent_bytes": plan.sent_bytes / reps if plan else 0, "comm_s": plan.comm_seconds / reps if plan else 0.0}


def measure(name: str, args: argparse.Namespace) -> dict:
    par = LAYOUTS[name]
    model = ModelConfig(vocab_size=args.vocab_size, hidden=args.hidden, num_layers=args.num_layers,
                        num_heads=args.num_heads, ffn_hidden=args.ffn_hidden, seq_length=32)
    counts = param_counts(model)
    out: dict = {"layout": name, "world": par.world_size, "params": sum(counts.values()),
                 "muon_params": sum(n for p, n in counts.items() if muon_owned(p))}
    res = run_local_ranks(par.world_size, _job, (par, model, args.bucket_size, args.reps, args.device),
                          tag="bench-muon", backend="nccl" if args.device == "cuda" else "gloo")
    out["adam"], out["muon"] = res[0]["adam"]["seconds"], res[0]["muon"]["seconds"]
    out["sent_bytes"] = sum(r["muon"]["sent_bytes"] for r in res)
    out["comm_s"] = res[0]["muon"]["comm_s"]
    out["counted_bytes"] = exchange_bytes(model, par, args.bucket_size)
    return out


def param_counts(model: ModelConfig) -> dict[str, int]:
    """Elements of every full (unsharded) parameter."""
    return {n: math.prod(param_shape(model, n)) for n in param_names(model)}


def machine() -> str:
    common = f"torch {torch.__version__}, Python {platform.python_version()}"
    if not torch.cuda.is_available():
        return f"{os.cpu_count()} CPU cores shared with other jobs, {common}, gloo, 1 thread per rank"
    return (f"NCCL on {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}, {common} (exchange ms: the "
            "host's launch and wait of the all_to_all)")


def report(rows: list[dict], args: argparse.Namespace, where: str, cmd: str) -> str:
    table = [[r["layout"], r["world"], f"{r['params']:,}", f"{r['adam'] / r['params'] * 1e9:.3g}",
              f"{r['muon'] / r['params'] * 1e9:.3g}", f"{r['muon'] / r['adam']:.2f}x",
              f"{r['comm_s'] * 1e3:.2f}", f"{r['sent_bytes']:,.0f}", f"{r['counted_bytes']:,}",
              f"{r['sent_bytes'] / (4 * r['muon_params']):.2f}"] for r in rows]
    head = ["layout", "ranks", "params", "Adam ns/param", "Muon ns/param", "Muon / Adam", "Muon exchange ms (rank 0)",
            "Muon bytes/step measured", "counted from layout", "bytes / fp32 Muon params"]
    text = [
        f"Model: hidden {args.hidden}, ffn {args.ffn_hidden}, {args.num_layers} layers, vocab {args.vocab_size}, fp32, "
        f"bucket size {args.bucket_size}. Optimizer step alone (`step_after_reduce`), median of {args.reps} after a "
        f"warm-up, rank 0, per model parameter; both optimizers in the same invocation. Muon's bytes are what its two "
        f"`all_to_all` per step send between ranks, summed over ranks (each Muon element not held by its matrix's "
        f"owner crosses once each way: at most 2 x 4 bytes per Muon param). The exchange time includes the second "
        f"all_to_all waiting for the slowest owner's Newton-Schulz. Machine: {where}.",
        "",
        tabulate(table, head, tablefmt="github"),
        "",
        f"Command: `{cmd}`",
    ]
    return "\n".join(text)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    cmd = shlex.join(["python", "benchmarks/bench_muon.py", *sys.argv[1:]])
    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        rows, where = saved["rows"], saved.get("machine") or args.machine
        if where is None:
            raise SystemExit(f"{args.from_json} does not record its machine; pass --machine")
        cmd = saved.get("command", "(not recorded)") + f"`, rendered by `{cmd}"
        args = argparse.Namespace(**{**saved["args"], "write_docs": args.write_docs, "from_json": args.from_json,
                                     "json": None})
    else:
        rows, where = [measure(name, args) for name in args.layouts.split(",")], machine()
    for r in rows:
        if r["sent_bytes"] != r["counted_bytes"]:
            raise SystemExit(f"{r['layout']}: measured {r['sent_bytes']} bytes but the layout gives "
                             f"{r['counted_bytes']}")
    text = report(rows, args, where, cmd)
    print(text)
    if args.json and not args.from_json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows, "machine": where, "command": cmd},
                                              indent=1))
    if args.write_docs:
        title = "CPU" if args.device == "cpu" else "GPU"
        write_section(SECTION.format(where=title), text, DOC)
        print(f"updated {DOC.relative_to(REPO)} ({shlex.join(sys.argv)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
