"""CPU benchmark: what starting ranks costs, ranks forked from the launcher against a fork server.

``python -m gtp_runtime.train`` runs a tiny model (hidden 32, 2 layers, sequence 16) for one step
on gloo ranks, with and without ``--save``, started two ways in the same run:

* **fork** (the default where the launcher has one thread, ``gtp_runtime.launch.start_method``):
  the launcher imports what the ranks need and forks them;
* **fork server** (what a launcher with threads of its own gets): the same command started from an
  interpreter that runs one extra idle thread first, so the ranks come from a fork server, a fresh
  interpreter that imports torch again.

Each command's CPU time is the whole machine's (``/proc/stat``: user, nice, system, irq, softirq),
since a fork server's ranks are not the launcher's children and ``getrusage`` misses them; so run
it on an idle machine (the load average is printed). Times are medians of ``--repeats`` interleaved
rounds; the ratio is fork server over fork (above 1: fork is cheaper).

    python benchmarks/bench_launch.py                 # 4 ranks, 5 rounds
    python benchmarks/bench_launch.py --smoke         # tests/benchmarks: 2 ranks, 1 round
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tabulate import tabulate

REPO = Path(__file__).resolve().parents[1]
MODEL = ["--hidden", "32", "--num-layers", "2", "--num-heads", "4", "--ffn-hidden", "64", "--seq-length", "16",
         "--steps", "1", "--device", "cpu"]
# The launcher's own entry, called from an interpreter that started an idle thread first.
WITH_A_THREAD = ("import sys, threading; threading.Thread(target=threading.Event().wait, daemon=True).start(); "
                 "import gtp_runtime.train as t; sys.exit(t.main(sys.argv[1:]))")


def machine_cpu_s() -> float:
    """CPU seconds the whole machine has spent (user, nice, system, irq, softirq), from /proc/stat."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    return sum(int(fields[i]) for i in (0, 1, 2, 5, 6)) / os.sysconf("SC_CLK_TCK")


def timed(argv: list[str]) -> tuple[float, float]:
    """(wall s, machine CPU s) of one command, which must succeed."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    c0, t0 = machine_cpu_s(), time.perf_counter()
    p = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    wall, cpu = time.perf_counter() - t0, machine_cpu_s() - c0
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} exited {p.returncode}: {p.stderr[-2000:]}")
    return wall, cpu


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="tiny run (tests/benchmarks): 2 ranks, 1 round")
    args = ap.parse_args(argv)
    if args.smoke:
        args.ranks, args.repeats = 2, 1
    layout = ["--nproc-per-node", str(args.ranks), "--cp", "2", "--fold-cp"]
    scratch = Path(tempfile.mkdtemp(prefix="bench_launch_"))
    runs = {"fork": [sys.executable, "-m", "gtp_runtime.train"], "fork server": [sys.executable, "-c", WITH_A_THREAD]}
    results: dict[tuple[str, str], list[tuple[float, float]]] = {}
    load = os.getloadavg()[0]
    try:
        for _ in range(args.repeats):
            for save in (False, True):
                for how, cmd in runs.items():
                    out = scratch / "run"
                    shutil.rmtree(out, ignore_errors=True)
                    extra = ["--save", str(out)] if save else []
                    results.setdefault((how, "save" if save else "no save"), []).append(
                        timed([*cmd, *layout, *MODEL, *extra]))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    rows = []
    for what in ("no save", "save"):
        fork = [statistics.median(x) for x in zip(*results[("fork", what)], strict=True)]
        server = [statistics.median(x) for x in zip(*results[("fork server", what)], strict=True)]
        rows.append([what, f"{fork[0]:.2f}", f"{fork[1]:.2f}", f"{server[0]:.2f}", f"{server[1]:.2f}",
                     f"{server[1] / fork[1]:.2f}x"])
    print(f"{args.ranks} gloo ranks, one step, medians of {args.repeats} rounds; {os.cpu_count()} CPUs, "
          f"load average {load:.2f} at the start, {os.getloadavg()[0]:.2f} at the end")
    print(tabulate(rows, headers=["run", "fork wall s", "fork CPU s", "fork server wall s", "fork server CPU s",
                                  "CPU: fork server / fork"], tablefmt="github"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
