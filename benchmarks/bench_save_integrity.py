"""What the chunk records and the replica cross-check add to a sync save on CPU, against the same run's save
without them.

    python benchmarks/bench_save_integrity.py --write-docs

Two gloo ranks (GTP_remat 2, DP 1: norms are replicated, so the cross-check has work) save the same
trainer state alternately with ``integrity=True`` (the default: replica cross-check, statistics of
every chunk, xxh3-128 of every chunk in the O_DIRECT sink as it writes) and ``integrity=False``
(only the file CRC-32C the sink computes anyway), ``--repeat`` times each, interleaved so that both
see the same machine; the fastest and the median of each are the figures (a shared machine only
ever slows a run down). Rank 0 also times each part on its own state: the replica check, the
statistics, the xxh3-128 of its files' bytes from memory (what the sink adds to its writer
threads), and the read-back of its files with the chunk hashes that the save did before the sink
hashed (``record_file``), which the save no longer pays; and ``verify --data``'s rate (the
library, warm) on the saved checkpoint with and without its chunk-hash checks, against ``cat``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch.distributed as dist
from bench_ckpt_cpu import _timed  # the same save timing between barriers as the CPU save benchmark

from gtp_format.layout.config import ModelConfig, ParallelConfig
from gtp_runtime.launch import run_local_ranks
from gtp_runtime.training import TrainConfig, Trainer

TITLE = "Checkpoint save on CPU: cost of chunk records and the replica cross-check"


def _parts(trainer: Trainer, folder: Path) -> dict[str, float]:
    """Seconds of each integrity step on this rank, timed alone (collectives included for the check)."""
    from gtp_format.writer.checkpoint import file_entry
    from gtp_runtime.checkpoint.chunk_records import state_stats
    from gtp_runtime.checkpoint.replicas import check_replicas
    from gtp_runtime.checkpoint.state import bucket_numel_state, model_state, optimizer_state

    sd = {**model_state(trainer.model, trainer.groups, False), **optimizer_state(trainer.optimizer, trainer.groups),
          **bucket_numel_state(trainer.optimizer, trainer.groups, False)}
    full = model_state(trainer.model, trainer.groups, for_load=True)
    out = {"replica check s": _timed(lambda: check_replicas(trainer, [full, sd]))}
    t = time.perf_counter()
    state_stats(sd)
    out["statistics s"] = time.perf_counter() - t
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


def worker(args: argparse.Namespace, out: str) -> None:
    from gtp_runtime.checkpoint.io import save_checkpoint

    model = ModelConfig(vocab_size=args.vocab, hidden=args.hidden, num_layers=args.layers, num_heads=16,
                        ffn_hidden=4 * args.hidden, seq_length=32)
    trainer = Trainer(TrainConfig(par=ParallelConfig(gtp_remat=2), model=model, micro_batch=1))
    root = Path(out)
    times: dict[bool, list[float]] = {True: [], False: []}
    for i in range(args.repeat):
        for integrity in (False, True):
            target = root / f"run_{int(integrity)}_{i}"
            times[integrity].append(_timed(lambda t=target, g=integrity: save_checkpoint(trainer, t, integrity=g)))
            folder = target / "iter_0000000"
            size = sum(f.stat().st_size for f in folder.iterdir() if f.is_file())
            if i == args.repeat - 1 and integrity:
                parts = _parts(trainer, folder)
                if dist.get_rank() == 0:
                    rates = _verify_rates(folder, args.repeat)
            dist.barrier()
            if dist.get_rank() == 0 and not (i == args.repeat - 1 and integrity):
                shutil.rmtree(target, ignore_errors=True)
            dist.barrier()
    if dist.get_rank() == 0:
        with_s, without_s = min(times[True]), min(times[False])
        with_m, without_m = statistics.median(times[True]), statistics.median(times[False])
        row = {"GB": round(size / 1e9, 3), "save without s": round(without_s, 3), "save with s": round(with_s, 3),
               "added (fastest)": f"{(with_s / without_s - 1) * 100:+.1f}%",
               "added (median)": f"{(with_m / without_m - 1) * 100:+.1f}%",
               **{k: round(v, 3) for k, v in parts.items()}}
        (root / "row.json").write_text(json.dumps({"save": row, "verify": rates}))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--repeat", type=int, default=3, help="saves of each kind; the fastest is kept")
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
    print(text)
    if args.write_docs:
        sys.path.insert(0, os.path.dirname(__file__))
        from docs_section import write_report

        intro = (f"Two gloo ranks (GTP_remat 2), model hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, "
                 "fp32, torch_dist; the same trainer state saved alternately with and without the chunk records and "
                 f"the replica cross-check, fastest and median of {args.repeat} each. The parts are rank 0's, each "
                 "timed alone. "
                 "Second table: `verify(data=True)` (the library) of the last checkpoint, warm, with its chunk-hash "
                 "checks and without them (the pass as it was: file checksums only), against `cat` of the same files.")
        write_report(TITLE, intro, "python benchmarks/bench_save_integrity.py " + " ".join(sys.argv[1:]), text, [])
    return 0


if __name__ == "__main__":
    sys.exit(main())
