"""Benchmark: ``ckpt reshard`` and ``ckpt export`` against ``cp -r`` of the same files, by checkpoint size.

For each layer count it builds a synthetic ``dp_reshardable`` checkpoint of a GPT (hidden 1024,
ffn 4096, vocab 32000, fp32, tp1-cp2-g2-dp2 folded: 8 ranks' worth of keys) under ``--workdir``
with the reshard engine's own writer (the layout, manifest, CRC-32C and metadata of a training
save; the values are slices of one random buffer, so generating 4 GB costs no training), then in
the same run, each as a fresh subprocess, one after the other:

* ``cp -r SRC COPY`` (the baseline: the same bytes read and written, nothing decoded);
* ``ckpt reshard SRC DST --tp 2 --cp 1 --no-fold-cp`` (every byte moves to another layout);
* ``ckpt export SRC DST --to hf --optimizer`` (weights, master weights and both moments: every
  byte of the checkpoint is read and written once);
* at the largest size, ``ckpt reshard`` again with ``--max-memory 256 MiB``.

Throughput is checkpoint bytes (SRC's data and metadata files) over wall time of the subprocess,
start-up included; peak memory is the command's own ``VmHWM`` (JSON summary). Page cache is not dropped (the
files were just written; ``cp`` runs on the same warm cache). ``--write-docs`` replaces the
section "ckpt reshard and export" of docs/performance.md.

    python benchmarks/bench_reshard.py --write-docs
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from docs_section import write_section
from tabulate import tabulate

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ckpt_tool.reshard.engine import write_checkpoint  # noqa: E402
from ckpt_tool.reshard.plan import OutChunk, plan_target  # noqa: E402
from gtp_format.layout.config import ModelConfig, ParallelConfig  # noqa: E402
from gtp_format.layout.params import buffer_layouts  # noqa: E402
from gtp_format.manifest import HASH_ALGORITHM, MANIFEST_VERSION, Manifest, OptimizerInfo  # noqa: E402
from gtp_format.names import LATEST_FILE, iter_dir_name  # noqa: E402
from gtp_format.scan import carrier  # noqa: E402

SECTION = "ckpt reshard and export"
SOURCE = ParallelConfig(cp=2, gtp_remat=2, dp=2, fold_cp=True)
BASE = np.random.default_rng(0).standard_normal(16 << 20, dtype=np.float32)  # 64 MiB of values to slice from


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", default="1,4,8,16", help="comma list of layer counts, one checkpoint each")
    ap.add_argument("--workdir", default="/tmp/bench_reshard", help="generated checkpoints go here (removed after)")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--ffn", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--write-docs", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="tiny run (tests/benchmarks): hidden 64, 1 and 2 layers")
    args = ap.parse_args(argv)
    if args.smoke:
        args.layers, args.hidden, args.ffn, args.vocab = "1,2", 64, 256, 512
    return args


def _fill(c: OutChunk) -> np.ndarray:
    if c.values is not None:
        return np.asarray(c.values, dtype=np.int64)
    n = c.numel
    start = hash((c.key, c.offsets)) % BASE.size
    out = np.empty(n, dtype=np.float32)
    pos = 0
    while pos < n:
        take = min(n - pos, BASE.size - start)
        out[pos:pos + take] = BASE[start:start + take]
        pos, start = pos + take, 0
    return out.view(carrier(c.dtype)).reshape(c.sizes) if c.dtype.itemsize == 4 else out.reshape(c.sizes)


def make_source(root: Path, layers: int, args: argparse.Namespace) -> int:
    model = ModelConfig(vocab_size=args.vocab, hidden=args.hidden, num_layers=layers, num_heads=8,
                        ffn_hidden=args.ffn, seq_length=32)
    bucket = 40_000_000
    manifest = Manifest(format_version=MANIFEST_VERSION, layout="torch_dist", optimizer_sharding="dp_reshardable",
                        iteration=1, topology=SOURCE, model=model, param_dtype="torch.float32",
                        optimizer=OptimizerInfo("adamw", 1, {"lr": 1e-3}), bucket_size=bucket,
                        buffers=buffer_layouts(model, SOURCE, bucket, "torch.float32"),
                        hash_algorithm=HASH_ALGORITHM, files={})
    folder = root / iter_dir_name(1)
    folder.mkdir(parents=True)
    write_checkpoint(_fill, manifest, plan_target(manifest, 64 << 20), folder, 2, lambda n: None)
    (root / LATEST_FILE).write_text("1\n")
    return sum(p.stat().st_size for p in folder.iterdir())


def timed(cmd: list[str]) -> tuple[float, int, int]:
    """Wall seconds, peak RSS and RSS after imports (bytes, from the command's JSON summary)."""
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True)
    dt = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed: {r.stderr[-2000:]}")
    doc = json.loads(r.stdout) if cmd[0] != "cp" else {"peak_rss_bytes": 0, "baseline_rss_bytes": 0}
    return dt, int(doc["peak_rss_bytes"]), int(doc["baseline_rss_bytes"])


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    work = Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    ckpt = [sys.executable, "-m", "ckpt_tool.cli"]
    rows, fits = [], []
    sizes = [int(x) for x in args.layers.split(",")]
    for layers in sizes:
        src = work / f"src{layers}"
        nbytes = make_source(src, layers, args)
        gb = nbytes / 1e9
        t_cp, _, _ = timed(["cp", "-r", str(src), str(work / "copy")])
        t_rs, m_rs, b_rs = timed([*ckpt, "reshard", str(src), str(work / "rs"), "--tp", "2", "--cp", "1",
                                  "--no-fold-cp", "--format", "json"])
        t_hf, m_hf, b_hf = timed([*ckpt, "export", str(src), str(work / "hf"), "--to", "hf", "--optimizer",
                               "--format", "json"])
        row = {"ckpt GB": round(gb, 2), "layers": layers, "cp -r s": round(t_cp, 2),
               "cp -r GB/s": round(gb / t_cp, 2), "reshard s": round(t_rs, 2), "reshard GB/s": round(gb / t_rs, 2),
               "reshard vs cp": f"{t_cp / t_rs:.2f}x", "export hf s": round(t_hf, 2),
               "export GB/s": round(gb / t_hf, 2), "export vs cp": f"{t_cp / t_hf:.2f}x",
               "reshard peak MiB (data)": f"{m_rs >> 20} ({(m_rs - b_rs) >> 20})",
               "export peak MiB (data)": f"{m_hf >> 20} ({(m_hf - b_hf) >> 20})", "budget MiB": 2048}
        if layers == sizes[-1]:
            t_lo, m_lo, b_lo = timed([*ckpt, "reshard", str(src), str(work / "rs256"), "--tp", "2", "--cp", "1",
                                   "--no-fold-cp", "--max-memory", str(256 << 20), "--format", "json"])
            row["256 MiB budget: reshard s"] = round(t_lo, 2)
            row["256 MiB budget: peak MiB (data)"] = f"{m_lo >> 20} ({(m_lo - b_lo) >> 20})"
        rows.append(row)
        fits.append((gb, t_rs, t_hf, t_cp))
        print(json.dumps(row), flush=True)
        for p in ("copy", "rs", "hf", "rs256", f"src{layers}"):
            shutil.rmtree(work / p, ignore_errors=True)
    shutil.rmtree(work, ignore_errors=True)
    body = report(rows, fits, args)
    print(body)
    if args.write_docs:
        write_section(SECTION, body)


def _linear(xs: list[float], ys: list[float]) -> tuple[float, float, float]:
    a, b = np.polyfit(xs, ys, 1)
    pred = np.polyval([a, b], xs)
    ss = float(np.sum((np.array(ys) - np.mean(ys)) ** 2)) or 1.0
    return float(a), float(b), 1.0 - float(np.sum((np.array(ys) - pred) ** 2)) / ss


def report(rows: list[dict], fits: list[tuple], args: argparse.Namespace) -> str:
    gbs = [f[0] for f in fits]
    lines = [
        f"Synthetic `dp_reshardable` checkpoints ({SOURCE.describe()}, hidden {args.hidden}, ffn {args.ffn}, "
        f"vocab {args.vocab}, fp32; "
        "written by the reshard engine's own writer), resharded to tp2-cp1-g2-dp2-nofold and exported to "
        "Hugging Face safetensors with `--optimizer` (every byte read and written once), against `cp -r` of the "
        "same folder in the same run. Each command is a fresh subprocess, start-up included; warm page cache; "
        f"default `--max-memory` (2 GiB) and workers. Machine: {os.cpu_count()} CPU cores shared with other jobs, "
        f"{platform.machine()}, Python {platform.python_version()}.",
        "",
        "```",
        f"python benchmarks/bench_reshard.py --layers {args.layers} --write-docs",
        "```",
        "",
        tabulate(rows, headers="keys", tablefmt="github"),
        "",
    ]
    if len(fits) >= 2:
        for name, i in (("reshard", 1), ("export", 2), ("cp -r", 3)):
            a, b, r2 = _linear(gbs, [f[i] for f in fits])
            lines.append(f"- Time against size, {name}: {a:.2f} s per GB + {b:.2f} s, R^2 = {r2:.4f} (least squares "
                         f"over {len(fits)} sizes).")
    big = rows[-1]
    lines.append(f"- Target (>= 0.5x the throughput of `cp -r` at >= 4 GB): reshard {big['reshard vs cp']}, export "
                 f"{big['export vs cp']} at {big['ckpt GB']} GB.")
    lines.append(f"- Peak memory against the budget, peak RSS (RSS above the process's RSS right after its "
                 f"imports, i.e. what the data took): reshard {big['reshard peak MiB (data)']} MiB, export "
                 f"{big['export peak MiB (data)']} MiB with the 2048 MiB default; "
                 f"{big.get('256 MiB budget: peak MiB (data)', '-')} MiB with `--max-memory 256 MiB`.")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
