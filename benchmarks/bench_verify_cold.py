"""Benchmark: ``ckpt verify --data`` cold against ``cat`` of the same files cold, without root.

``bench_verify.py`` empties the whole page cache (``/proc/sys/vm/drop_caches``), which needs root
and, on a shared machine, slows every other job. Here each file of the checkpoint is evicted on its
own before every measurement: ``fsync``, then ``posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED)``,
which drops the file's clean pages (``vmtouch -e`` does the same). An untimed warm ``cat`` is also
timed, so the table shows that the eviction took: a cold ``cat`` is several times slower.

The checkpoint is ``bench_verify.py``'s (one training step of a CP-folded model on 2 ranks, written
by gtp_runtime with its chunk records, reused from ``--workdir``). Rounds interleave ``cat`` (every
file to /dev/null), the CLI (``python -m ckpt_tool.cli verify PATH --data --format json``, Python
start-up included) and the library alone (``open_checkpoint`` + ``verify(data=True)`` in a fresh
subprocess, timed after its imports), each after its own eviction, in a rotating order; the median
of ``--repeats`` rounds is the figure (the minimum is shown too). The ratio is cat's time over
verify's: at least 1.0x means verify reads at least as fast as ``cat``.

    python benchmarks/bench_verify_cold.py --layers 8 --repeats 5 --write-docs
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

from bench_verify import REPO, generate, run_measured
from tabulate import tabulate

TITLE = "ckpt verify --data cold, files evicted one by one (issue 26)"


def evict(files: list[str]) -> None:
    """Drop every page of each file from the page cache (clean pages only, hence the fsync first)."""
    for name in files:
        fd = os.open(name, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _cli(folder: Path) -> float:
    wall, _, out = run_measured([sys.executable, "-m", "ckpt_tool.cli", "verify", str(folder), "--data",
                                 "--format", "json"])
    doc = json.loads(out)
    if not doc["ok"] or "data" not in doc["checks"] or "chunk_records" not in doc["checks"]:
        raise SystemExit(f"verify --data did not pass with its chunk records on {folder}: {out[-2000:]}")
    return wall


def _lib(folder: Path) -> float:
    _, _, out = run_measured([sys.executable, str(REPO / "benchmarks" / "bench_verify.py"), "--child", str(folder)])
    return float(json.loads(out.strip().splitlines()[-1])["seconds"])


def measure(folder: Path, repeats: int) -> dict[str, list[float]]:
    files = sorted(str(p) for p in folder.iterdir() if p.is_file())
    runs = {"cat": lambda: run_measured(["cat", *files], discard=True)[0], "verify CLI": lambda: _cli(folder),
            "verify lib": lambda: _lib(folder)}
    times: dict[str, list[float]] = {k: [] for k in runs}
    order = list(runs)
    for r in range(repeats):
        for name in order[r % len(order):] + order[:r % len(order)]:
            evict(files)
            times[name].append(runs[name]())
    subprocess.run(["cat", *files], stdout=subprocess.DEVNULL, check=True)
    times["cat warm"] = [run_measured(["cat", *files], discard=True)[0] for _ in range(repeats)]
    return times


def _times(ratio: float) -> str:
    """``1.00x``, ``0.73x``; below 0.1 three significant figures (a loaded run printed ``0.00x``)."""
    return f"{ratio:.2f}x" if ratio >= 0.1 else f"{ratio:.3g}x"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--ffn-hidden", type=int, default=4096)
    ap.add_argument("--num-heads", type=int, default=8)
    ap.add_argument("--workdir", default="/tmp/bench_verify", help="the generated checkpoint goes here (reused)")
    ap.add_argument("--repeats", type=int, default=5, help="rounds; the median is the figure")
    ap.add_argument("--write-docs", action="store_true", help="update docs/performance.md")
    ap.add_argument("--smoke", action="store_true", help="tiny run (tests/benchmarks): one layer, two rounds")
    args = ap.parse_args(argv)
    if args.smoke:
        args.layers, args.hidden, args.ffn_hidden, args.num_heads, args.repeats = 1, 64, 128, 2, 2
        args.workdir = args.workdir + "_smoke"
    gen = argparse.Namespace(launcher="spawn", generate_timeout=900, hidden=args.hidden, ffn_hidden=args.ffn_hidden,
                             num_heads=args.num_heads)
    folder = generate(gen, args.layers, Path(args.workdir) / f"layers_{args.layers}_h{args.hidden}")
    gb = sum(p.stat().st_size for p in folder.iterdir() if p.is_file()) / 1e9
    times = measure(folder, args.repeats)
    cat = statistics.median(times["cat"])
    rows = [[name, f"{statistics.median(t):.3g}", f"{min(t):.3g}", f"{gb / statistics.median(t):.3g}",
             _times(cat / statistics.median(t))] for name, t in times.items()]
    table = tabulate(rows, headers=["what", "median s", "min s", "GB/s (median)", "vs cat cold"], tablefmt="github")
    print(f"{gb:.2f} GB in {folder}\n{table}")
    if args.write_docs:
        from docs_section import write_report

        command = shlex.join(["python", "benchmarks/bench_verify_cold.py", *(sys.argv[1:] if argv is None else argv)])
        intro = (f"One checkpoint of {gb:.2f} GB ({args.layers} layers, hidden {args.hidden}, written by gtp_runtime "
                 "with chunk records), each file evicted from the page cache with `posix_fadvise(DONTNEED)` before "
                 f"every measurement (no root; `vmtouch` is not installed here); {args.repeats} interleaved rounds, "
                 f"median. Machine: {os.cpu_count()} CPU cores (shared with other jobs), {platform.machine()}.")
        write_report(TITLE, intro, command, table, [])
        print("updated docs/performance.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
