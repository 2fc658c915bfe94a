"""Benchmark: ``ckpt export --to hf`` against ``cp -r`` of the same checkpoint, from a cold page cache.

It builds (or reuses, ``--keep``) ``bench_reshard.py``'s synthetic ``dp_reshardable`` checkpoint
(hidden 1024, ffn 4096, vocab 32000, fp32, tp1-cp2-g2-dp2 folded; 16 layers are 4.67 GB) under
``--workdir``, then runs interleaved rounds, each command a fresh subprocess:

* ``cp -r SRC COPY`` (the baseline: every byte read and written, nothing decoded or made durable);
* ``ckpt export SRC DST --to hf`` (weights only: a quarter of the bytes written, but the read
  ledger still checks every source file's CRC-32C, so every byte is read);
* ``ckpt export SRC DST --to hf --optimizer`` (every byte read and written once);
* with ``--before TREE``: the same two exports with another checkout's code (``PYTHONPATH=TREE``),
  in the same rounds, for a before/after on the same machine state.

Before every command: ``sync`` (untimed: nobody pays for the previous command's writeback) and
``posix_fadvise(POSIX_FADV_DONTNEED)`` on every file of SRC, so each command reads SRC from the
disk (or whatever cache the host keeps below this machine), not from this machine's page cache.
Ratios are ``cp -r`` time over the command's time (throughput of the checkpoint's bytes), per
round and over the medians; the spread (min-max) is printed, because the machine is shared.
``--write-docs`` replaces the section "ckpt export --to hf at 4 GB and more" of docs/performance.md.

    python benchmarks/bench_export_hf.py --layers 16 --repeats 5 --write-docs
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench_reshard import make_source
from docs_section import write_section
from tabulate import tabulate

REPO = Path(__file__).resolve().parents[1]
SECTION = "ckpt export --to hf at 4 GB and more"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=16, help="16: 4.67 GB")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--ffn", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--repeats", type=int, default=5, help="interleaved rounds; figures are medians")
    ap.add_argument("--workdir", default="/tmp/bench_export_hf")
    ap.add_argument("--keep", action="store_true", help="reuse WORKDIR/src if there, and leave it (else removed)")
    ap.add_argument("--before", type=Path, help="another checkout: its exports run in the same rounds")
    ap.add_argument("--write-docs", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="tiny run (tests/benchmarks): hidden 64, 1 layer, 1 round")
    args = ap.parse_args(argv)
    if args.smoke:
        args.layers, args.hidden, args.ffn, args.vocab, args.repeats = 1, 64, 256, 512, 1
    return args


def evict(root: Path) -> None:
    """Drop SRC's pages from this machine's page cache (clean pages only: run after a sync)."""
    for p in root.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def timed(cmd: list[str], src: Path, out: Path, env: dict[str, str] | None = None) -> float:
    os.sync()
    evict(src)
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    dt = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed: {r.stderr[-2000:]}")
    shutil.rmtree(out) if out.is_dir() else out.unlink()
    return dt


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    work = Path(args.workdir)
    src = work / "src"
    load0 = os.getloadavg()[0]
    if not (args.keep and src.is_dir()):
        shutil.rmtree(work, ignore_errors=True)
        make_source(src, args.layers, args)
    gb = sum(p.stat().st_size for p in src.rglob("*") if p.is_file()) / 1e9
    py = [sys.executable, "-m", "ckpt_tool.cli", "export", str(src)]
    trees = {"": str(REPO)} | ({" (before)": str(args.before.resolve())} if args.before else {})
    cmds: dict[str, tuple[list[str], dict[str, str] | None]] = {"cp -r": (["cp", "-r", str(src)], None)}
    for tag, tree in trees.items():
        env = {**os.environ, "PYTHONPATH": tree}
        cmds[f"export hf{tag}"] = ([*py, "--to", "hf"], env)
        cmds[f"export hf --optimizer{tag}"] = ([*py, "--to", "hf", "--optimizer"], env)
    times: dict[str, list[float]] = {k: [] for k in cmds}
    try:
        for _ in range(args.repeats):
            for name, (cmd, env) in cmds.items():
                out = work / "out"
                times[name].append(timed([*cmd, str(out)], src, out, env))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    load1 = os.getloadavg()[0]
    cp = times["cp -r"]
    rows = []
    for name, ts in times.items():
        ratios = [c / t for c, t in zip(cp, ts)]
        rows.append({"command": name, "median s": round(statistics.median(ts), 2),
                     "min-max s": f"{min(ts):.2f}-{max(ts):.2f}", "GB/s": round(gb / statistics.median(ts), 2),
                     "vs cp -r (medians)": f"{statistics.median(cp) / statistics.median(ts):.3g}x",  # 3 figures: a
                     # smoke run's tiny cp -r under load printed a true 0.004x as 0.00x
                     "vs cp -r per round, min-median-max": f"{min(ratios):.3g}-{statistics.median(ratios):.3g}-"
                                                            f"{max(ratios):.3g}x"})
    table = tabulate(rows, headers="keys", tablefmt="github")
    print(f"checkpoint {gb:.2f} GB, {args.repeats} rounds, load {load0:.1f} -> {load1:.1f}")
    print(table)
    print(json.dumps({"gb": gb, "times": times}))
    if args.write_docs:
        lines = [
            f"`bench_reshard.py`'s synthetic `dp_reshardable` checkpoint ({args.layers} layers, hidden {args.hidden}, "
            f"ffn {args.ffn}, vocab {args.vocab}, fp32, tp1-cp2-g2-dp2 folded): {gb:.2f} GB in 4 data files. "
            f"{args.repeats} interleaved rounds of `cp -r SRC COPY`, `ckpt export SRC DST --to hf` (weights only) and "
            "`--to hf --optimizer`, each a fresh subprocess (start-up included); before every command an untimed "
            "`sync` and `posix_fadvise(DONTNEED)` on every file of SRC (this machine's page cache evicted: each "
            "command reads SRC from the virtual disk, below which the host may cache). Ratio: `cp -r` time over "
            "the command's (throughput of the checkpoint's bytes); `cp -r` leaves its copy in dirty pages, the "
            "export fsyncs every file. Medians, spread min-max. Machine: 2 CPU cores shared with five other "
            f"jobs (1-minute load average {load0:.1f} at the start, {load1:.1f} at the end), x86_64, Python "
            f"{platform.python_version()}.",
            "",
            "```",
            f"python benchmarks/bench_export_hf.py --layers {args.layers} --repeats {args.repeats}"
            f"{' --before TREE' if args.before else ''} --write-docs",
            "```",
            "",
            table,
        ]
        write_section(SECTION, "\n".join(lines))


if __name__ == "__main__":
    main()
