"""GPU benchmark: folded vs unfolded, unfused vs fused element-wise kernels, in the same run (NCCL).

    python benchmarks/bench_gpu.py --json docs/gpu_results.json

The default suite on 2 GPUs (cp2, gtp_remat 1): hidden 4096 / 8 layers / sequence 8192 unfolded
and folded, each unfused (the baseline) and with ``--fused compile``; folded with Liger-Kernel
(when it imports); unfolded fused without overlap (what overlapping the dp_cp bucket reduction
buys); folded fused with the CP attention on SDPA's flash kernel instead of cuDNN blocks (what
the cuDNN path buys); a second shape (hidden 8192, 4 layers, sequence 16384)
unfolded and folded fused; and a folded fused sweep over sequence length (``--sweep``).

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
import gc
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
from gtp_runtime import context_parallel
from gtp_runtime.launch import RankFailure, run_local_ranks
from gtp_runtime.training import TrainConfig, Trainer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import trace_exposed  # noqa: E402  (a sibling script, importable as a module)


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


# Interval arithmetic shared with trace_exposed.py (spans as (start, end) pairs of any number type).
_union, _intersect = trace_exposed.union, trace_exposed.intersect


def _length(iv: list[tuple[int, int]]) -> int:
    return sum(e - s for s, e in iv)


KERNEL_KINDS = (("comm", ("nccl",)), ("attention", ("fmha", "flash", "attention", "efficient")),
                ("gemm", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "sm90")))


PHASES = ("zero_grad+batch", "forward", "backward", "optimizer")


def kernel_kind(name: str) -> str:
    low = name.lower()
    return next((kind for kind, keys in KERNEL_KINDS if any(k in low for k in keys)), "other")


def exposed_comm_ms(trainer: Trainer, trace: str | None = None,
                    steps: int = 3) -> tuple[float, float, dict[str, float], dict[str, Any]]:
    """(total NCCL kernel time, NCCL time not overlapped by any compute kernel, GPU time by kernel
    kind, where the rest goes) per step, in ms, averaged over ``steps`` traced steps. The kinds say
    where a step's time goes when MFU is low; the rest says how long the GPU ran nothing, in which
    phase of the step, and which non-GEMM, non-attention kernels cost most.

    Several steps, not one: on 2 x H200 one traced step of the same unfolded configuration read
    4.2 ms exposed in one run and 34.1 ms in the next, while step times agreed within 3%."""
    from torch.profiler import ProfilerActivity, profile, schedule

    # One profiled warm-up step first: the profiler's start costs each rank a different time, and
    # the first collective then shows the other rank's wait (20 ms once) as NCCL time.
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                 schedule=schedule(wait=0, warmup=1, active=steps, repeat=1)) as prof:
        for i in range(steps + 1):
            trainer.train_step()
            if i == steps:
                torch.cuda.synchronize()
            prof.step()
    # The Chrome trace carries what prof.events() lacks (host launch times by correlation id), which
    # trace_exposed.py needs to tell communication the GPU waited for from a host-bound gap.
    path = trace or os.path.join(tempfile.mkdtemp(prefix="gtp_trace_"), "trace.json")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)  # kineto fails silently without it
    prof.export_chrome_trace(path)
    with open(path) as f:
        waits = trace_exposed.analyse(json.load(f)["traceEvents"], min_ms=1e9)
    if not trace:
        shutil.rmtree(os.path.dirname(path), ignore_errors=True)
    comm, comp = [], []
    by_kind: dict[str, float] = {}
    other: dict[str, list[float]] = {}
    phases: list[tuple[str, int, int]] = []
    for ev in prof.events():
        start, end = int(ev.time_range.start * 1000), int(ev.time_range.end * 1000)
        if ev.name in PHASES:  # record_function labels: a CPU range and its GPU span, neither a kernel
            if ev.device_type != torch.autograd.DeviceType.CUDA:
                phases.append((ev.name, start, end))
            continue
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        kind = kernel_kind(ev.name)
        by_kind[kind] = by_kind.get(kind, 0.0) + (end - start) / 1e6
        (comm if kind == "comm" else comp).append((start, end))
        if kind == "other":
            o = other.setdefault(ev.name[:90], [0.0, 0])
            o[0] += (end - start) / 1e6
            o[1] += 1
    cu, pu = _union(comm), _union(comp)
    busy = _union(comm + comp)
    gaps = [(busy[i][1], busy[i + 1][0]) for i in range(len(busy) - 1)]
    idle_by_phase: dict[str, float] = {}
    for s, e in gaps:
        name = next((n for n, ps, pe in phases if ps <= s < pe), "between phases")
        idle_by_phase[name] = idle_by_phase.get(name, 0.0) + (e - s) / 1e6
    top = sorted(other.items(), key=lambda kv: -kv[1][0])[:12]
    per = 1e6 * steps
    by_kind = {k: v / steps for k, v in by_kind.items()}
    rest = {"comm_wait_ms": waits["comm_wait_ms"] / steps, "gpu_busy_ms": _length(busy) / per,
            "gpu_idle_ms": sum(e - s for s, e in gaps) / per,
            "idle_by_phase_ms": {k: v / steps for k, v in idle_by_phase.items()},
            "top_other_kernels": [[n, ms / steps, c // steps] for n, (ms, c) in top]}
    return _length(cu) / per, (_length(cu) - _intersect(cu, pu)) / per, by_kind, rest


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


class GcTimer:
    """Time spent in Python's garbage collector while active (a host pause the GPU may wait for)."""

    def __init__(self) -> None:
        self.seconds, self.collections, self._t, self.active = 0.0, 0, 0.0, False

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if not self.active:
            return
        if phase == "start":
            self._t = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._t
            self.collections += 1


def run_config(name: str, cfg: TrainConfig, steps: int, warmup: int, peak: float, do_ckpt: bool,
               trace: str | None = None) -> dict[str, Any]:
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    trainer = Trainer(cfg, device=torch.device("cuda", torch.cuda.current_device()))
    for _ in range(warmup):
        trainer.train_step()
    torch.cuda.synchronize()
    dist.barrier()
    gc_timer = GcTimer()
    gc.callbacks.append(gc_timer)
    gc_timer.active = True
    t = time.perf_counter()
    losses = []
    for _ in range(steps):
        losses.append(trainer.train_step().loss)
    torch.cuda.synchronize()
    step_s = (time.perf_counter() - t) / steps
    gc_timer.active = False
    gc.callbacks.remove(gc_timer)
    rank_trace = trace and trace.replace(".json", f"_rank{dist.get_rank()}.json")
    comm_ms, exposed_ms, by_kind, rest = exposed_comm_ms(trainer, rank_trace)
    peak_mem = torch.cuda.max_memory_allocated() / 2**30
    tokens = cfg.global_batch_size * cfg.model.seq_length
    world = cfg.par.world_size
    m = cfg.model
    row: dict[str, Any] = {
        "config": name, "fused": cfg.fused or "none", "fold_cp": cfg.par.fold_cp, "overlap": cfg.overlap_grad_reduce,
        "hidden": m.hidden, "layers": m.num_layers, "heads": m.num_heads, "seq": m.seq_length,
        "step_ms": step_s * 1e3, "tokens_per_s": tokens / step_s,
        "mfu": model_flops_per_step(cfg.model, tokens) / step_s / (world * peak * 1e12),
        "peak_mem_gib": peak_mem, "dense_wgrad_gib": trainer.dense_weight_grad_bytes() / 2**30,
        "comm_ms": comm_ms, "exposed_comm_ms": exposed_ms, "final_loss": losses[-1],
        "gc_ms_per_step": gc_timer.seconds * 1e3 / steps, "gc_collections": gc_timer.collections,
        "host_cpus": len(os.sched_getaffinity(0)),
        **{f"gpu_ms_{k}": v for k, v in sorted(by_kind.items())}, **rest,
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
    row["exposed_comm_ms_worst_rank"] = max(v["exposed_comm_ms"] for v in vals)
    row["comm_wait_ms_worst_rank"] = max(v["comm_wait_ms"] for v in vals)
    del trainer
    gc.collect()
    torch.cuda.empty_cache()
    return row


def suite(args: argparse.Namespace) -> list[tuple[str, ModelConfig, bool, bool, str | None]]:
    """(name, model, fold_cp, prefetch/overlap, fused) of every configuration, in run order."""
    def shape(hidden: int, layers: int, heads: int, seq: int) -> ModelConfig:
        return ModelConfig(vocab_size=args.vocab, hidden=hidden, num_layers=layers, num_heads=heads,
                           ffn_hidden=4 * hidden, seq_length=seq, gtp_align=16)

    main = shape(args.hidden, args.layers, args.heads, args.seq)
    fused = args.fused
    out = [("unfolded", main, False, True, None), ("folded", main, True, True, None),
           (f"unfolded {fused}", main, False, True, fused), (f"folded {fused}", main, True, True, fused),
           (f"unfolded {fused}, no overlap", main, False, False, fused),
           (f"folded {fused}, sdpa attention", main, True, True, fused)]
    if args.liger:
        out.append(("folded liger", main, True, True, "liger"))
    if args.hidden2:
        second = shape(args.hidden2, args.layers2, args.heads2, args.seq2)
        out += [(f"unfolded {fused} (shape 2)", second, False, True, fused),
                (f"folded {fused} (shape 2)", second, True, True, fused)]
    out += [(f"folded {fused} seq {s}", shape(args.hidden, args.layers, args.heads, s), True, True, fused)
            for s in args.sweep if s != args.seq]
    return out


def _trace_path(args: argparse.Namespace, name: str) -> str | None:
    if not args.trace_dir:
        return None
    return os.path.join(args.trace_dir, "trace_" + "".join(c if c.isalnum() else "_" for c in name) + ".json")


def worker(args: argparse.Namespace) -> None:
    """One rank (started by :func:`gtp_runtime.launch.run_local_ranks` with NCCL, one GPU each)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.sm_carveout:  # cuBLAS GEMMs leave this many SMs to the NCCL kernels that run beside them
        torch._C._set_sm_carveout_experimental(args.sm_carveout)
    from gtp_runtime import sharding

    if args.prefetch_depth is not None:
        sharding.PREFETCH_DEPTH = args.prefetch_depth
    if args.gather_batch is not None:
        sharding.GATHER_BATCH = args.gather_batch
    if args.keep_last is not None:
        sharding.KEEP_LAST = args.keep_last
    attention = context_parallel.CP_ATTENTION
    torch.backends.cuda.matmul.allow_tf32 = True
    peak = matmul_peak_tflops()
    peaks = [0.0] * world
    dist.all_gather_object(peaks, peak)
    peak = min(peaks)
    dp = world // (args.cp * args.gtp_remat)
    rows: list[dict[str, Any]] = []
    for name, model, fold, overlap, fused in suite(args):
        if args.only and name not in args.only:
            continue
        # CP attention as configured (cuDNN blocks on CUDA unless GTP_CP_ATTENTION says otherwise), or,
        # for the comparison row, on SDPA's flash kernel.
        context_parallel.CP_ATTENTION = "sdpa" if name.endswith("sdpa attention") else attention
        par = ParallelConfig(cp=args.cp, gtp_remat=args.gtp_remat, dp=dp, fold_cp=fold)
        cfg = TrainConfig(par=par, model=model, micro_batch=args.micro_batch, param_dtype=torch.bfloat16,
                          prefetch=overlap, overlap_grad_reduce=overlap, bucket_size=args.bucket_size, fused=fused)
        try:
            rows.append(run_config(name, cfg, args.steps, args.warmup, peak, do_ckpt=args.ckpt and overlap,
                                   trace=_trace_path(args, name)))
        except (ImportError, torch.OutOfMemoryError) as e:  # raised alike on every rank, before any collective
            rows.append({"config": name, "error": f"{type(e).__name__}: {str(e)[:300]}"})
            torch.cuda.empty_cache()
        if rank == 0:
            print(json.dumps(rows[-1]), flush=True)
            if args.json:  # after every configuration: a run cut short still leaves its rows
                _write(args, peak, world, rows)
    if rank == 0:
        from tabulate import tabulate

        print(f"bf16 matmul peak measured: {peak:.0f} TFLOP/s per GPU")
        keys = ("config", "step_ms", "mfu", "peak_mem_gib", "exposed_comm_ms", "comm_wait_ms", "gpu_ms_gemm",
                "gpu_ms_attention", "gpu_ms_other", "gpu_idle_ms", "gc_ms_per_step", "error")
        print(tabulate([{k: (round(r[k], 3) if isinstance(r.get(k), float) else r.get(k)) for k in keys}
                        for r in rows], headers="keys"))


def _write(args: argparse.Namespace, peak: float, world: int, rows: list[dict[str, Any]]) -> None:
    main = ModelConfig(vocab_size=args.vocab, hidden=args.hidden, num_layers=args.layers, num_heads=args.heads,
                       ffn_hidden=4 * args.hidden, seq_length=args.seq, gtp_align=16)
    result = {"peak_bf16_tflops": peak, "world": world, "model": main.to_dict(), "micro_batch": args.micro_batch,
              "rows": rows, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "command": " ".join(sys.argv)}
    with open(args.json + ".tmp", "w") as f:
        json.dump(result, f, indent=1)
    os.replace(args.json + ".tmp", args.json)


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
    ap.add_argument("--fused", choices=("compile", "liger"), default="compile", help="the fused backend measured")
    ap.add_argument("--liger", action=argparse.BooleanOptionalAction, default=True,
                    help="also run folded with Liger-Kernel (recorded as an error row if it does not import)")
    ap.add_argument("--hidden2", type=int, default=8192, help="second shape (0: none)")
    ap.add_argument("--layers2", type=int, default=4)
    ap.add_argument("--heads2", type=int, default=64)
    ap.add_argument("--seq2", type=int, default=16384)
    ap.add_argument("--sweep", type=int, nargs="*", default=[4096, 8192, 16384, 32768, 65536],
                    help="sequence lengths of the folded fused sweep (the main --seq is reused)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--trace-dir", default=None, help="write each rank's traced steps of each configuration here "
                    "(Chrome trace JSON, for chrome://tracing or Perfetto)")
    ap.add_argument("--sm-carveout", type=int, default=0,
                    help="SMs cuBLAS leaves free (torch._C._set_sm_carveout_experimental); 0: none")
    ap.add_argument("--gather-batch", type=int, default=None,
                    help="weights one prefetch gathers together (gtp_runtime.sharding.GATHER_BATCH)")
    ap.add_argument("--keep-last", type=int, default=None,
                    help="last weights kept gathered from forward to backward (gtp_runtime.sharding.KEEP_LAST)")
    ap.add_argument("--prefetch-depth", type=int, default=None,
                    help="weights gathered ahead (gtp_runtime.sharding.PREFETCH_DEPTH; default: the library's)")
    ap.add_argument("--smoke", action="store_true", help="tiny run (tests/benchmarks): every size option tiny")
    args = ap.parse_args()
    if args.smoke:
        vars(args).update(hidden=64, layers=1, heads=4, seq=256, vocab=256, steps=1, warmup=1, bucket_size=100_000)
    if not torch.cuda.is_available() or torch.cuda.device_count() < args.nproc:
        print(f"needs {args.nproc} CUDA devices, found {torch.cuda.device_count()}", file=sys.stderr)
        return 2
    try:  # rank 0 prints the table; a failing rank is named in one line, its traceback in its log
        run_local_ranks(args.nproc, worker, (args,), tag="bench_gpu", backend="nccl", stdout="inherit", deadline=None)
    except RankFailure as e:
        print(f"bench_gpu: {e.line()}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
