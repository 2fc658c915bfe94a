"""Benchmark: what the chunk records cost inside the writer's :class:`gtp_format.writer.sink.Sink`.

Why: every save hands its bytes to a ``Sink``, which computes the file's CRC-32C and, with
``segments`` (the chunk records), each chunk's xxh3-128 on the same thread that copies the
bytes into its staging buffer. A save whose disk is fast, or whose writer threads share cores, pays
that CPU in wall time. This times one thread writing ``--mib`` of random bytes, handed in as parts of
``--part-mib`` (a checkpoint's tensors), through a buffered ``Sink`` into ``--dir`` (default
``/dev/shm``, so the disk is not what is timed; ``--direct``: through the staging buffers, as a save
writes) with and without ``segments``, interleaved, best of
``--rounds``; and, in the same rounds, the passes it makes over a part when each pass walks the whole
part (``whole parts``: CRC-32C, xxh3-128 and the copy each read every byte from memory) against the
sink's pieces (each piece's passes read it from the cache).

    python benchmarks/bench_sink.py --mib 1024 --rounds 5
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gtp_format.hashing import CRCS  # noqa: E402
from gtp_format.integrity.hash import chunk_hasher  # noqa: E402
from gtp_format.manifest import HASH_ALGORITHM  # noqa: E402
from gtp_format.writer.sink import Sink  # noqa: E402


def _sink(parts: list[np.ndarray], folder: Path, segments: bool, direct: bool) -> None:
    path = folder / "f.bin"
    with Sink(path, 16 << 20, direct=direct, segments=segments) as s:
        for p in parts:
            s.write([p])
            s.cut()
        s.close()
    path.unlink()


def _passes(parts: list[np.ndarray], piece: int | None) -> None:
    """CRC-32C, xxh3-128 and a copy of every part: over the whole part each (``piece=None``) or
    piece by piece."""
    crc, value, out = CRCS[HASH_ALGORITHM], 0, np.empty(max(p.size for p in parts), np.uint8)
    for p in parts:
        h = chunk_hasher()
        step = piece or p.size
        for at in range(0, p.size, step):
            v = memoryview(p[at:at + step])
            value = crc.update(v, value)
            h.update(v)
            out[at:at + step] = p[at:at + step]
        h.hexdigest()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--part-mib", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--direct", action="store_true", help="O_DIRECT through the staging buffers (a save's path)")
    ap.add_argument("--dir", default="/dev/shm" if Path("/dev/shm").is_dir() else None)
    ap.add_argument("--smoke", action="store_true", help="tiny run (tests/benchmarks)")
    args = ap.parse_args()
    if args.smoke:
        args.mib, args.part_mib, args.rounds, args.dir = 4, 1, 1, None
    rng = np.random.default_rng(0)
    parts = [rng.integers(0, 256, args.part_mib << 20, dtype=np.uint8) for _ in range(args.mib // args.part_mib)]
    nbytes = sum(p.nbytes for p in parts)
    from gtp_format.writer import sink as sink_mod

    piece = getattr(sink_mod, "PIECE", 256 << 10)
    cases: dict[str, Callable[[Path], None]] = {
        "sink, no chunk records": lambda d: _sink(parts, d, False, args.direct),
        "sink, chunk records": lambda d: _sink(parts, d, True, args.direct),
        "passes over whole parts": lambda d: _passes(parts, None),
        f"passes over {piece >> 10} KiB pieces": lambda d: _passes(parts, piece),
    }
    best = {k: float("inf") for k in cases}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for r in range(args.rounds):
            for name in (list(cases) if r % 2 == 0 else list(cases)[::-1]):
                t = time.perf_counter()
                cases[name](Path(tmp))
                best[name] = min(best[name], time.perf_counter() - t)
    base = best["sink, no chunk records"]
    rows = [[k, round(v, 3), round(nbytes / v / 1e9, 2), f"{100 * (v / base - 1):+.1f}%"] for k, v in best.items()]
    print(f"{nbytes / 1e9:.2f} GB in parts of {args.part_mib} MiB, best of {args.rounds}, one thread; "
          f"{platform.machine()}, {os.cpu_count()} cores, folder {args.dir}, direct {args.direct}")
    print(tabulate(rows, headers=["what", "s", "GB/s", "vs sink without records"], tablefmt="github"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
