"""What the chunk records and the replica cross-check add to a sync save on CPU, against the same run's save
without them.

    python benchmarks/bench_save_integrity.py --write-docs

Two gloo ranks (GTP_remat 2, DP 1: norms are replicated, so the cross-check has work), after
``--steps`` training steps (so Adam's moments are not the zeros the statistics skip), save the same
trainer state alternately with ``integrity=True`` (the default: replica cross-check, statistics of
every chunk, xxh3-128 of every chunk in the O_DIRECT sink as it writes) and ``integrity=False``
(only the file CRC-32C the sink computes anyway), ``--repeat`` times each, interleaved (the order flipped every
round) so that both see the same machine; the fastest and the median of each are the figures (a shared machine only
ever slows a run down). Rank 0 also times each part on its own state: the replica check, the
statistics, the xxh3-128 of its files' bytes from memory (what the sink adds to its writer
threads), and the read-back of its files with the chunk hashes that the save did before the sink
hashed (``record_file``), which the save no longer pays; and ``verify --data``'s rate (the
library, warm) on the saved checkpoint with and without its chunk-hash checks, against ``cat``.
Inside every save, :mod:`save_stages`' timers take each stage's CPU seconds (what the records add
is CPU; on a shared machine that is what shows in the wall time), and each numpy pass of the
statistics is run alone over rank 0's float32 chunks.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import save_stages
import torch
import torch.distributed as dist
from bench_ckpt_cpu import timed_save  # the same save timing between barriers as the CPU save benchmark
from pairs import paired

from gtp_format.layout.config import ModelConfig, ParallelConfig
from gtp_runtime.launch import run_local_ranks
from gtp_runtime.training import TrainConfig, Trainer

TITLE = "Checkpoint save on CPU: cost of chunk records and the replica cross-check"


def _parts(trainer: Trainer, folder: Path) -> tuple[dict[str, float], dict[str, float]]:
    """Seconds of each integrity step on this rank, timed alone (collectives included for the check),
    and of each pass of the statistics (:func:`_stat_passes`)."""
    from gtp_format.writer.checkpoint import file_entry
    from gtp_runtime.checkpoint.chunk_records import state_stats
    from gtp_runtime.checkpoint.replicas import check_replicas
    from gtp_runtime.checkpoint.state import bucket_numel_state, model_state, optimizer_state

    sd = {**model_state(trainer.model, trainer.groups, False), **optimizer_state(trainer.optimizer, trainer.groups),
          **bucket_numel_state(trainer.optimizer, trainer.groups, False)}
    full = model_state(trainer.model, trainer.groups, for_load=True)
    out = {"replica check s": timed_save(lambda: check_replicas(trainer, [full, sd]))}
    t = time.perf_counter()
    state_stats(sd)
    out["statistics s"] = time.perf_counter() - t
    passes = _stat_passes(sd)
    own = sorted(folder.glob(f"__{dist.get_rank()}_*.distcp"))
    from gtp_format.integrity.hash import chunk_digest

    blobs = [p.read_bytes() for p in own]
    t = time.perf_counter()
    for b in blobs:  # one digest per MiB stands in for the chunks, as below
        view = memoryview(b)
        for i in range(0, len(b), 1 << 20):
            chunk_digest(view[i:i + (1 << 20)])
    out["sink xxh3 from memory s"] = time.perf_counter() - t
    del blobs
    t = time.perf_counter()
    for p in own:
        file_entry(p)
    out["read-back CRC only s"] = time.perf_counter() - t
    from gtp_format.integrity.record_file import Span, record_file

    t = time.perf_counter()
    for p in own:  # one span per MiB stands in for the chunks: the hashing work is per byte
        size = p.stat().st_size
        record_file(p, p.name, [Span("k", (i,), i << 20, min(1 << 20, size - (i << 20)), None)
                                for i in range((size + (1 << 20) - 1) >> 20)])
    out["read-back CRC + chunk hashes (no longer run) s"] = time.perf_counter() - t
    return out, passes


def _stat_passes(sd: dict[str, Any]) -> dict[str, float]:
    """CPU seconds (this thread's) over this rank's float32 chunks, in the statistics' own blocks: the fused
    loop the save runs (:func:`element_stats`), and each numpy pass of the statistics as they were before it
    (min, max, the zero count, the fp64 cast, square and pairwise sum), each pass run alone. CPU, not wall:
    the other rank runs the same passes on the same cores meanwhile."""
    import numpy as np

    from gtp_format.dtypes import by_name
    from gtp_format.integrity.stats import BLOCK_BYTES, element_stats
    from gtp_runtime.checkpoint.dcp_chunks import Chunks

    arrays = [t.detach().contiguous().numpy() for v in sd.values() if isinstance(v, Chunks)
              for t in v.chunks.values() if t.dtype == torch.float32]
    block = BLOCK_BYTES // 4
    buf = np.empty(block, np.float64)
    passes = {"min": lambda b: b.min(), "max": lambda b: b.max(), "zeros (== 0, count)": lambda b:
              np.count_nonzero(b == 0), "fp64 cast (astype)": lambda b: b.astype(np.float64),
              "square (fp64, in place)": lambda b: np.square(buf[:b.size], out=buf[:b.size]),
              "sum (fp64, pairwise)": lambda b: buf[:b.size].sum()}
    element_stats(arrays[0][:8], by_name("float32"))  # the compiled loop loaded (or compiled) before timing
    t = time.thread_time()
    for a in arrays:
        element_stats(a, by_name("float32"))
    out = {"the fused loop (all figures, the save's)": round(time.thread_time() - t, 3)}
    for name, op in passes.items():
        t = time.thread_time()
        for a in arrays:
            flat = a.reshape(-1)
            for i in range(0, flat.size, block):
                op(flat[i:i + block])
        out[f"numpy pass before it: {name}"] = round(time.thread_time() - t, 3)
    return out


def _verify_rates(folder: Path, repeat: int) -> dict[str, str]:
    """``verify --data`` (the library, warm) with and without the chunk-hash checks, against ``cat``."""
    import subprocess

    import gtp_format.check.verify as verify_module
    from gtp_format.reader.checkpoint import open_checkpoint

    files = [str(f) for f in sorted(folder.iterdir()) if f.is_file()]
    gb = sum(os.path.getsize(f) for f in files) / 1e9

    def best(fn: object) -> float:
        times = []
        for _ in range(repeat + 1):  # the first run warms the page cache
            t = time.perf_counter()
            fn()  # type: ignore[operator]
            times.append(time.perf_counter() - t)
        return min(times[1:])

    cat = best(lambda: subprocess.run(["cat", *files], stdout=subprocess.DEVNULL, check=True))
    with_s = best(lambda: verify_module.verify(open_checkpoint(folder), data=True))
    read = verify_module.read_records
    verify_module.read_records = lambda ckpt: None  # today's pass: file checksums only
    try:
        without_s = best(lambda: verify_module.verify(open_checkpoint(folder), data=True))
    finally:
        verify_module.read_records = read
    return {"cat GB/s": f"{gb / cat:.2f}", "verify --data GB/s (no chunk hashes)": f"{gb / without_s:.2f}",
            "vs cat": f"{cat / without_s:.2f}x", "verify --data GB/s (chunk hashes)": f"{gb / with_s:.2f}",
            "vs cat ": f"{cat / with_s:.2f}x"}


def _cpu_s() -> float:
    """This process's CPU seconds so far (every thread, user + system)."""
    use = resource.getrusage(resource.RUSAGE_SELF)
    return use.ru_utime + use.ru_stime


def worker(args: argparse.Namespace, out: str) -> None:
    from gtp_runtime.checkpoint.io import save_checkpoint

    save_stages.install()
    model = ModelConfig(vocab_size=args.vocab, hidden=args.hidden, num_layers=args.layers, num_heads=16,
                        ffn_hidden=4 * args.hidden, seq_length=32)
    trainer = Trainer(TrainConfig(par=ParallelConfig(gtp_remat=2), model=model, micro_batch=1))
    for _ in range(args.steps):  # the state a run saves: Adam's moments are zero before the first step
        trainer.train_step()
    root = Path(out)
    for integrity in (False, True):  # once each, untimed: the first save of a process loads what later ones
        save_checkpoint(trainer, root / f"warm_{int(integrity)}", integrity=integrity)  # reuse (numba's kernels)
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(root / f"warm_{int(integrity)}", ignore_errors=True)
        dist.barrier()
    times: dict[bool, list[float]] = {True: [], False: []}
    cpu: dict[bool, list[float]] = {True: [], False: []}
    stages: dict[bool, dict[str, float]] = {True: {}, False: {}}
    for i in range(args.repeat):
        # interleaved, the order flipped every round, so that neither kind always follows the other
        for integrity in ((False, True) if i % 2 == 0 else (True, False)):
            target = root / f"run_{int(integrity)}_{i}"
            save_stages.reset()
            c = _cpu_s()
            times[integrity].append(timed_save(lambda t=target, g=integrity: save_checkpoint(trainer, t, integrity=g)))
            cpu[integrity].append(_cpu_s() - c)
            for k, v in save_stages.reset().items():
                stages[integrity][k] = stages[integrity].get(k, 0.0) + v
            folder = target / f"iter_{trainer.iteration:07d}"
            size = sum(f.stat().st_size for f in folder.iterdir() if f.is_file())
            last = i == args.repeat - 1 and integrity
            if last:
                kept = target
                parts, passes = _parts(trainer, folder)
                if dist.get_rank() == 0:
                    rates = _verify_rates(folder, args.repeat)
            dist.barrier()
            if dist.get_rank() == 0 and not last:
                shutil.rmtree(target, ignore_errors=True)
            dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(kept, ignore_errors=True)
        with_s, without_s = min(times[True]), min(times[False])
        with_m, without_m = statistics.median(times[True]), statistics.median(times[False])
        row = {"GB": round(size / 1e9, 3), "save without s": round(without_s, 3), "save with s": round(with_s, 3),
               "added (fastest)": f"{(with_s / without_s - 1) * 100:+.1f}%",
               "added (median)": f"{(with_m / without_m - 1) * 100:+.1f}%",
               **paired(times[False], times[True]),
               **{k: round(v, 3) for k, v in parts.items()}}
        without, with_ = (save_stages.table_row(stages[g], args.repeat) for g in (False, True))
        cpu_rows = [{"stage (rank 0, CPU s per save)": "whole rank (median)",
                     "without records": round(statistics.median(cpu[False]), 3),
                     "with records": round(statistics.median(cpu[True]), 3)}]
        cpu_rows += [{"stage (rank 0, CPU s per save)": k, "without records": without.get(k, 0.0),
                      "with records": with_.get(k, 0.0)} for k in sorted(without.keys() | with_.keys())]
        for r in cpu_rows:
            r["added"] = round(r["with records"] - r["without records"], 3)
        (root / "row.json").write_text(json.dumps({"save": row, "verify": rates, "stages": cpu_rows,
                                                   "passes": [{"statistics pass (rank 0, alone)": k, "CPU s": v}
                                                              for k, v in passes.items()],
                                                   "saves": {"without": times[False], "with": times[True]}}))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--repeat", type=int, default=3, help="saves of each kind; the fastest is kept")
    ap.add_argument("--steps", type=int, default=1, help="training steps before the saves (0: zero moments, "
                    "which the statistics skip as all-zero blocks)")
    ap.add_argument("--write-docs", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="tiny run (tests/benchmarks): hidden 64, one layer, once")
    args = ap.parse_args()
    if args.smoke:
        args.hidden, args.layers, args.vocab, args.repeat = 64, 1, 256, 1
    out = tempfile.mkdtemp(prefix="gtp_save_integrity_")
    try:
        run_local_ranks(2, worker, (args, out), tag="bench_save_integrity", deadline=None)
        rows = json.loads((Path(out) / "row.json").read_text())
    finally:
        shutil.rmtree(out, ignore_errors=True)
    from tabulate import tabulate

    text = tabulate([rows["save"]], headers="keys", tablefmt="github")
    text += "\n\n" + tabulate([rows["verify"]], headers="keys", tablefmt="github")
    text += "\n\n" + tabulate(rows["stages"], headers="keys", tablefmt="github")
    text += "\n\n" + tabulate(rows["passes"], headers="keys", tablefmt="github")
    print(text)
    print("saves without (s):", " ".join(f"{t:.3f}" for t in rows["saves"]["without"]))
    print("saves with (s):   ", " ".join(f"{t:.3f}" for t in rows["saves"]["with"]))
    if args.write_docs:
        sys.path.insert(0, os.path.dirname(__file__))
        from docs_section import write_report

        intro = (f"Two gloo ranks (GTP_remat 2), model hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, "
                 f"fp32, torch_dist, after {args.steps} training step(s); the same trainer state saved with and "
                 f"without the chunk records and the replica cross-check, {args.repeat} of each interleaved (the "
                 "order flipped every round), fastest and median of each. The parts are rank 0's, each timed alone. "
                 "Second table: `verify(data=True)` (the library) of the last checkpoint, warm, with its chunk-hash "
                 "checks and without them (the pass as it was: file checksums only), against `cat` of the same files. "
                 "Third: rank 0's CPU seconds per save by stage, from timers inside the saves "
                 "(`benchmarks/save_stages.py`). Fourth: each numpy pass of the statistics over rank 0's float32 "
                 "chunks, run alone (CPU seconds).")
        write_report(TITLE, intro, "python benchmarks/bench_save_integrity.py " + " ".join(sys.argv[1:]), text, [])
    return 0


if __name__ == "__main__":
    sys.exit(main())
