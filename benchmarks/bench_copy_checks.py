"""Benchmark: what the copies' read checks cost: the read ledger on and off, against ``cp -r``.

``reshard`` and ``export`` hash every range they read into a read ledger
(:mod:`gtp_format.check.integrity`) and, before committing, join it and read what no copy read
(zip headers, replicas; for a weights-only export, the optimizer state). This measures the copy
with the ledger and with the same reader without it (:class:`gtp_format.reader.boxes.BoxReader`,
nothing recorded, nothing checked), interleaved in one process so both see the same machine, and
``cp -r`` of the same folder in the same rounds as the baseline. The source is
``bench_reshard.py``'s synthetic ``dp_reshardable`` checkpoint (its writer, its layout, warm cache).

    python benchmarks/bench_copy_checks.py --layers 6 --hidden 512 --ffn 2048 --vocab 8192 --repeats 5 --write-docs
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
from collections.abc import Callable
from pathlib import Path

from bench_reshard import make_source
from docs_section import write_section

from ckpt_tool.copying import source
from ckpt_tool.export import engine as export
from ckpt_tool.reshard import engine
from gtp_format.reader.boxes import BoxReader

SECTION = "Copies: what the read checks cost (issue 22)"


class _NoLedger:
    bytes_checked = bytes_filled = 0
    modes: dict[str, object] = {}  # checks no file: a copied chunk's zip CRC-32 is hashed, never taken

    def record(self, *a: object) -> None:
        pass

    def finish(self) -> None:
        pass

    def fill_except(self, keys: object, also: object = None) -> None:
        pass

    def cancel(self) -> None:
        pass


class PlainReader(BoxReader):
    """The reader the copies used before the ledger: same reads, nothing hashed or joined."""

    def __init__(self, ckpt: object) -> None:
        super().__init__(ckpt)  # type: ignore[arg-type]
        self.ledger = _NoLedger()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--ffn", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--workdir", default="/tmp/bench_copy_checks")
    ap.add_argument("--write-docs", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="tiny run (tests/benchmarks): hidden 64, 1 layer, 1 round")
    args = ap.parse_args(argv)
    if args.smoke:
        args.layers, args.hidden, args.ffn, args.vocab, args.repeats = 1, 64, 128, 256, 1
    return args


def _timed(fn: Callable[[], object]) -> float:
    os.sync()  # untimed: nobody pays for the previous command's writeback
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    load0 = os.getloadavg()[0]
    work = Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    src = work / "src"
    nbytes = make_source(src, args.layers, args)
    folder = next(src.glob("iter_*"))
    data = sum(p.stat().st_size for p in folder.iterdir())
    par = engine.target_topology(src, None, tp=2, cp=1, fold_cp=False)
    out = work / "out"
    commands: dict[str, Callable[[], object]] = {
        "reshard tp2-cp1": lambda: engine.reshard(src, out, par),
        "export hf --optimizer": lambda: export.export(src, out, "hf", optimizer=True),
        "export hf (weights only)": lambda: export.export(src, out, "hf"),
    }
    times: dict[str, list[float]] = {"cp -r": []}
    for _ in range(args.repeats):
        times["cp -r"].append(_timed(lambda: subprocess.run(["cp", "-r", str(src), str(out)], check=True)))
        shutil.rmtree(out)
        for name, run in commands.items():
            for mode, reader in (("ledger", source.CheckedReader), ("no ledger", PlainReader)):
                source.CheckedReader = reader  # type: ignore[misc]  # what open_source builds
                try:
                    times.setdefault(f"{name}|{mode}", []).append(_timed(run))
                finally:
                    source.CheckedReader = CHECKED  # type: ignore[misc]
                shutil.rmtree(out) if out.is_dir() else out.unlink()
    med = {k: statistics.median(v) for k, v in times.items()}
    cp = med["cp -r"]
    rows = []
    for name in commands:
        on, off = med[f"{name}|ledger"], med[f"{name}|no ledger"]
        rows.append({"command": name, "ledger s": round(on, 2), "no ledger s": round(off, 2),
                     "ledger / no ledger": f"{on / off:.3f}", "vs cp -r, ledger": f"{cp / on:.2f}x",
                     "vs cp -r, no ledger": f"{cp / off:.2f}x"})
    summary = {"ckpt_bytes": data, "source_bytes_written": nbytes, "cp_r_s": round(cp, 3), "rows": rows,
               "repeats": args.repeats, "load_start": load0, "load_end": os.getloadavg()[0]}
    print(json.dumps(summary))
    body = report(summary, args)
    print(body)
    shutil.rmtree(work, ignore_errors=True)
    if args.write_docs and not args.smoke:
        write_section(SECTION, body)


CHECKED = source.CheckedReader


def report(s: dict, args: argparse.Namespace) -> str:
    from tabulate import tabulate

    cmd = (f"python benchmarks/bench_copy_checks.py --layers {args.layers} --hidden {args.hidden} --ffn {args.ffn} "
           f"--vocab {args.vocab} --repeats {args.repeats} --write-docs")
    return "\n".join([
        f"A {s['ckpt_bytes'] / 1e9:.2f} GB synthetic `dp_reshardable` checkpoint (bench_reshard.py's, "
        f"{args.layers} layers, hidden {args.hidden}); each copy run in-process with the read ledger and with "
        f"the same reader without it, interleaved, and `cp -r` of the same folder in the same rounds "
        f"({s['cp_r_s']} s); medians of {args.repeats} rounds; warm cache, an untimed `sync` before each run. "
        f"Machine: {os.cpu_count()} CPU cores shared with other jobs (1-minute load {s['load_start']:.1f} at the "
        f"start, {s['load_end']:.1f} at the end), {platform.machine()}, Python {platform.python_version()}.",
        "", "```", cmd, "```", "",
        tabulate(s["rows"], headers="keys", tablefmt="github"), "",
        "- The ledger hashes (CRC-32C, or CRC-32 without manifest checksums) the bytes a copy already holds, "
        "then reads once what it did not read; a weights-only export reads the optimizer state that way, "
        "which is its largest extra cost.",
    ]) + "\n"


if __name__ == "__main__":
    sys.exit(main())
