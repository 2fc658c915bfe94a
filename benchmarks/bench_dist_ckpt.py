#!/usr/bin/env python
"""``ckpt reshard`` and ``ckpt verify --data`` on N torchrun ranks against one process, in the same run.

On a RAM-backed folder (``/dev/shm`` by default), where the disk is not the limit, so the ratio is the
CPU work the ranks share: the issue's target is >= 3x at 4 ranks on 4 cores. Each command runs as a
user runs it: ``python -m ckpt_tool.cli ...`` for one process, ``torchrun --standalone --nproc-per-node N
-m ckpt_tool.cli ...`` for the ranks (torch's import and the gloo rendezvous included: a few seconds
that a multi-GB job pays once). The source is bench_reshard.py's synthetic checkpoint (cp2 g2 dp2
fold, fp32, Adam), resharded to tp2 cp1; the ranked output is checked to hold the same files, of the
same sizes, as the one-process output.

Throughput is the source's bytes over the wall time of the whole command as a user runs it (torchrun's start,
every rank's imports and rendezvous, the work, the exit: what ``time torchrun ...`` reports), so *ratio* is
one process's wall time over the ranks'. *CPU s* is the user + system time of the command's whole process
tree (torchrun and its ranks; ``getrusage(RUSAGE_CHILDREN)`` around it): where one process already keeps its
cores busy (CPU s near cores x wall s), the ranks can only add what it leaves idle. ``--pycache DIR`` sets
``PYTHONPYCACHEPREFIX`` for every command (both sides): an image whose torch ships no bytecode compiles ~900
modules at each ``import torch`` (1.7 s on the lent host), which an installed torch does once.

  python benchmarks/bench_dist_ckpt.py --layers 4 --ranks 4 --cores 4 --out /tmp/bench_dist  # 4 ranks on 4 cores
  python benchmarks/bench_dist_ckpt.py --layers 4 --ranks 4 --out /tmp/bench_dist            # all the host's cores
  python benchmarks/bench_dist_ckpt.py --layers 4 --ranks 4 --cores 4 --one-core  # also one process on 1 core
  python benchmarks/bench_dist_ckpt.py --smoke                                  # tests/benchmarks, seconds
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
CKPT = [sys.executable, "-m", "ckpt_tool.cli"]
PYCACHE: str | None = None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", default="/dev/shm/bench_dist_ckpt", help="RAM-backed folder (removed after)")
    ap.add_argument("--layers", type=int, default=2, help="source layers (hidden 2048, ffn 8192, vocab 32000: "
                    "3.7 GB at 1 layer, +0.8 GB a layer)")
    ap.add_argument("--hidden", type=int, default=2048, help="hidden size (ffn 4x; 1024: about a quarter the "
                    "bytes, for a 2-core host)")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--workers", type=int, help="--workers of every process (default: the CLI's own)")
    ap.add_argument("--cores", type=int, help="run both sides on cores 0..N-1 only (taskset): the issue's '4 ranks on "
                    "4 cores' against one process on the same 4")
    ap.add_argument("--one-core", action="store_true", help="also time the one process on core 0 alone: the ranks' "
                    "scaling per core (4 ranks on 4 cores against one process on one), beside the issue's same-cores "
                    "ratio")
    ap.add_argument("--repeats", type=int, default=1, help="rounds per row (best kept)")
    ap.add_argument("--pycache", help="PYTHONPYCACHEPREFIX for every command (warmed by an untimed run first)")
    ap.add_argument("--keep", action="store_true", help="leave the source in --workdir (for a profile after)")
    ap.add_argument("--only", choices=("reshard", "verify_data"), help="one command only")
    ap.add_argument("--out", help="folder for bench_dist_ckpt.json")
    ap.add_argument("--smoke", action="store_true", help="tiny source, 2 ranks (tests/benchmarks)")
    return ap.parse_args(argv)


def env() -> dict[str, str]:
    e = dict(os.environ)
    e["PYTHONPATH"] = str(REPO) + os.pathsep + e.get("PYTHONPATH", "")
    e["OMP_NUM_THREADS"] = "1"
    if PYCACHE:
        e["PYTHONPYCACHEPREFIX"] = PYCACHE
        e.pop("PYTHONDONTWRITEBYTECODE", None)  # else nothing is ever written there (the lent host's image sets it)
    # PYTHONPYCACHEPREFIX (where set) reaches every command: a torch installed without its bytecode compiles
    # ~900 modules at each import (1.7 s of the ranks' start-up on the lent host)
    return e


def timed(cmd: list[str], ok: tuple[int, ...] = (0,)) -> tuple[float, str, float]:
    """Wall seconds, stdout, and the CPU seconds (user + system) of the command's process tree."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    r = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=3600)
    dt = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if r.returncode not in ok:
        raise SystemExit(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return dt, r.stdout, cpu


def files_of(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_size for p in sorted(folder.rglob("*")) if p.is_file()}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    global PYCACHE
    PYCACHE = args.pycache
    from types import SimpleNamespace

    from bench_reshard import make_source

    ranks = 2 if args.smoke else args.ranks
    shape = (SimpleNamespace(hidden=64, ffn=256, vocab=512), 2) if args.smoke else \
        (SimpleNamespace(hidden=args.hidden, ffn=4 * args.hidden, vocab=32000), args.layers)
    work = Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        t0 = time.perf_counter()
        nbytes = make_source(work / "src", shape[1], shape[0])
        print(f"made a {nbytes / 1e9:.2f} GB source in {time.perf_counter() - t0:.1f} s", flush=True)
        wk = ["--workers", str(args.workers)] if args.workers else []
        pin = ["taskset", "-c", f"0-{args.cores - 1}"] if args.cores else []
        CKPT[:0] = pin
        ranked = [*pin, TORCHRUN, "--standalone", "--nproc-per-node", str(ranks), "-m", "ckpt_tool.cli"]
        target = ["--tp", "2", "--cp", "1", "--no-fold-cp", "--format", "json", *wk]
        cmds = {
            "reshard": ([*CKPT, "reshard", str(work / "src"), str(work / "one"), *target],
                        [*ranked, "reshard", str(work / "src"), str(work / "many"), *target]),
            "verify_data": ([*CKPT, "verify", "--data", str(work / "src"), "--format", "json", *wk],
                            [*ranked, "verify", "--data", str(work / "src"), "--format", "json", *wk]),
        }
        # what the ranks pay before any byte moves (torchrun, N x ``import torch``, the gloo rendezvous): the same
        # ranked command on a checkpoint of under 1 MB
        tiny = str(REPO / "fixtures" / "gtp" / "fold_cp2_g2_dp2")
        # untimed: torch's files into the page cache (and, with --pycache, its bytecode into that folder)
        timed([*ranked, "verify", "--data", tiny, "--format", "json"])
        timed([*CKPT, "verify", "--data", tiny, "--format", "json"])
        starts = [timed([*ranked, "verify", "--data", tiny, "--format", "json"]) for _ in range(args.repeats)]
        startup = min(s[0] for s in starts)
        startup_one = min(timed([*CKPT, "verify", "--data", tiny, "--format", "json"])[0] for _ in range(args.repeats))
        rows = []
        for name, (single, many) in cmds.items():
            if args.only and name != args.only:
                continue
            t1, tn, c1, cn = [], [], [], []
            for _ in range(args.repeats):
                for dst in (work / "one", work / "many"):
                    shutil.rmtree(dst, ignore_errors=True)
                d, out1, cpu = timed(single)
                t1.append(d)
                c1.append(cpu)
                # the one-process output's files and sizes, then it goes: /dev/shm holds the source and one output
                one = files_of(work / "one") if name != "verify_data" else {}
                shutil.rmtree(work / "one", ignore_errors=True)
                d, outn, cpu = timed(many)
                tn.append(d)
                cn.append(cpu)
                if name == "verify_data":
                    assert json.loads(out1) == json.loads(outn), "the ranks' report differs from one process's"
                else:
                    assert one == files_of(work / "many"), "the ranks wrote other files"
            extra = {}
            if args.one_core:  # the same command on one core: what one rank's share of the cores does alone
                shutil.rmtree(work / "one", ignore_errors=True)
                d, _, cpu = timed(["taskset", "-c", "0", *single[len(pin):]])
                shutil.rmtree(work / "one", ignore_errors=True)
                extra = {"one_core_s": round(d, 3), "one_core_cpu_s": round(cpu, 2),
                         "ratio_vs_one_core": round(d / min(tn), 3)}
            rows.append({"row": f"{name}_{ranks}_ranks_vs_1", "one_process_s": round(min(t1), 3), **extra,
                         "ranks_s": round(min(tn), 3), "ratio": round(min(t1) / min(tn), 3),
                         "gb_per_s_one": round(nbytes / 1e9 / min(t1), 3),
                         "gb_per_s_ranks": round(nbytes / 1e9 / min(tn), 3), "ranks_startup_s": round(startup, 3),
                         "ratio_after_startup": round((min(t1) - startup_one) / max(1e-3, min(tn) - startup), 3),
                         "one_process_cpu_s": round(min(c1), 2), "ranks_cpu_s": round(min(cn), 2),
                         "one_process_startup_s": round(startup_one, 3), "ranks_startup_cpu_s": round(starts[0][2], 2),
                         # the command's own timer, where its report has one (reshard: after the imports and the join)
                         "one_process_own_s": json.loads(out1).get("seconds"),
                         "ranks_own_s": json.loads(outn).get("seconds"),
                         "command": " ".join(many), "baseline_command": " ".join(single)})
    finally:
        for gone in ([work / "one", work / "many"] if args.keep else [work]):
            shutil.rmtree(gone, ignore_errors=True)
    doc = {"machine": {"nproc": os.cpu_count(), "cpu": platform.processor() or platform.machine(),
                       "python": platform.python_version()},
           "workdir": args.workdir, "pycache_prefix": os.environ.get("PYTHONPYCACHEPREFIX"),
           "source_bytes": nbytes, "ranks": ranks, "workers": args.workers, "cores": args.cores,
           "hidden": args.hidden, "smoke": args.smoke,
           "rows": rows}
    print(f"{'row':<28} {'1 process s':>12} {f'{ranks} ranks s':>12} {'ratio':>7} {'startup s':>10} "
          f"{'ratio less startup':>19} {'1 proc CPU s':>13} {'ranks CPU s':>12}")
    for r in rows:
        print(f"{r['row']:<28} {r['one_process_s']:>12.2f} {r['ranks_s']:>12.2f} {r['ratio']:>7.2f} "
              f"{r['ranks_startup_s']:>10.2f} {r['ratio_after_startup']:>19.2f} {r['one_process_cpu_s']:>13.2f} "
              f"{r['ranks_cpu_s']:>12.2f}")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "bench_dist_ckpt.json").write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
