"""Async and sync checkpoint save/load against the machine's limits, all measured in one run.

    python benchmarks/bench_ckpt_async.py --write-docs            # CPU, 2 gloo ranks
    python benchmarks/bench_ckpt_async.py --device cuda --nproc 1  # one GPU (pinned staging)

Rows: ``async_blocking_s`` (from the save call until the staging copy is done,
i.e. until the optimizer may update again), ``async_durable_s`` (until the slowest rank's files
are written and fsynced; the commit follows at the next step), ``save_gbps`` (sync save),
``save_without_records_gbps`` / ``records_added_pct`` (the same sync save without the chunk records and
the replica cross-check, and what they add: with ``--record-rounds N``, N more pairs of
sync saves, interleaved with the order flipped every round, and the ratio of the medians),
``load_gbps``, ``step_ms`` and ``step_ms_during_write`` (median step without / while a background write is in flight),
``staging_gib`` (after every one of the async saves: it must not grow), ``dcp_save_gbps`` (PyTorch
DCP's ``dcp.save`` of the same tensors as a plain dict), ``dcp_async_blocking_s`` /
``dcp_async_durable_s`` (``dcp.async_save`` with its ``DefaultStager``, pinned on CUDA),
``torch_save_gbps`` / ``torch_load_gbps`` (the same tensors, one ``torch.save`` file per rank, fsynced)
and the baselines ``dd_direct_write_gbps`` (``dd oflag=direct conv=fdatasync`` of the whole
checkpoint's size) and ``dd_cold_read_gbps`` (``dd iflag=direct``: the page cache cannot help).
Ratios, not absolute figures, are what carries between machines.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from pairs import paired

from gtp_format.layout.config import ModelConfig, ParallelConfig
from gtp_format.names import iter_dir_name
from gtp_runtime.launch import run_local_ranks
from gtp_runtime.training import TrainConfig, Trainer

TITLE = "Async checkpoint save on {where} (blocking time, background write, dd and DCP baselines)"
DOCS = Path(__file__).resolve().parents[1] / "docs"
JSON = {"cpu": DOCS / "ckpt_async_cpu.json", "cuda": DOCS / "gpu_ckpt_results.json"}  # the GPU file holds all GPU rows


def rate(x: float) -> float:
    """4 significant figures: a smoke run's tiny rates are not rounded to 0.0 (its test checks them > 0)."""
    return float(f"{x:.4g}")

def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _timed(fn: Any, device: torch.device) -> float:
    _sync(device)
    dist.barrier()
    t = time.perf_counter()
    fn()
    _sync(device)
    dist.barrier()
    return time.perf_counter() - t


def _free(device: torch.device) -> None:
    """Give back what the previous measurement's copies held before the next one allocates its own.

    Why: on one 80 GB card the trainer's state, the plain dict's clones and ``torch.load``'s copy of
    them (26.3 GB each on the one-GPU shape) did not fit together, so the run died after its
    ``torch.save`` baseline. Nothing measured changes: each figure's own allocations are the same.
    """
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _max(x: float) -> float:
    """The slowest rank's figure (a save is done when the last rank is)."""
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=_GLOO[0])
    return float(t.item())


def _sum(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, group=_GLOO[0])
    return float(t.item())


_GLOO: list[Any] = []


def dd_rates(path: Path, nbytes: int) -> tuple[float, float]:
    """``dd`` direct write (fdatasync) and direct read of ``nbytes``: GB/s each."""
    bs = 16 << 20
    count = max(1, nbytes // bs)
    t = time.perf_counter()
    subprocess.run(["dd", "if=/dev/zero", f"of={path}", f"bs={bs}", f"count={count}", "oflag=direct",
                    "conv=fdatasync"], check=True, capture_output=True)
    w = time.perf_counter() - t
    t = time.perf_counter()
    subprocess.run(["dd", f"if={path}", "of=/dev/null", f"bs={bs}", "iflag=direct"], check=True, capture_output=True)
    r = time.perf_counter() - t
    path.unlink()
    return count * bs / 1e9 / w, count * bs / 1e9 / r


_T0 = [time.perf_counter()]


def _say(what: str) -> None:
    """Progress on rank 0 (a run cut short by a time limit still shows how far each phase got)."""
    if dist.get_rank() == 0:
        print(f"bench_ckpt_async {time.perf_counter() - _T0[0]:7.1f} s: {what}", flush=True)


def _rm(folder: Path) -> None:
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(folder, ignore_errors=True)
    dist.barrier()


def _plain(trainer: Trainer) -> dict[str, torch.Tensor]:
    """This rank's chunks as a plain dict of tensors (what DCP's own stager and torch.save take)."""
    from gtp_runtime.checkpoint.io import rank_state

    return {f"{k}@{o}": v.clone() for k, c in rank_state(trainer).items() for o, v in c.chunks.items()}


def _steps(trainer: Trainer, n: int, saver: Any = None) -> tuple[list[float], list[float]]:
    """``n`` step times (ms): those that started while ``saver``'s write was in flight, and the rest."""
    during, other = [], []
    for _ in range(n):
        busy = bool(saver and saver._pending and not saver._pending.future.done())
        _sync(trainer.device)
        t = time.perf_counter()
        trainer.train_step()
        _sync(trainer.device)
        (during if busy else other).append((time.perf_counter() - t) * 1e3)
    return during, other


def worker(args: argparse.Namespace, out: str) -> None:
    try:
        _worker(args, out)
    except BaseException:
        import traceback

        traceback.print_exc()  # the launcher reports the exception's line only; a benchmark's reader wants where
        raise


def _records_only(args: argparse.Namespace, trainer: Trainer, root: Path, device: torch.device, save: Any) -> None:
    """``--only-records``: ``--record-rounds`` pairs of sync saves with and without the chunk records,
    interleaved (the order flipped every round), and nothing else: a 3% difference on the main shape."""
    with_s: list[float] = []
    without_s: list[float] = []
    nbytes = 0
    stages: dict[bool, dict[str, float]] = {True: {}, False: {}}
    if args.stages:
        import save_stages

        save_stages.install()
        _wall_timers()
    for integrity in (False, True):  # once each, untimed: the first saves allocate the pinned pool
        save(trainer, root / "rounds", integrity=integrity)
        _rm(root / "rounds")
    for i in range(args.record_rounds):
        for integrity in ((True, False) if i % 2 else (False, True)):
            if args.stages:
                save_stages.reset()
                _WALL.clear()
            took = _timed(lambda i=integrity: save(trainer, root / "rounds", integrity=i), device)
            (with_s if integrity else without_s).append(took)
            if args.stages:
                for k, v in {**save_stages.reset(), **{f"wall {k}": v for k, v in _WALL.items()}}.items():
                    stages[integrity][k] = stages[integrity].get(k, 0.0) + v / args.record_rounds
            folder = root / "rounds" / iter_dir_name(trainer.iteration)
            nbytes = sum(f.stat().st_size for f in folder.iterdir() if f.is_file())
            _rm(root / "rounds")
        _say(f"round {i}: with records {with_s[-1]:.2f} s, without {without_s[-1]:.2f} s")
    if dist.get_rank() == 0:
        gb = nbytes / 1e9

        def rate(x: float) -> float:  # 4 significant figures: a smoke run's tiny rates are not rounded to 0.0
            return float(f"{x:.4g}")

        row = {"device": device.type, "ranks": dist.get_world_size(), "ckpt_gb": round(gb, 3),
               "records_added_pct": round(100 * (statistics.median(with_s) / statistics.median(without_s) - 1), 1),
               "records_added_pct_fastest": round(100 * (min(with_s) / min(without_s) - 1), 1),
               **paired(without_s, with_s),
               "record_rounds": len(with_s), "save_with_records_s": [round(x, 3) for x in with_s],
               "save_without_records_s": [round(x, 3) for x in without_s]}
        if args.stages:  # seconds per save: CPU of each stage (save_stages) and wall of the save's phases
            row["stages_with"] = {k: round(v, 3) for k, v in sorted(stages[True].items())}
            row["stages_without"] = {k: round(v, 3) for k, v in sorted(stages[False].items())}
        (root / "rows.json").write_text(json.dumps([row]))
    dist.barrier()


_WALL: dict[str, float] = {}


def _wall_timers() -> None:
    """Wall seconds of a sync save's phases (``--stages``): the statistics' start and finish, and DCP's
    write between them."""
    import torch.distributed.checkpoint as dcp

    import gtp_runtime.checkpoint.io as io_mod

    def timed(name: str, fn: Any) -> Any:
        def run(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                _WALL[name] = _WALL.get(name, 0.0) + time.perf_counter() - t
        return run

    start = io_mod.start_state_stats
    io_mod.start_state_stats = lambda sd: timed("stats finish", timed("stats start", start)(sd))
    io_mod.dcp.save = timed("dcp.save", dcp.save)
    io_mod.rank_state = timed("rank_state incl. replica check", io_mod.rank_state)
    io_mod.finish_save = timed("finish_save (manifest, commit)", io_mod.finish_save)
    io_mod.write_rank_files = timed("write_rank_files", io_mod.write_rank_files)


def _worker(args: argparse.Namespace, out: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    from gtp_runtime.checkpoint.async_save import AsyncCheckpointer
    from gtp_runtime.checkpoint.io import load_checkpoint, save_checkpoint

    rank, world = dist.get_rank(), dist.get_world_size()
    _GLOO.append(dist.new_group(backend="gloo"))
    device = torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")
    model = ModelConfig(vocab_size=args.vocab, hidden=args.hidden, num_layers=args.layers, num_heads=8,
                        ffn_hidden=4 * args.hidden, seq_length=args.seq)
    par = ParallelConfig(cp=2, fold_cp=True) if world == 2 else ParallelConfig(dp=world)
    dtype = torch.bfloat16 if args.bf16 else torch.float32  # bf16 weights, fp32 masters and moments
    trainer = Trainer(TrainConfig(par=par, model=model, micro_batch=1, param_dtype=dtype), device=device)
    root = Path(out)
    _say("model built")
    _steps(trainer, 2)
    step_ms = statistics.median(_steps(trainer, args.steps)[1])

    _say(f"step {step_ms:.1f} ms")
    if args.only_records:
        _records_only(args, trainer, root, device, save_checkpoint)
        return
    sync_s = _timed(lambda: save_checkpoint(trainer, root / "sync"), device)
    folder = root / "sync" / iter_dir_name(trainer.iteration)
    nbytes = sum(f.stat().st_size for f in folder.iterdir() if f.is_file())
    _say(f"sync save {nbytes / 1e9:.2f} GB in {sync_s:.2f} s")
    load_s = _timed(lambda: load_checkpoint(trainer, root / "sync"), device)
    _say(f"load {load_s:.2f} s")
    _rm(root / "sync")  # the disk holds one checkpoint at a time (26 GB each on the H200 shape)
    bare_s = _timed(lambda: save_checkpoint(trainer, root / "bare", integrity=False), device)
    _say(f"sync save without chunk records or the replica check {bare_s:.2f} s")
    _rm(root / "bare")
    with_s, without_s = [sync_s], [bare_s]
    for i in range(args.record_rounds):  # interleaved, the order flipped every round (a 3% difference)
        for integrity in ((True, False) if i % 2 else (False, True)):
            took = _timed(lambda i=integrity: save_checkpoint(trainer, root / "rounds", integrity=i), device)
            (with_s if integrity else without_s).append(took)
            _rm(root / "rounds")
        _say(f"round {i}: with records {with_s[-1]:.2f} s, without {without_s[-1]:.2f} s")

    saver = AsyncCheckpointer()
    t = time.perf_counter()
    saver.prepare(trainer)  # as the launcher does: staging allocated before the first save
    reserve_s = _max(time.perf_counter() - t)
    _say(f"staging reserved in {reserve_s:.2f} s")
    blocking, durable, during, staging = [], [], [], []
    for i in range(args.saves):
        dist.barrier()
        t = time.perf_counter()
        saver.save(trainer, root / "async")
        blocking.append(_max(saver.blocking_s))
        staging.append(_max(saver.staging.nbytes) / 2**30)
        written: list[float] = []
        saver._pending.future.add_done_callback(lambda _f, w=written: w.append(time.perf_counter()))
        times, _ = _steps(trainer, args.steps, saver)
        during.extend(times)
        saver.finalize()
        # files written and fsynced on the slowest rank. result() can return before the done-callback
        # ran (concurrent.futures notifies waiters first), so a missing stamp is now: an upper bound
        durable.append(_max((written[0] if written else time.perf_counter()) - t))
        _say(f"async save {i}: blocked {blocking[-1]:.3f} s, durable {durable[-1]:.2f} s, "
             f"staging {staging[-1]:.2f} GiB")
        if rank == 0 and i < args.saves - 1:  # keep the disk's use at one checkpoint per kind
            shutil.rmtree(root / "async" / iter_dir_name(trainer.iteration - args.steps), ignore_errors=True)
    saver.close()
    del saver  # its pinned staging
    _free(device)
    _rm(root / "async")

    plain = _plain(trainer)
    dcp_s = _timed(lambda: dcp.save(plain, checkpoint_id=str(root / "dcp")), device)
    _rm(root / "dcp")
    _say(f"dcp.save {dcp_s:.2f} s")
    opts = StagingOptions(use_pinned_memory=device.type == "cuda", use_shared_memory=False,
                          use_async_staging=False, use_non_blocking_copy=device.type == "cuda")
    stager = DefaultStager(opts)
    dist.barrier()
    t = time.perf_counter()
    fut = dcp.async_save(plain, checkpoint_id=str(root / "dcp_async"), async_stager=stager, process_group=_GLOO[0])
    block_s = time.perf_counter() - t
    (fut.upload_completion if hasattr(fut, "upload_completion") else fut).result()
    durable_s = time.perf_counter() - t
    # Only now the all-reduces: DCP's background thread runs its own collectives on _GLOO[0] until the
    # future is done, and a collective from this thread on the same group meanwhile pairs with a
    # different one on the other rank (a loaded CI run hung here 600 s).
    dcp_block, dcp_durable = _max(block_s), _max(durable_s)
    stager.close()
    del fut, stager  # DCP's staged copy
    _free(device)
    _rm(root / "dcp_async")
    _say(f"dcp.async_save blocked {dcp_block:.2f} s, durable {dcp_durable:.2f} s")

    tpath = root / f"torch_save_{rank}.pt"

    def tsave() -> None:
        torch.save(plain, tpath)
        with open(tpath, "rb+") as f:
            os.fsync(f.fileno())

    tsave_s = _timed(tsave, device)
    tbytes = _sum(tpath.stat().st_size)
    _say(f"torch.save {tsave_s:.2f} s")
    plain.clear()  # the clones (26 GB on the H200 shape): the load reads the file, not them
    _free(device)
    tload_s = _timed(lambda: torch.load(tpath, map_location=device, weights_only=True), device)
    _free(device)  # the loaded copy, dropped when the call returned
    dist.barrier()
    tpath.unlink()
    dist.barrier()
    if rank == 0:
        ddw, ddr = dd_rates(root / "dd.bin", nbytes)
        gb = nbytes / 1e9
        row = {"device": device.type, "ranks": world, "ckpt_gb": round(gb, 3),
               "async_blocking_s": round(max(blocking), 3), "staging_reserve_s": round(reserve_s, 3),
               "async_durable_s": round(max(durable), 3),
               "save_gbps": rate(gb / sync_s), "save_without_records_gbps": rate(gb / bare_s),
               "records_added_pct": round(100 * (statistics.median(with_s) / statistics.median(without_s) - 1), 1),
               "record_rounds": len(with_s), "save_with_records_s": [round(x, 3) for x in with_s],
               "save_without_records_s": [round(x, 3) for x in without_s],
               "async_write_gbps": rate(gb / max(durable)),
               "dd_direct_write_gbps": round(ddw, 3), "load_gbps": rate(gb / load_s),
               "dd_cold_read_gbps": round(ddr, 3), "torch_save_gbps": rate(tbytes / 1e9 / tsave_s),
               "torch_load_gbps": rate(tbytes / 1e9 / tload_s), "step_ms": round(step_ms, 1),
               "step_ms_during_write": round(statistics.median(during), 1) if during else None,
               "staging_gib": [round(s, 4) for s in staging], "dcp_save_gbps": rate(gb / dcp_s),
               "dcp_async_blocking_s": round(dcp_block, 3), "dcp_async_durable_s": round(dcp_durable, 3)}
        (root / "rows.json").write_text(json.dumps([row]))
    dist.barrier()


ASYNC_CONFIG = "async save (bench_ckpt_async)"


def _write_json(path: Path, cmd: str, rows: list[dict[str, Any]]) -> None:
    """The GPU file also holds ``bench_gpu.py --ckpt``'s rows (``report_gpu.py`` reads them): keep those,
    replace this benchmark's own."""
    doc: dict[str, Any] = {"command": cmd, "rows": []}
    if path.name == "gpu_ckpt_results.json" and path.exists():
        doc = json.loads(path.read_text())
        doc["rows"] = [r for r in doc["rows"] if r.get("config") != ASYNC_CONFIG]
        doc["async_command"] = cmd
        rows = [{"config": ASYNC_CONFIG, **r} for r in rows]
    doc["rows"] += rows
    path.write_text(json.dumps(doc, indent=1) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3, help="steps timed without, and after each save with, a write")
    ap.add_argument("--saves", type=int, default=3, help="async saves (staging must not grow over them)")
    ap.add_argument("--only-records", action="store_true",
                    help="only the interleaved sync saves of --record-rounds (no async, DCP, torch.save or dd)")
    ap.add_argument("--stages", action="store_true", help="with --only-records: CPU and wall seconds per stage")
    ap.add_argument("--record-rounds", type=int, default=0,
                    help="more sync saves with and without the chunk records, interleaved; records_added_pct "
                         "is then the ratio of the medians")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--bf16", action="store_true", help="bf16 params (the GPU shape); fp32 otherwise")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--dir", default=None, help="folder to write in (default: a temporary one); removed after")
    ap.add_argument("--write-docs", action="store_true",
                    help="write docs/ckpt_async_cpu.json (cuda: docs/gpu_ckpt_results.json) and docs/performance.md")
    ap.add_argument("--smoke", action="store_true", help="tiny run (tests/benchmarks)")
    args = ap.parse_args()
    if args.smoke:
        args.hidden, args.layers, args.vocab, args.seq, args.steps, args.saves = 64, 1, 256, 32, 1, 2
        args.record_rounds = 1
    if args.device == "cuda" and torch.cuda.device_count() < args.nproc:
        print(f"error: --device cuda needs {args.nproc} CUDA device(s); found {torch.cuda.device_count()}",
              file=sys.stderr)
        return 2
    out = tempfile.mkdtemp(prefix="gtp_ckpt_async_", dir=args.dir)
    try:
        # the smoke run is bounded (a hung rank fails it in minutes, naming the rank); a real run is not
        run_local_ranks(args.nproc, worker, (args, out), tag="bench_ckpt_async", deadline=600 if args.smoke else None,
                        backend="nccl" if args.device == "cuda" else "gloo", stdout="inherit")
        rows = json.loads((Path(out) / "rows.json").read_text())
    finally:
        shutil.rmtree(out, ignore_errors=True)
    print(json.dumps(rows, indent=1))
    if args.write_docs:
        from docs_section import write_section
        from tabulate import tabulate

        cmd = "python benchmarks/bench_ckpt_async.py " + " ".join(sys.argv[1:])
        _write_json(JSON[args.device], cmd.strip(), rows)
        flat = [{k: (v[-1] if isinstance(v, list) else v) for k, v in r.items()} for r in rows]
        ranks = f"{rows[0]['ranks']} {'NCCL' if args.device == 'cuda' else 'gloo'} ranks"
        dtypes = "bf16 weights, fp32 masters and both Adam moments" if args.bf16 else \
            "fp32 (weights, masters, both Adam moments)"
        body = "\n".join([
            f"{ranks}, model hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, seq {args.seq}, "
            f"{dtypes}; {args.saves} async saves. Every figure of a row is from the same run; all rows in "
            f"`docs/{JSON[args.device].name}` (`staging_gib` per save).", "",
            "```", cmd.strip(), "```", "", tabulate(flat, headers="keys", tablefmt="github"), ""])
        write_section(TITLE.format(where="one GPU" if args.device == "cuda" else "CPU"), body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
