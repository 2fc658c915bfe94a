"""Benchmark: ``ckpt reshard`` and ``ckpt export`` against ``cp -r`` of the same files, by checkpoint size.

For each layer count it builds a synthetic ``dp_reshardable`` checkpoint of a GPT (hidden 1024,
ffn 4096, vocab 32000, fp32, tp1-cp2-g2-dp2 folded: 8 ranks' worth of keys) under ``--workdir``
with the reshard engine's own writer (the layout, manifest, CRC-32C and metadata of a training
save; the values are slices of one random buffer, so generating 4 GB costs no training), then in
the same run, each as a fresh subprocess, one after the other:

* ``cp -r SRC COPY`` (the baseline: the same bytes read and written, nothing decoded);
* ``cp -r SRC COPY; sync`` (context only: ``cp`` leaves its data in dirty pages, while reshard and
  export fsync every file before they commit, so this is the like-for-like durable copy);
* ``ckpt reshard SRC DST --tp 2 --cp 1 --no-fold-cp`` (every byte moves to another layout);
* ``ckpt export SRC DST --to hf --optimizer`` (weights, master weights and both moments: every
  byte of the checkpoint is read and written once);
* at the largest size, ``ckpt reshard`` again with ``--max-memory 256 MiB``.

Throughput is checkpoint bytes (SRC's data and metadata files) over wall time of the subprocess,
start-up included; peak memory is the command's own ``VmHWM`` (JSON summary). Page cache is not
dropped (the files are read once, untimed, after they are written; ``cp`` runs on the same warm
cache). Before each timed command an untimed ``sync`` writes back what the previous one left
dirty: without it, the command after ``cp -r`` shared the disk with the kernel writing back
``cp``'s 4.7 GB and was charged for it. ``--write-docs`` replaces the section "ckpt reshard and
export" of docs/performance.md.

    python benchmarks/bench_reshard.py --layers 4,8,16 --repeats 3 --write-docs
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

import numpy as np
from docs_section import write_section
from tabulate import tabulate

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ckpt_tool.copying.engine import write_checkpoint  # noqa: E402
from ckpt_tool.copying.plan import OutChunk, plan_target  # noqa: E402
from gtp_format.layout.config import ModelConfig, ParallelConfig  # noqa: E402
from gtp_format.layout.params import buffer_layouts  # noqa: E402
from gtp_format.manifest import HASH_ALGORITHM, Manifest, OptimizerInfo, format_version_for  # noqa: E402
from gtp_format.names import iter_dir_name  # noqa: E402
from gtp_format.scan import carrier  # noqa: E402
from gtp_format.writer.checkpoint import CheckpointWriter  # noqa: E402

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
    ap.add_argument("--repeats", type=int, default=1,
                    help="rounds of the four commands per size (interleaved); times are medians")
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
    opt = OptimizerInfo("adamw", 1, {"lr": 1e-3})
    manifest = Manifest(format_version=format_version_for(opt), layout="torch_dist",
                        optimizer_sharding="dp_reshardable", iteration=1, topology=SOURCE, model=model,
                        param_dtype="torch.float32", optimizer=opt, bucket_size=bucket,
                        buffers=buffer_layouts(model, SOURCE, bucket, "torch.float32"),
                        hash_algorithm=HASH_ALGORITHM, files={})
    folder = root / iter_dir_name(1)
    root.mkdir(parents=True, exist_ok=True)
    with CheckpointWriter(folder) as writer:
        write_checkpoint(_fill, manifest, plan_target(manifest, 64 << 20), writer, 2, lambda n: None)
        writer.commit()
        writer.set_latest(1)
    for p in folder.iterdir():  # warm: the writer's O_DIRECT writes leave nothing in the page cache
        with open(p, "rb", buffering=0) as f:
            while f.read(16 << 20):
                pass
    return sum(p.stat().st_size for p in folder.iterdir())


def timed(cmd: list[str], then_sync: bool = False) -> tuple[float, int, int]:
    """Wall seconds, peak RSS and RSS after imports (bytes, from the command's JSON summary).

    The disk is synced first (untimed) so no earlier command's writeback runs during this one;
    ``then_sync``: the time includes a ``sync`` after the command.
    """
    os.sync()
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True)
    if then_sync:
        os.sync()
    dt = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed: {r.stderr[-2000:]}")
    doc = json.loads(r.stdout) if cmd[0] != "cp" else {"peak_rss_bytes": 0, "baseline_rss_bytes": 0}
    return dt, int(doc["peak_rss_bytes"]), int(doc["baseline_rss_bytes"])


def one_round(src: Path, work: Path, ckpt: list[str]) -> dict[str, tuple[float, int, int]]:
    """``cp -r``, ``cp -r; sync``, reshard and export of ``src`` once each, outputs removed after each."""
    out = {}
    for name, cmd, dst, then_sync in (
            ("cp", ["cp", "-r", str(src)], "copy", False), ("cps", ["cp", "-r", str(src)], "copy", True),
            ("rs", [*ckpt, "reshard", str(src)], "rs", False), ("hf", [*ckpt, "export", str(src)], "hf", False),
            ("hfm", [*ckpt, "export", str(src)], "hfm", False)):
        tail = {"rs": ["--tp", "2", "--cp", "1", "--no-fold-cp", "--format", "json"],
                "hf": ["--to", "hf", "--optimizer", "--format", "json"],
                "hfm": ["--to", "hf", "--optimizer", "--names", "megatron", "--format", "json"]}.get(name, [])
        out[name] = timed([*cmd, str(work / dst), *tail], then_sync=then_sync)
        shutil.rmtree(work / dst)
    return out


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.load = os.getloadavg()
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
        got = [one_round(src, work, ckpt) for _ in range(args.repeats)]
        t_cp, t_cps, t_rs, t_hf, t_hfm = (statistics.median(r[k][0] for r in got)
                                          for k in ("cp", "cps", "rs", "hf", "hfm"))
        _, m_rs, b_rs = max((r["rs"] for r in got), key=lambda x: x[1])
        _, m_hf, b_hf = max((r["hf"] for r in got), key=lambda x: x[1])
        row = {"ckpt GB": round(gb, 2), "layers": layers, "cp -r s": round(t_cp, 2),
               "cp -r GB/s": round(gb / t_cp, 2), "cp -r + sync s": round(t_cps, 2), "reshard s": round(t_rs, 2),
               "reshard GB/s": round(gb / t_rs, 2), "reshard vs cp": f"{t_cp / t_rs:.2f}x",
               "reshard vs cp+sync": f"{t_cps / t_rs:.2f}x", "export hf s": round(t_hf, 2),
               "export GB/s": round(gb / t_hf, 2), "export vs cp": f"{t_cp / t_hf:.2f}x",
               "export megatron names vs cp": f"{t_cp / t_hfm:.2f}x",
               "reshard peak MiB (data)": f"{m_rs >> 20} ({(m_rs - b_rs) >> 20})",
               "export peak MiB (data)": f"{m_hf >> 20} ({(m_hf - b_hf) >> 20})", "budget MiB": 2048}
        if layers == sizes[-1]:
            t_lo, m_lo, b_lo = timed([*ckpt, "reshard", str(src), str(work / "rs256"), "--tp", "2", "--cp", "1",
                                   "--no-fold-cp", "--max-memory", str(256 << 20), "--format", "json"])
            row["256 MiB budget: reshard s"] = round(t_lo, 2)
            row["256 MiB budget: peak MiB (data)"] = f"{m_lo >> 20} ({(m_lo - b_lo) >> 20})"
        rows.append(row)
        fits.append((gb, t_rs, t_hf, t_cp, t_cps))
        print(json.dumps(row), flush=True)
        for p in ("copy", "rs", "hf", "hfm", "rs256", f"src{layers}"):
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
    rounds = f"times are medians of {args.repeats} interleaved rounds (peak memory: the largest); " \
        if args.repeats > 1 else ""
    lines = [
        f"Synthetic `dp_reshardable` checkpoints ({SOURCE.describe()}, hidden {args.hidden}, ffn {args.ffn}, "
        f"vocab {args.vocab}, fp32; "
        "written by the reshard engine's own writer), resharded to tp2-cp1-g2-dp2-nofold and exported to "
        "Hugging Face safetensors with `--optimizer` (every byte read and written once; transformers names "
        "with q/k/v split out of the fused QKV, and, for comparison, `--names megatron`: whole tensors), "
        "against `cp -r` of the same folder in the same run (and, for context, `cp -r` followed by `sync`: "
        "reshard and export fsync every file, `cp` does not). Each command is a fresh subprocess, start-up "
        "included; warm page cache; an untimed `sync` before each command, so none pays for the previous one's "
        "writeback; "
        f"{rounds}"
        f"default `--max-memory` (2 GiB) and workers. Machine: {os.cpu_count()} CPU cores shared with other jobs "
        f"(1-minute load average {args.load[0]:.1f} at the start, {os.getloadavg()[0]:.1f} at the end), "
        f"{platform.machine()}, Python {platform.python_version()}. No torch is imported by either command "
        "(torch_dist is written by `gtp_format.writer`).",
        "",
        "```",
        f"python benchmarks/bench_reshard.py --layers {args.layers}"
        + (f" --repeats {args.repeats}" if args.repeats > 1 else "") + " --write-docs",
        "```",
        "",
        tabulate(rows, headers="keys", tablefmt="github"),
        "",
    ]
    if len(fits) >= 2:
        for name, i in (("reshard", 1), ("export", 2), ("cp -r", 3), ("cp -r + sync", 4)):
            a, b, r2 = _linear(gbs, [f[i] for f in fits])
            lines.append(f"- Time against size, {name}: {a:.2f} s per GB + {b:.2f} s, R^2 = {r2:.4f} (least squares "
                         f"over {len(fits)} sizes).")
    big = rows[-1]
    lines.append(f"- Target (>= 0.5x the throughput of `cp -r` at >= 4 GB; export --to hf: >= 0.75x): reshard "
                 f"{big['reshard vs cp']}, export {big['export vs cp']} (megatron names "
                 f"{big['export megatron names vs cp']}) at {big['ckpt GB']} GB.")
    lines.append(f"- Peak memory against the budget, peak RSS (RSS above the process's RSS right after its "
                 f"imports, i.e. what the data took): reshard {big['reshard peak MiB (data)']} MiB, export "
                 f"{big['export peak MiB (data)']} MiB with the 2048 MiB default; "
                 f"{big.get('256 MiB budget: peak MiB (data)', '-')} MiB with `--max-memory 256 MiB`.")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
