"""Benchmark: ``ckpt verify --data`` throughput and peak memory against ``cat`` of the same files.

For each model size it writes a real checkpoint with gtp_runtime (``python -m gtp_runtime.train
--nproc-per-node 2 --cp 2 --fold-cp ... --steps 1 --save``, dp_reshardable torch_dist, with the
manifest's CRC-32Cs) under ``--workdir`` (/tmp by default, never the repository; an existing one
is reused), then in the same run, cold (page cache dropped with ``echo 3 >
/proc/sys/vm/drop_caches`` before each measurement, when permitted) and warm (after one untimed
read):

* ``cat``: ``cat`` of every file of the checkpoint folder to /dev/null;
* ``verify CLI``: ``python -m ckpt_tool.cli verify PATH --data --format json`` as a user runs it
  (Python start-up included; verify does not import torch), with its ``ru_maxrss`` (``os.wait4``);
* ``verify lib``: the same ``open_checkpoint`` + ``verify(data=True)`` in a fresh subprocess,
  timed after the imports.

Each is measured ``--repeats`` times (rounds of all three, so a shared disk's drift weighs on all
alike) and the best time is kept. Throughput is checkpoint bytes / seconds; the ratio is against
``cat`` in the same cache state. ``--write-docs`` replaces the section "ckpt verify --data" of docs/performance.md.

    python benchmarks/bench_verify.py --write-docs
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

from tabulate import tabulate

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # notes() reads the pass's constants from ckpt_tool
TITLE = "ckpt verify --data"
MEMORY_LIMIT_MIB = 512


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", default="2,8,32", help="comma list of layer counts, one checkpoint each")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--ffn-hidden", type=int, default=4096)
    ap.add_argument("--num-heads", type=int, default=8)
    ap.add_argument("--workdir", default="/tmp/bench_verify", help="generated checkpoints go here (reused)")
    ap.add_argument("--launcher", choices=("spawn", "torchrun"), default="spawn",
                    help="how the 2 training ranks that write the checkpoints start")
    ap.add_argument("--generate-timeout", type=float, default=900, help="seconds allowed to write one checkpoint")
    ap.add_argument("--clean", action="store_true", help="remove the generated checkpoints at the end")
    ap.add_argument("--write-docs", action="store_true", help="update docs/performance.md")
    ap.add_argument("--section", default=TITLE, help="the docs/performance.md section to write (one per machine)")
    ap.add_argument("--repeats", type=int, default=2, help="rounds per cache state; the best time is kept")
    ap.add_argument("--scaling", action="store_true",
                    help="also time the library warm on the largest checkpoint with 1, 2, 4, ... workers")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny run (tests/benchmarks): one layer, one warm round; never drops the page cache")
    ap.add_argument("--child", metavar="PATH", help=argparse.SUPPRESS)
    ap.add_argument("--child-workers", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.smoke:
        args.layers, args.hidden, args.ffn_hidden, args.num_heads, args.repeats = "1", 64, 128, 2, 1
    return args


def generate(args: argparse.Namespace, layers: int, out: Path) -> Path:
    """The committed iter_* folder of a one-step checkpoint, written unless already there."""
    iters = sorted(out.glob("iter_*")) if out.exists() else []
    if not iters:
        shutil.rmtree(out, ignore_errors=True)
        launch = ([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "gtp_runtime.train"]
                  if args.launcher == "torchrun" else
                  [sys.executable, "-m", "gtp_runtime.train", "--nproc-per-node", "2"])
        cmd = [*launch, "--device", "cpu", "--cp", "2", "--fold-cp",
               "--hidden", str(args.hidden), "--ffn-hidden", str(args.ffn_hidden), "--num-heads",
               str(args.num_heads), "--num-layers", str(layers), "--seq-length", "16", "--vocab-size", "128",
               "--steps", "1", "--save", str(out)]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
        try:
            p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=args.generate_timeout)
        except subprocess.TimeoutExpired as e:
            raise SystemExit(f"{shlex.join(cmd)} did not finish in {args.generate_timeout} s:\n"
                             f"{(e.stderr or b'')[-3000:]!r}") from None
        if p.returncode != 0:
            raise SystemExit(f"{shlex.join(cmd)} failed:\n{p.stderr[-3000:]}")
        iters = sorted(out.glob("iter_*"))
    return iters[-1]


def drop_caches() -> bool:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def run_measured(cmd: list[str], discard: bool = False) -> tuple[float, int, str]:
    """Wall seconds, ``ru_maxrss`` (KiB, from ``os.wait4``) and stdout of one subprocess."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    t = time.perf_counter()
    with open(os.devnull, "wb") as devnull:
        p = subprocess.Popen(cmd, cwd=REPO, env=env, stdin=subprocess.DEVNULL,
                             stdout=devnull if discard else subprocess.PIPE, stderr=devnull)
        out = b"" if discard else p.stdout.read()
        _, status, usage = os.wait4(p.pid, 0)
        p.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - t
    if p.returncode != 0:
        raise SystemExit(f"{shlex.join(cmd)} failed ({p.returncode})")
    return wall, usage.ru_maxrss, out.decode()


def child(path: str, workers: int | None) -> None:
    import resource

    import ckpt_tool.cli  # noqa: F401 - imported before the clock starts, as the CLI does
    from gtp_format.check.verify import verify
    from gtp_format.reader.checkpoint import open_checkpoint

    t = time.perf_counter()
    result = verify(open_checkpoint(path), data=True, workers=workers)
    seconds = time.perf_counter() - t
    assert "torch" not in sys.modules, "verify imported torch"
    print(json.dumps({"seconds": seconds, "ok": result.ok, "checks": result.checks,
                      "peak_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))


def measure(folder: Path, cold: bool, repeats: int) -> dict[str, float]:
    """cat, the CLI and the library on ``folder``, in rounds: best time and largest peak RSS over ``repeats`` rounds.

    Rounds interleave the three, so a disk that speeds up or slows down over the run (a shared
    one does) weighs on all of them alike.
    """
    files = sorted(str(p) for p in folder.iterdir() if p.is_file())

    def prepare() -> None:
        if cold:
            drop_caches()
        else:
            subprocess.run(["cat", *files], stdout=subprocess.DEVNULL, check=True)  # untimed warm-up read

    res: dict[str, float] = {"cat": math.inf, "cli": math.inf, "lib": math.inf, "cli_kib": 0, "lib_kib": 0}
    for _ in range(repeats):
        prepare()
        res["cat"] = min(res["cat"], run_measured(["cat", *files], discard=True)[0])
        prepare()
        wall, kib, out = run_measured(
            [sys.executable, "-m", "ckpt_tool.cli", "verify", str(folder), "--data", "--format", "json"])
        doc = json.loads(out)
        if not doc["ok"] or "data" not in doc["checks"]:
            raise SystemExit(f"verify --data did not pass on {folder}: {out[-2000:]}")
        res["cli"], res["cli_kib"] = min(res["cli"], wall), max(res["cli_kib"], kib)
        prepare()
        _, kib, out = run_measured([sys.executable, __file__, "--child", str(folder)])
        res["lib"] = min(res["lib"], json.loads(out.strip().splitlines()[-1])["seconds"])
        res["lib_kib"] = max(res["lib_kib"], kib)
    return res


def baseline(code: str = "import ckpt_tool.cli, gtp_format.check.verify", repeats: int = 3) -> tuple[float, float]:
    """Wall seconds and peak RSS (MiB) of a process that only imports what the CLI imports: the floor.

    Measured warm (best of 3): the part of every CLI figure that does not depend on the checkpoint.
    """
    runs = [run_measured([sys.executable, "-c", code], discard=True) for _ in range(repeats)]
    return min(r[0] for r in runs), max(r[1] for r in runs) / 1024


def run(args: argparse.Namespace) -> tuple[list[list], bool]:
    work = Path(args.workdir)
    # as an install does: without .pyc files (PYTHONDONTWRITEBYTECODE, a read-only checkout) every
    # CLI run would compile ckpt_tool's modules again, about 0.1 s that a user never pays
    subprocess.run([sys.executable, "-m", "compileall", "-q", "ckpt_tool", "gtp_runtime"], cwd=REPO, check=True)
    work.mkdir(parents=True, exist_ok=True)
    can_drop = not args.smoke and drop_caches()  # a smoke run must not empty the machine's page cache
    rows = []
    for layers in [int(x) for x in args.layers.split(",")]:
        folder = generate(args, layers, work / f"L{layers}")
        size = sum(p.stat().st_size for p in folder.iterdir() if p.is_file())
        gb = size / 1e9
        print(f"checkpoint {folder}: {gb:.2f} GB", flush=True)
        for cold in ([True, False] if can_drop else [False]):
            r = measure(folder, cold, args.repeats)
            print(f"  {'cold' if cold else 'warm'}: {r}", flush=True)
            rows.append([f"{gb:.2f}", layers, "cold" if cold else "warm",
                         f"{r['cat']:.2f}", f"{gb / r['cat']:.2f}",
                         f"{r['cli']:.2f}", f"{gb / r['cli']:.2f}", f"{r['cat'] / r['cli']:.2f}x",
                         f"{r['lib']:.2f}", f"{gb / r['lib']:.2f}", f"{r['cat'] / r['lib']:.2f}x",
                         f"{r['cli_kib'] / 1024:.0f}", f"{r['lib_kib'] / 1024:.0f}"])
    if args.clean:
        shutil.rmtree(work, ignore_errors=True)
    return rows, can_drop


SCALING_HEADERS = ["workers", "verify lib s", "verify lib GB/s", "lib vs cat", "cat GB/s"]


def scaling(args: argparse.Namespace) -> list[list]:
    """The library's warm throughput on the largest checkpoint with 1, 2, 4, ... workers (best of 2)."""
    layers = max(int(x) for x in args.layers.split(","))
    folder = generate(args, layers, Path(args.workdir) / f"L{layers}")
    files = sorted(str(p) for p in folder.iterdir() if p.is_file())
    gb = sum(p.stat().st_size for p in folder.iterdir() if p.is_file()) / 1e9
    subprocess.run(["cat", *files], stdout=subprocess.DEVNULL, check=True)
    cat = min(run_measured(["cat", *files], discard=True)[0] for _ in range(2))
    counts = sorted({n for n in (1, 2, 4, 8, 16) if n <= (os.cpu_count() or 1)} | {os.cpu_count() or 1})
    rows = []
    for n in counts:
        best = min(json.loads(run_measured([sys.executable, __file__, "--child", str(folder), "--child-workers",
                                            str(n)])[2].strip().splitlines()[-1])["seconds"] for _ in range(2))
        print(f"  workers {n}: {best:.2f} s", flush=True)
        rows.append([n, f"{best:.2f}", f"{gb / best:.2f}", f"{cat / best:.2f}x", f"{gb / cat:.2f}"])
    return rows


HEADERS = ["ckpt GB", "layers", "cache", "cat s", "cat GB/s", "verify CLI s", "verify CLI GB/s", "CLI vs cat",
           "verify lib s", "verify lib GB/s", "lib vs cat", "CLI peak RSS MiB", "lib peak RSS MiB"]


def write_docs(table: str, command: str, args: argparse.Namespace, can_drop: bool, notes: list[str]) -> None:
    import torch
    from docs_section import write_report

    cache = ("*cold*: page cache dropped (`sync; echo 3 > /proc/sys/vm/drop_caches`) before every measurement; "
             "*warm*: after one untimed `cat` of the files" if can_drop else
             "dropping the page cache is not permitted here, so both are measured warm, after one untimed read")
    intro = (
        f"Checkpoints written by gtp_runtime (2 gloo ranks, tp1-cp2-g1-dp1 folded, hidden {args.hidden}, ffn "
        f"{args.ffn_hidden}, fp32, one training step, dp_reshardable torch_dist with a CRC-32C per file in the "
        "manifest), "
        f"verified with `ckpt verify --data` against `cat` of the same files to /dev/null in the same run; {cache}. "
        + (f"Best of {args.repeats} rounds, each running cat, the CLI and the library in turn. " if args.repeats > 1
           else "One round: cat, the CLI and the library in turn. ")
        + "Throughput is checkpoint bytes over wall time. *verify CLI* is the subprocess a user runs (Python "
        "start-up included; it does not import torch); *verify lib* is `open_checkpoint` + `verify(data=True)` "
        "in a fresh subprocess, timed after the imports. Peak RSS is each subprocess's `ru_maxrss`. "
        f"Machine: {os.cpu_count()} CPU cores, {platform.machine()}, "
        f"torch {torch.__version__}."
    )
    write_report(args.section, intro, command, table, notes)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        child(args.child, args.child_workers)
        return 0
    command = shlex.join(["python", "benchmarks/bench_verify.py", *(sys.argv[1:] if argv is None else argv)])
    rows, can_drop = run(args)
    tries = 1 if args.smoke else 3
    floor = baseline(repeats=tries)
    with_torch = baseline("import torch, ckpt_tool.cli, gtp_format.check.verify", repeats=tries)
    print(f"start-up (import ckpt_tool): {floor[0]:.2f} s, peak RSS {floor[1]:.0f} MiB; with torch as well: "
          f"{with_torch[0]:.2f} s, {with_torch[1]:.0f} MiB")
    table = tabulate(rows, headers=HEADERS, tablefmt="github")
    print(table)
    if args.scaling:
        scale = tabulate(scaling(args), headers=SCALING_HEADERS, tablefmt="github")
        print(scale)
        table += "\n\nWorker threads (`verify(data=True, workers=N)`, the library, warm, largest checkpoint; cat " \
                 "measured warm just before):\n\n" + scale
    print(json.dumps({"rows": rows, "dropped_caches": can_drop}))
    peak = max(max(float(r[11]), float(r[12])) for r in rows)
    print(f"peak RSS {peak:.0f} MiB ({'within' if peak < MEMORY_LIMIT_MIB else 'OVER'} {MEMORY_LIMIT_MIB} MiB)")
    if args.write_docs:
        write_docs(table, command, args, can_drop, notes(rows, floor, with_torch))
        print("updated docs/performance.md")
    return 0


def notes(rows: list[list], floor: tuple[float, float], with_torch: tuple[float, float]) -> list[str]:
    from gtp_format.check.data import IN_FLIGHT, WINDOW, default_workers

    peak = max(max(float(r[11]), float(r[12])) for r in rows)
    small, large = rows[0], rows[-1]
    ratios = [float(r[i].rstrip("x")) for r in rows for i in (7, 10)]
    met = all(x >= 0.8 for x in ratios)
    lib_met = all(float(r[10].rstrip("x")) >= 0.8 for r in rows)
    workers = default_workers()
    return [
        f"- Target (verify --data at least 0.8x the throughput of `cat`): {'met' if met else 'missed'} "
        f"(library alone: {'met' if lib_met else 'missed'}); "
        + "; ".join(f"{r[0]} GB {r[2]}: CLI {r[7]}, lib {r[10]}" for r in rows) + ".",
        f"- How it reads (gtp_format/check/data.py): each data file once, front to back, in {WINDOW >> 20} MiB "
        f"windows handed in file order to {workers} worker threads (one per core here, at most 16). Each worker "
        "reads its window with `os.pread`, takes its CRC-32C (google-crc32c, the CPU's CRC32 instruction), "
        "decodes the chunks in it in place (gtp_format/reader/zip_blob.py parses the zip structure and "
        "gtp_format/reader/blob.py the allow-listed data.pkl, directly; numpy views the elements, no copy) and "
        "checks NaN/Inf in one pass per chunk (gtp_format/scan.py: `isfinite` for fp32/fp64, the largest "
        "exponent field for 16-bit floats); all of these release the GIL. The main thread joins the windows' "
        "CRCs in order with `Crc.combine` and adds up the results, so the report does not depend on the worker count.",
        "- What bounds it: `cat` is one `read` per 128 KiB into a buffer that stays in cache; verify does the "
        "same copy plus a CRC and a NaN/Inf scan over every byte, and about 100 us of Python per chunk and per window "
        "under the GIL. Warm, `cat` runs at memory-copy speed on one core, so verify needs the other cores to "
        "keep up; cold, both wait on the disk. The CLI figure also carries the start-up of Python, numpy and "
        f"typer: {floor[0]:.2f} s for a process that only imports ckpt_tool (warm; cold, their files are read "
        "from disk too). `inspect` and `verify` do not import torch (gtp_format/scan.py and the format's own "
        f"dtype table, gtp_format/dtypes.py): with torch the same import takes {with_torch[0]:.2f} s "
        f"and {with_torch[1]:.0f} MiB here.",
        f"- Peak memory: at most {peak:.0f} MiB over all runs ({small[0]} GB: {small[11]} MiB, {large[0]} GB: "
        f"{large[11]} MiB), {'under' if peak < MEMORY_LIMIT_MIB else 'over'} the {MEMORY_LIMIT_MIB} MiB bound. "
        f"A process that only imports ckpt_tool peaks at {floor[1]:.0f} MiB, so verify itself "
        f"adds at most {peak - floor[1]:.0f} MiB: at most {IN_FLIGHT} windows per worker in flight whatever the "
        "checkpoint or chunk size (a chunk larger than a window is scanned as it streams past) and the "
        "checkpoint's metadata.",
    ]


if __name__ == "__main__":
    sys.exit(main())
