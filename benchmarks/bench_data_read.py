"""Reading a large indexed dataset: memory against the batches in flight, time against ``cat``.

    python benchmarks/bench_data_read.py --gb 10 --write-docs
    python benchmarks/bench_data_read.py --smoke --dir /tmp/bench-data   # 20 MB, 500 samples of 256 tokens

Writes a ``--gb`` GB uint16 indexed dataset (documents of random lengths, ~2,000 tokens on
average) under ``--dir``, then, each in a fresh subprocess and in turn:

- ``cat`` of the ``.bin`` to /dev/null (the time to read the same bytes);
- *sequential*: every sample of the dataset in file order (``--seq-length 2048``, batches of
  ``--batch`` samples turned into int64 token/label tensors as a trainer gets them), i.e. every
  byte of the ``.bin`` once;
- *shuffled*: the same number of samples in the shuffled order a training run reads
  (Megatron-like: shuffled documents, shuffled samples).

Memory: the process's anonymous memory (``RssAnon``: what it allocated: indices, batches) and
its mapped file pages (``RssFile``: page-cache pages of the memory-mapped ``.bin`` that it has
touched, shared and dropped by the kernel under pressure, never copied), sampled every 64
batches; the growth over the opened-dataset baseline is what reading costs. The page cache is
warm for all three (one untimed ``cat`` first): dropping it needs root on a machine we share.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def make_dataset(prefix: Path, gb: float) -> None:
    """Random tokens in 32 MiB blocks and exponential document lengths (mean ~2,000 tokens)."""
    from gtp_runtime.data.writer import write_index

    rng = np.random.RandomState(0)
    block = rng.randint(0, 50_000, size=1 << 24).astype(np.uint16)
    total = int(gb * 1e9) // 2
    lengths = (rng.exponential(2000, size=total // 1000 + 16) + 1).astype(np.int64)
    lengths = lengths[: int(np.searchsorted(np.cumsum(lengths), total)) + 1]
    lengths[-1] -= int(lengths.sum()) - total
    prefix.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{prefix}.bin", "wb") as f:
        for done in range(0, total, len(block)):
            f.write(block[: min(len(block), total - done)].tobytes())
    write_index(prefix, lengths, np.uint16)


def status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("RssAnon", "RssFile", "VmRSS")):
                k, v = line.split(":")
                out[k] = int(v.split()[0])  # KiB
    return out


def child(prefix: str, mode: str, seq: int, batch: int, max_samples: int | None) -> None:
    import torch

    from gtp_runtime.data.indexed import read_index
    from gtp_runtime.data.sampler import GPTSamples

    t0 = time.perf_counter()
    ds = read_index(prefix)
    samples = GPTSamples(ds, 0, ds.num_documents, seq, seed=1, shuffle=(mode == "shuffled"))
    samples._epoch_index(0)
    t_open = time.perf_counter() - t0
    base = status()
    peak = dict(base)
    n = min(samples.samples_per_epoch, max_samples or samples.samples_per_epoch)
    t1 = time.perf_counter()
    checksum = 0
    for i, first in enumerate(range(0, n, batch)):
        x = torch.from_numpy(samples.batch(first, min(batch, n - first)))
        tokens, labels = x[:, :-1].contiguous(), x[:, 1:].contiguous()
        checksum += int(tokens[0, 0]) + int(labels[-1, -1])
        if i % 64 == 0:
            now = status()
            peak = {k: max(peak[k], now[k]) for k in peak}
    seconds = time.perf_counter() - t1
    batch_bytes = batch * (seq + 1) * 8 + 2 * batch * seq * 8  # the int64 samples and the two tensors
    print(json.dumps({"mode": mode, "open_s": t_open, "seconds": seconds, "samples": n, "tokens": n * seq,
                      "bytes_read": n * seq * ds.tokens.dtype.itemsize, "samples_per_epoch": samples.samples_per_epoch,
                      "base_kib": base, "peak_kib": peak, "batch_bytes": batch_bytes, "checksum": checksum,
                      "ru_maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))


def report(result: dict, write_docs: bool) -> None:
    """Print the table (and write the docs section) from a run's JSON."""
    from tabulate import tabulate

    size, cat_s = result["bytes"], result["cat_s"]
    rows = [("cat", f"{size / 1e9:.2f}", f"{cat_s:.3g}", f"{size / cat_s / 1e6:.0f}", "1x", "-", "-", "-", "-", "-")]
    for r in result["runs"]:
        anon = (r["peak_kib"]["RssAnon"] - r["base_kib"]["RssAnon"]) / 1024
        mapped = (r["peak_kib"]["RssFile"] - r["base_kib"]["RssFile"]) / 1024
        gb_read = r["bytes_read"] / 1e9
        rows.append((r["mode"], f"{gb_read:.2f}", f"{r['seconds']:.3g}", f"{gb_read * 1e3 / r['seconds']:.1f}",
                     f"{(r['seconds'] / gb_read) / (cat_s / (size / 1e9)):.0f}x",
                     f"{r['base_kib']['RssAnon'] / 1024:.0f}", f"{anon:.1f}",
                     f"{r['batch_bytes'] / 2**20:.1f}", f"{mapped:.0f}", f"{r['open_s']:.2f}"))
    head = ("read", "GB read", "seconds", "MB/s", "time per GB vs cat", "RssAnon base MiB", "RssAnon growth MiB",
            "one batch MiB", "RssFile growth MiB", "open+index s")
    table = tabulate(rows, head, tablefmt="github")
    print(table)
    if not write_docs:
        return
    from docs_section import write_report

    intro = (f"Reading a {size / 1e9:.1f} GB uint16 Megatron indexed dataset (random tokens in documents of "
             f"~2,000 tokens) through `gtp_runtime.data` (memory-mapped, validated index): "
             f"{result['runs'][0]['samples']} samples of seq {result['seq_length']} in file order (*sequential*) "
             f"and in the shuffled training order (*shuffled*), batches of {result['batch']} samples as int64 "
             "tensors, against `cat` of the whole dataset in the same run; page cache warm for all. Each read "
             f"is a fresh subprocess. Machine: {result['cores']} CPU cores shared with other jobs (load average "
             f"about 12 during the run), x86_64, Python {result['python']}.")
    notes = [
        "- *RssAnon growth*: anonymous memory allocated while reading, over the opened dataset; *RssAnon "
        "base* holds torch and the index arrays (sequence starts, the epoch's document order, offsets and "
        "sample shuffle: 8 bytes per document and per sample, not per token). *RssFile growth*: pages of "
        "the mapped `.bin` still mapped (page cache, never copied). Before each batch's pages were "
        "unmapped again (`TokenDataset.release`), the shuffled read of 0.41 GB left 8,653 MiB of the file "
        "mapped (the kernel maps 64 KiB around every fault); now 4 MiB.",
        "- Memory: reading costs at most a few MiB over the opened dataset (one batch is 3 MiB), whatever "
        "the file size. Time: the reader is 100-200x slower per byte than `cat` (a gather of "
        "`seq_length + 1` tokens per sample into int64 through numpy, not a memcpy), about 5 MB/s of "
        "tokens here; that is still about 2.5 M tokens/s per rank on a loaded 2-core machine, "
        "far more than a training step consumes (the 100M-parameter GPU run trained 8,192 tokens per "
        "~130 ms step).",
    ]
    cmd = (f"python benchmarks/bench_data_read.py --gb {result['gb']:g}"
           + (f" --max-samples {result['max_samples']}" if result.get("max_samples") else "") + " --write-docs")
    write_report("Reading a large indexed dataset", intro, cmd, table, notes)


def timed(cmd: list[str]) -> tuple[float, str]:
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return time.perf_counter() - t0, p.stdout


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=10.0)
    ap.add_argument("--dir", type=Path, default=REPO / "runs" / "bench_data")
    ap.add_argument("--seq-length", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--max-samples", type=int, default=None,
                    help="read this many samples per mode (default: the whole dataset)")
    ap.add_argument("--keep", action="store_true", help="keep the dataset (and reuse one of the same size)")
    ap.add_argument("--write-docs", action="store_true")
    ap.add_argument("--report", type=Path, default=None, help="only print (and --write-docs) a saved JSON")
    ap.add_argument("--smoke", action="store_true", help="20 MB, 500 samples of seq 256; never writes docs")
    ap.add_argument("--child", nargs=2, metavar=("PREFIX", "MODE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.smoke:
        args.gb, args.max_samples, args.seq_length, args.batch, args.write_docs = 0.02, 500, 256, 16, False
    if args.child:
        child(args.child[0], args.child[1], args.seq_length, args.batch, args.max_samples)
        return 0
    if args.report:
        report(json.loads(args.report.read_text()), args.write_docs)
        return 0
    prefix = args.dir / f"bench_{args.gb:g}gb"
    if not (args.keep and Path(f"{prefix}.idx").exists()):
        t0 = time.perf_counter()
        make_dataset(prefix, args.gb)
        gb = os.path.getsize(f"{prefix}.bin") / 1e9
        print(f"wrote {prefix}.bin ({gb:.2f} GB) in {time.perf_counter() - t0:.0f} s")
    size = os.path.getsize(f"{prefix}.bin") + os.path.getsize(f"{prefix}.idx")
    subprocess.run(["cat", f"{prefix}.bin", f"{prefix}.idx"], stdout=subprocess.DEVNULL, check=True)  # warm
    cat_s, _ = timed(["sh", "-c", f"cat '{prefix}.bin' '{prefix}.idx' > /dev/null"])
    runs = []
    for mode in ("sequential", "shuffled"):
        wall, out = timed([sys.executable, __file__, "--child", str(prefix), mode, "--seq-length",
                           str(args.seq_length), "--batch", str(args.batch),
                           *(["--max-samples", str(args.max_samples)] if args.max_samples else [])])
        r = json.loads(out.strip().splitlines()[-1])
        r["wall_s"] = wall
        runs.append(r)
    result = {"gb": args.gb, "bytes": size, "cat_s": cat_s, "runs": runs, "seq_length": args.seq_length,
              "batch": args.batch, "max_samples": args.max_samples, "cores": os.cpu_count(),
              "python": sys.version.split()[0]}
    (args.dir / "bench_data_read.json").write_text(json.dumps(result, indent=1))
    report(result, args.write_docs)
    if not args.keep:
        for ext in (".bin", ".idx"):
            Path(f"{prefix}{ext}").unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
