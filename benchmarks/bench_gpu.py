"""GPU benchmark: what CP folding buys and costs, folded vs unfolded in the same run (NCCL).

    python benchmarks/bench_gpu.py --nproc 2 --cp 2 --hidden 4096 --layers 8 --heads 32 --seq 8192 \
        --json docs/gpu_results.json

For each configuration it measures on every rank: step time and tokens/s (after warm-up), peak
GPU memory, the runtime's own dense weight+grad bytes, model FLOP utilisation against the bf16
matmul peak measured on the same GPUs in the same run, exposed (non-overlapped) communication
per step from a CUDA kernel trace (time NCCL kernels run while no compute kernel runs), and
checkpoint save/load throughput against ``torch.save`` / ``torch.load`` of the same tensors.
Rank 0 prints a table and writes everything as JSON; ``benchmarks/report_gpu.py`` turns that
JSON into the docs table and plot.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist

from gtp_format.layout.config import ModelConfig, ParallelConfig
from gtp_runtime.launch import RankFailure, run_local_ranks
from gtp_runtime.training import TrainConfig, Trainer


def matmul_peak_tflops(n: int = 8192, iters: int = 10) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        a @ b
    torch.cuda.synchronize()
    return 2 * n**3 * iters / (time.perf_counter() - t) / 1e12


def _union(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def _length(iv: list[tuple[int, int]]) -> int:
    return sum(e - s for s, e in iv)


def _intersect(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> int:
    i = j = total = 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


KERNEL_KINDS = (("comm", ("nccl",)), ("attention", ("fmha", "flash", "attention", "efficient")),
                ("gemm", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "sm90")))


def kernel_kind(name: str) -> str:
    low = name.lower()
    return next((kind for kind, keys in KERNEL_KINDS if any(k in low for k in keys)), "other")


def exposed_comm_ms(trainer: Trainer) -> tuple[float, float, dict[str, float]]:
    """(total NCCL kernel time, NCCL time not overlapped by any compute kernel, GPU time by kernel
    kind) for one step, in ms. The kinds say where a step's time goes when MFU is low."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        trainer.train_step()
        torch.cuda.synchronize()
    comm, comp = [], []
    by_kind: dict[str, float] = {}
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        start = int(ev.time_range.start * 1000)
        end = int(ev.time_range.end * 1000)
        kind = kernel_kind(ev.name)
        by_kind[kind] = by_kind.get(kind, 0.0) + (end - start) / 1e6
        (comm if kind == "comm" else comp).append((start, end))
    cu, pu = _union(comm), _union(comp)
    return _length(cu) / 1e6, (_length(cu) - _intersect(cu, pu)) / 1e6, by_kind


def model_flops_per_step(cfg: ModelConfig, tokens: int) -> float:
    """6*N*T for the matmul params plus causal attention (6*L*h*s per token, fwd+bwd)."""
    h, f, v, L = cfg.hidden, cfg.ffn_hidden, cfg.vocab_size, cfg.num_layers
    n = L * (4 * h * h + 2 * h * f) + v * h
    return 6 * n * tokens + 6 * L * h * cfg.seq_length * tokens


def ckpt_throughput(trainer: Trainer, root: str) -> dict[str, float]:
    from gtp_runtime.checkpoint.io import load_checkpoint, save_checkpoint
    from gtp_runtime.checkpoint.state import model_state, optimizer_state

    rank = dist.get_rank()
    dist.barrier()
    t = time.perf_counter()
    folder = save_checkpoint(trainer, root)
    save_s = time.perf_counter() - t
    size = sum(f.stat().st_size for f in folder.iterdir())
    dist.barrier()
    t = time.perf_counter()
    load_checkpoint(trainer, root)
    torch.cuda.synchronize()
    dist.barrier()
    load_s = time.perf_counter() - t
    # Baseline: the same tensors (this rank's chunks) through torch.save / torch.load, all ranks at once.
    tensors = {f"{k}@{o}": v for k, c in {**model_state(trainer.model, trainer.groups, False),
                                          **optimizer_state(trainer.optimizer, trainer.groups)}.items()
               for o, v in c.chunks.items()}
    path = os.path.join(root, f"torch_save_{rank}.pt")
    dist.barrier()
    t = time.perf_counter()
    torch.save(tensors, path)
    with open(path, "rb+") as f:
        os.fsync(f.fileno())
    dist.barrier()
    tsave_s = time.perf_counter() - t
    base = torch.tensor([os.path.getsize(path)], dtype=torch.float64, device="cuda")
    dist.all_reduce(base)
    t = time.perf_counter()
    loaded = torch.load(path, map_location="cuda", weights_only=True)
    torch.cuda.synchronize()
    dist.barrier()
    tload_s = time.perf_counter() - t
    del loaded
    gb, base_gb = size / 1e9, base.item() / 1e9
    return {"ckpt_gb": gb, "save_gbps": gb / save_s, "load_gbps": gb / load_s,
            "torch_save_gbps": base_gb / tsave_s, "torch_load_gbps": base_gb / tload_s}


def run_config(name: str, cfg: TrainConfig, steps: int, warmup: int, peak: float, do_ckpt: bool) -> dict[str, Any]:
    torch.cuda.reset_peak_memory_stats()
    trainer = Trainer(cfg, device=torch.device("cuda", torch.cuda.current_device()))
    for _ in range(warmup):
        trainer.train_step()
    torch.cuda.synchronize()
    dist.barrier()
    t = time.perf_counter()
    losses = []
    for _ in range(steps):
        losses.append(trainer.train_step().loss)
    torch.cuda.synchronize()
    step_s = (time.perf_counter() - t) / steps
    comm_ms, exposed_ms, by_kind = exposed_comm_ms(trainer)
    peak_mem = torch.cuda.max_memory_allocated() / 2**30
    tokens = cfg.global_batch_size * cfg.model.seq_length
    world = cfg.par.world_size
    row: dict[str, Any] = {
        "config": name, "step_ms": step_s * 1e3, "tokens_per_s": tokens / step_s,
        "mfu": model_flops_per_step(cfg.model, tokens) / step_s / (world * peak * 1e12),
        "peak_mem_gib": peak_mem, "dense_wgrad_gib": trainer.dense_weight_grad_bytes() / 2**30,
        "comm_ms": comm_ms, "exposed_comm_ms": exposed_ms, "final_loss": losses[-1],
        **{f"gpu_ms_{k}": v for k, v in sorted(by_kind.items())},
    }
    if do_ckpt:
        root = tempfile.mkdtemp(prefix="gtp_bench_") if dist.get_rank() == 0 else None
        box = [root]
        dist.broadcast_object_list(box, src=0)
        row.update(ckpt_throughput(trainer, box[0]))
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(box[0], ignore_errors=True)
    vals = [None] * world
    dist.all_gather_object(vals, row)
    # Memory and time: the worst rank is the one that matters.
    row["peak_mem_gib"] = max(v["peak_mem_gib"] for v in vals)
    row["step_ms"] = max(v["step_ms"] for v in vals)
    del trainer
    torch.cuda.empty_cache()
    return row


def worker(args: argparse.Namespace) -> None:
    """One rank (started by gtp_runtime.launch on GPU ``rank``, NCCL group ready)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.backends.cuda.matmul.allow_tf32 = True
    peak = matmul_peak_tflops()
    peaks = [0.0] * world
    dist.all_gather_object(peaks, peak)
    peak = min(peaks)
    model = ModelConfig(vocab_size=args.vocab, hidden=args.hidden, num_layers=args.layers, num_heads=args.heads,
                        ffn_hidden=4 * args.hidden, seq_length=args.seq, gtp_align=16)
    dp = world // (args.cp * args.gtp_remat)
    configs = [
        ("unfolded", ParallelConfig(cp=args.cp, gtp_remat=args.gtp_remat, dp=dp), True),
        ("folded", ParallelConfig(cp=args.cp, gtp_remat=args.gtp_remat, dp=dp, fold_cp=True), True),
        ("folded, no prefetch/overlap", ParallelConfig(cp=args.cp, gtp_remat=args.gtp_remat, dp=dp, fold_cp=True),
         False),
    ]
    rows = []
    for name, par, overlap in configs:
        if args.only and name not in args.only:
            continue
        cfg = TrainConfig(par=par, model=model, micro_batch=args.micro_batch, param_dtype=torch.bfloat16,
                          prefetch=overlap, overlap_grad_reduce=overlap, bucket_size=args.bucket_size)
        rows.append(run_config(name, cfg, args.steps, args.warmup, peak, do_ckpt=args.ckpt and overlap))
        if rank == 0:
            print(json.dumps(rows[-1]), flush=True)
    if rank == 0:
        result = {"peak_bf16_tflops": peak, "world": world, "model": model.to_dict(),
                  "micro_batch": args.micro_batch, "rows": rows, "gpu": torch.cuda.get_device_name(),
                  "torch": torch.__version__, "command": " ".join(sys.argv)}
        from tabulate import tabulate

        print(f"bf16 matmul peak measured: {peak:.0f} TFLOP/s per GPU")
        print(tabulate([{k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()} for r in rows],
                       headers="keys"))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--cp", type=int, default=2)
    ap.add_argument("--gtp-remat", type=int, default=1)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--bucket-size", type=int, default=40_000_000)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--ckpt", action="store_true", help="also measure checkpoint save/load throughput")
    ap.add_argument("--only", nargs="*", default=None, help="run only these config names")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available() or torch.cuda.device_count() < args.nproc:
        print(f"needs {args.nproc} CUDA devices, found {torch.cuda.device_count()}", file=sys.stderr)
        return 2
    try:
        run_local_ranks(args.nproc, worker, (args,), tag="bench_gpu", deadline=None, backend="nccl", stdout="inherit")
    except RankFailure as e:
        print(f"error: {e.line()}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
