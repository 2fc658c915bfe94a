"""What each byte costs ``verify --data``: every stage of its read path alone, then together, on 1..N threads.

    python benchmarks/verify_data_stages.py FILE [--mib 512] [--threads 1,2] [--out stages.json]
    python benchmarks/verify_data_stages.py --smoke   # a 16 MiB file made here (seconds)

``FILE`` is read from the page cache (one untimed pass first), in ``--window`` byte windows, the
first ``--mib`` MiB of it, over and over for about ``--seconds`` per measurement. Each stage runs on
its own over those windows, then the pass as ``gtp_format.check.data`` ran it before and as it runs
now, each on ``--threads`` threads at once (each thread its own range of windows). Reported per
stage: GB/s of wall time and CPU seconds per GB (user + system of the whole process,
``resource.getrusage``), the figure that says what a byte costs whatever else the machine runs.

Stages: ``os.pread`` into a new ``bytes`` per window (what the pass did), ``os.preadv`` into one
reused buffer (what it does now), zlib's CRC-32 (a zip record's own checksum: the only one a
checkpoint written by ``dcp.save`` carries), CRC-32C (google-crc32c, the manifest's file checksum),
xxh3-128 (the chunk records), and the NaN/Inf scan of float32 elements (``isfinite(x).all()``, with a
new result array per window and with one reused); then the pass as it runs now: the CRC-32 through
zlib-ng (``gtp_format.hashing.crc32``), and each window read, CRC'd and scanned in
pieces of one reused buffer (2 MiB = the whole window, 1 MiB, 512 KiB, 256 KiB). Why a micro-benchmark
beside the stage profile (``benchmarks/cli_stages.py``): the profile charges a C call to its Python line, so it
cannot say whether a window's cost is the copy, the page faults of a fresh buffer, or the hash.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import threading
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import xxhash

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from gtp_format.dtypes import by_name  # noqa: E402
from gtp_format.hashing import CRCS, crc32, crc32_backend  # noqa: E402
from gtp_format.scan import count_nonfinite  # noqa: E402

_FLOAT32 = by_name("float32")


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def stages(fd: int, window: int) -> dict[str, Callable[[], Callable[[int], None]]]:
    """Stage name -> a factory of one thread's job (its own buffers) on the window at a file offset."""
    crc32c = CRCS["crc32c"].update
    f32 = np.dtype("<f4")

    def fresh_read() -> Callable[[int], None]:
        return lambda off: os.pread(fd, window, off) and None

    def reused_read() -> Callable[[int], None]:
        buf = bytearray(window)
        return lambda off: os.preadv(fd, [buf], off) and None

    def held(fn: Callable[[memoryview, np.ndarray], object]) -> Callable[[], Callable[[int], None]]:
        def make() -> Callable[[int], None]:
            buf = bytearray(window)
            os.preadv(fd, [buf], 0)
            view, elements = memoryview(buf), np.frombuffer(buf, f32)
            return lambda _: fn(view, elements) and None
        return make

    def scan_reused() -> Callable[[int], None]:
        buf = bytearray(window)
        os.preadv(fd, [buf], 0)
        elements, out = np.frombuffer(buf, f32), np.empty(window // 4, bool)
        return lambda _: np.isfinite(elements, out=out).all() and None

    def before() -> Callable[[int], None]:  # the pass as it ran: a new bytes per window, zlib, the scan
        def job(off: int) -> None:
            data = os.pread(fd, window, off)
            zlib.crc32(data)
            count_nonfinite(np.frombuffer(data, f32), _FLOAT32)
        return job

    def now() -> Callable[[int], None]:  # one reused buffer and scan result per thread
        buf = bytearray(window)
        view, elements, out = memoryview(buf), np.frombuffer(buf, f32), np.empty(window // 4, bool)

        def job(off: int) -> None:
            os.preadv(fd, [buf], off)
            zlib.crc32(view)
            np.isfinite(elements, out=out).all()
        return job

    def pieces(piece: int) -> Callable[[], Callable[[int], None]]:
        """The pass in pieces: each ``piece`` bytes read, CRC'd and scanned before the next is read, into one
        reused buffer of that size (what a worker does now for a large chunk's payload)."""
        def make() -> Callable[[int], None]:
            buf = bytearray(piece)
            view, elements, out = memoryview(buf), np.frombuffer(buf, f32), np.empty(piece // 4, bool)

            def job(off: int) -> None:
                crc = 0
                for lo in range(off, off + window, piece):
                    os.preadv(fd, [view], lo)
                    crc = crc32(view, crc)
                    np.isfinite(elements, out=out).all()
            return job
        return make

    return {
        "pread into a new bytes": fresh_read,
        "preadv into a reused buffer": reused_read,
        "zlib CRC-32 (zip record)": held(lambda v, _: zlib.crc32(v)),
        "CRC-32 as the pass runs it (hashing.crc32)": held(lambda v, _: crc32(v)),
        "CRC-32C (google-crc32c)": held(lambda v, _: crc32c(v, 0)),
        "xxh3-128 (chunk record)": held(lambda v, _: xxhash.xxh3_128_hexdigest(v)),
        "NaN/Inf scan, new result": held(lambda _, e: count_nonfinite(e, _FLOAT32)),
        "NaN/Inf scan, reused result": scan_reused,
        "pass before: pread + CRC-32 + scan": before,
        "pass before pieces: preadv + zlib + scan": now,
        "pass, hashing.crc32, whole window": pieces(window),
        "pass, hashing.crc32, 1 MiB pieces": pieces(1 << 20),
        "pass now: hashing.crc32, 512 KiB pieces": pieces(512 << 10),
        "pass, hashing.crc32, 256 KiB pieces": pieces(256 << 10),
    }


def measure(make: Callable[[], Callable[[int], None]], threads: int, offsets: list[int], seconds: float,
            window: int) -> dict[str, float]:
    jobs = [make() for _ in range(threads)]
    done = [0] * threads
    start = threading.Barrier(threads + 1)

    def run(k: int) -> None:
        job, mine = jobs[k], offsets[k::threads] or offsets
        start.wait()
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            for off in mine:
                job(off)
                done[k] += 1

    workers = [threading.Thread(target=run, args=(k,)) for k in range(threads)]
    for w in workers:
        w.start()
    c0 = cpu_s()
    start.wait()
    t0 = time.perf_counter()
    for w in workers:
        w.join()
    wall, cpu = time.perf_counter() - t0, cpu_s() - c0
    gb = sum(done) * window / 1e9
    return {"gbps": round(gb / wall, 2), "cpu_s_per_gb": round(cpu / gb, 4)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("file", nargs="?", help="a data file (read from the page cache)")
    ap.add_argument("--mib", type=int, default=512, help="read the first MiB of the file over and over")
    ap.add_argument("--window", type=int, default=2 << 20, help="bytes per read (verify --data's window)")
    ap.add_argument("--threads", default="1,2", help="comma list of thread counts")
    ap.add_argument("--seconds", type=float, default=1.0, help="per measurement")
    ap.add_argument("--only", help="run only the stages whose name contains one of these comma-separated words")
    ap.add_argument("--out", help="write the results here as JSON")
    ap.add_argument("--smoke", action="store_true", help="a 16 MiB file of float32 made here, 0.05 s per measurement")
    args = ap.parse_args(argv)
    tmp = None
    if args.smoke or not args.file:
        tmp = tempfile.NamedTemporaryFile(suffix=".bin")
        tmp.write(np.random.default_rng(0).standard_normal(4 << 20, dtype=np.float32).tobytes())
        tmp.flush()
        args.file, args.mib, args.seconds, args.threads = tmp.name, 16, 0.05, "1,2"
    fd = os.open(args.file, os.O_RDONLY)
    try:
        size = min(os.fstat(fd).st_size, args.mib << 20)
        offsets = list(range(0, size - args.window + 1, args.window))
        if not offsets:
            raise SystemExit(f"{args.file}: smaller than one window ({args.window} bytes)")
        buf = bytearray(args.window)
        for off in offsets:  # warm: the page cache holds the range
            os.preadv(fd, [buf], off)
        threads = [int(t) for t in args.threads.split(",") if t]
        results: dict[str, dict[str, dict[str, float]]] = {}
        words = [w for w in (args.only or "").split(",") if w]
        for name, make in stages(fd, args.window).items():
            if words and not any(w in name for w in words):
                continue
            results[name] = {str(t): measure(make, t, offsets, args.seconds, args.window) for t in threads}
            cells = "  ".join(f"{t} thr {r['gbps']:6.2f} GB/s {r['cpu_s_per_gb']:.3f} CPU s/GB"
                              for t, r in results[name].items())
            print(f"{name:42s} {cells}")
        print(f"hashing.crc32: {crc32_backend()}")
    finally:
        os.close(fd)
        if tmp is not None:
            tmp.close()
    doc = {"file": args.file, "window": args.window, "mib": args.mib, "nproc": os.cpu_count(), "crc32": crc32_backend(),
           "load_avg_1m": round(os.getloadavg()[0], 2), "stages": results}
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
