"""Benchmark: what the per-record CRC-32 of ``verify --data`` costs, against ``cat`` in the same run.

    python benchmarks/bench_record_crc.py /tmp/bench_verify/L2/iter_0000001 [--repeats 3] [--workdir DIR]
    python benchmarks/bench_record_crc.py --smoke --workdir /tmp/rc   # a fixture, one round (tests/benchmarks)

Takes a checkpoint written by gtp_runtime (``benchmarks/bench_verify.py`` leaves them in its
workdir), copies it once without its manifest (as a genuine Megatron checkpoint is) into
``--workdir`` (never beside the source), and times,
warm, best of ``--repeats`` rounds: ``cat`` of the files; ``verify(data=True)`` with the manifest
(the manifest's CRC-32C of each file covers every byte: no per-record CRC); without the manifest
(every storage record's CRC-32 is checked: ``zlib.crc32`` over the window the pass holds); and
without the manifest with the per-record CRC disabled.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SMOKE_FIXTURE = "fixtures/gtp/nofold_cp2_g2_dp2/iter_0000002"
sys.path.insert(0, str(REPO))

from gtp_format.check import data_steps  # noqa: E402
from gtp_format.check.verify import verify  # noqa: E402
from gtp_format.reader import chunks  # noqa: E402
from gtp_format.reader.checkpoint import open_checkpoint  # noqa: E402


def _cat(p: Path) -> float:
    t = time.perf_counter()
    subprocess.run(f"cat {p}/* > /dev/null", shell=True, check=True)
    return time.perf_counter() - t


def _lib(p: Path) -> float:
    t = time.perf_counter()
    result = verify(open_checkpoint(p), data=True)
    assert result.ok, result.problems[:3]
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint", type=Path, nargs="?")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/bench_record_crc"), help="the copy without manifest")
    ap.add_argument("--smoke", action="store_true", help=f"tiny run (tests/benchmarks): {SMOKE_FIXTURE}, 1 round")
    args = ap.parse_args()
    if args.smoke:
        args.checkpoint, args.repeats = REPO / SMOKE_FIXTURE, 1
    if args.checkpoint is None:
        ap.error("CHECKPOINT is required (or --smoke)")
    src = args.checkpoint
    bare = args.workdir / f"{src.name}-no-manifest"
    if not bare.exists():
        shutil.copytree(src, bare)
        (bare / "gtp_manifest.json").unlink()
    total = sum(f.stat().st_size for f in src.iterdir() if f.is_file())
    real_check, real_action = chunks.check_payload_crc, data_steps.PayloadCrc.add

    def crc_off() -> float:
        chunks.check_payload_crc = lambda *a: None
        data_steps.PayloadCrc.add = lambda *a: None
        try:
            return _lib(bare)
        finally:
            chunks.check_payload_crc, data_steps.PayloadCrc.add = real_check, real_action

    rows: dict[str, list[float]] = {"cat": [], "manifest (file CRC-32C)": [], "no manifest (record CRC-32)": [],
                                    "no manifest, record CRC off": []}
    _cat(src), _cat(bare)
    for _ in range(args.repeats):
        rows["cat"].append(_cat(src))
        rows["manifest (file CRC-32C)"].append(_lib(src))
        rows["no manifest (record CRC-32)"].append(_lib(bare))
        rows["no manifest, record CRC off"].append(crc_off())
    cat = min(rows["cat"])
    print(f"{total / 1e9:.2f} GB, warm, best of {args.repeats}, {os.cpu_count()} cores")
    print("| pass | s | GB/s | vs cat |\n|---|---|---|---|")
    for name, times in rows.items():
        best = min(times)
        print(f"| {name} | {best:.2f} | {total / best / 1e9:.2f} | {cat / best:.2f}x |")
    if args.smoke:
        shutil.rmtree(bare)


if __name__ == "__main__":
    main()
