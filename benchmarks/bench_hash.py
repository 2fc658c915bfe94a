"""Benchmark: the file checksums a manifest may name, per core and on every core, against zlib's CRC-32.

Each algorithm hashes the same random 2 MiB buffers (``ckpt verify --data``'s window size), as
immutable ``bytes`` (google-crc32c releases the GIL only for those), for about ``--seconds``
each: once on one thread, once on one thread per core. Throughput is GB/s; the ratio is
against zlib's CRC-32 measured the same way in the same run (the manifests' checksum before
CRC-32C). ``--write-docs`` replaces the section "File checksums" of docs/performance.md.

    python benchmarks/bench_hash.py --write-docs
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import shlex
import sys
import threading
import time
import zlib
from collections.abc import Callable

import google_crc32c
from tabulate import tabulate
from zlib_ng import zlib_ng

TITLE = "File checksums"
BUFFER = 2 << 20

ALGORITHMS: dict[str, Callable[[bytes], object]] = {
    "crc32 (zlib)": zlib.crc32,
    # the zip records' CRC-32 as gtp_format.hashing.crc32 computes it: the same function, other libraries
    "crc32 (zlib-ng)": zlib_ng.crc32,
    "crc32c (google-crc32c)": google_crc32c.value,
    "adler32 (zlib)": zlib.adler32,
    "sha256 (hashlib)": lambda b: hashlib.sha256(b).digest(),
}


def on_threads(threads: int, work: Callable[[int], None]) -> float:
    """Seconds for ``work(k)`` run on ``threads`` threads at once (``k`` = 0 .. threads-1), started together.

    The timing loop of this benchmark and of ``bench_chunk_hash.py``: both measure hashes that
    release the GIL, so one thread per core is what a verify or a save gets.
    """
    start = time.perf_counter()
    workers = [threading.Thread(target=work, args=(k,)) for k in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return time.perf_counter() - start


def rate(fn: Callable[[bytes], object], threads: int, seconds: float) -> float:
    """GB/s of ``fn`` over ``threads`` threads, each hashing its own buffers for ``seconds``."""
    buffers = [os.urandom(BUFFER) for _ in range(threads)]
    done = [0] * threads
    stop = time.perf_counter() + seconds

    def run(i: int) -> None:
        b, n = buffers[i], 0
        while True:  # at least once: a thread that starts after ``stop`` (a busy machine) still measures
            fn(b)
            n += 1
            if time.perf_counter() >= stop:
                break
        done[i] = n

    elapsed = on_threads(threads, run)
    return sum(done) * BUFFER / elapsed / 1e9


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=2.0, help="per measurement")
    ap.add_argument("--write-docs", action="store_true", help="update docs/performance.md")
    ap.add_argument("--section", default=TITLE, help="the docs/performance.md section to write (one per machine)")
    ap.add_argument("--smoke", action="store_true", help="tiny run (tests/benchmarks): 0.01 s per measurement")
    args = ap.parse_args(argv)
    if args.smoke:
        args.seconds = 0.01
    cores = os.cpu_count() or 1
    results = {name: (rate(fn, 1, args.seconds), rate(fn, cores, args.seconds)) for name, fn in ALGORITHMS.items()}
    base1, basen = results["crc32 (zlib)"]
    rows = [[name, f"{one:.2f}", f"{one / base1:.2f}x", f"{many:.2f}", f"{many / basen:.2f}x"]
            for name, (one, many) in results.items()]
    headers = ["algorithm", "1 thread GB/s", "vs crc32", f"{cores} threads GB/s", "vs crc32"]
    table = tabulate(rows, headers=headers, tablefmt="github")
    print(table)
    if args.write_docs:
        sys.path.insert(0, os.path.dirname(__file__))
        from docs_section import write_report

        command = shlex.join(["python", "benchmarks/bench_hash.py", *(sys.argv[1:] if argv is None else argv)])
        intro = (
            f"Random {BUFFER >> 20} MiB `bytes` buffers (the `verify --data` window), about {args.seconds:g} s per "
            f"measurement, on one thread and on {cores} threads (one per core). Machine: {cores} CPU cores, "
            f"{platform.machine()}, google-crc32c implementation `{google_crc32c.implementation}`."
        )
        notes = [
            "- The manifest's checksum is CRC-32C since this measurement (gtp_runtime/checkpoint/manifest.py): "
            "the save hashes every byte it writes and `ckpt verify --data` every byte it reads, and CRC-32C with "
            "the CPU's CRC32 instruction is the fastest of these by a wide margin. It is also the checksum cloud "
            "object stores keep (GCS; S3 on request). Older manifests name `crc32`; `ckpt` verifies both.",
            "- adler32 is listed because it is zlib's other fast checksum; it was not chosen: it is weak on short "
            "or low-entropy data and no storage system compares against it.",
        ]
        write_report(args.section, intro, command, table, notes)
        print("updated docs/performance.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
