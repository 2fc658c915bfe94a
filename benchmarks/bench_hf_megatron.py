"""Benchmark: ``ckpt import --from hf --to megatron-core`` and ``ckpt export --to hf`` of megatron-core,
against ``cp -r`` of the same bytes, from a cold page cache, within ``--max-memory``.

It writes a synthetic ``LlamaForCausalLM`` folder (fp32, safetensors shards of at most 2 GB and an
index, streamed: never a whole tensor in memory) sized so that its megatron-core checkpoint (the
weights, fp32 masters and two Adam moments: 4x the HF bytes) is ``--gb`` GB, then runs interleaved
rounds, each command a fresh subprocess:

* ``cp -r MC COPY``: the baseline, the megatron-core checkpoint (the larger side of both commands:
  the import writes it, the export reads its weights and the read ledger checks every file's CRC);
* ``cp -r HF COPY``: the HF folder, for reference;
* ``ckpt import HF MC2 --from hf --to megatron-core --tp T --dp D`` (``dp_reshardable``, fresh optimizer);
* ``ckpt export MC HF2 --to hf`` (the weights by architecture).

Before every command: ``sync`` (untimed) and ``posix_fadvise(POSIX_FADV_DONTNEED)`` on every file of
its source. Ratios are the ``cp -r MC`` time over the command's (the same bytes moved), per round
and over the medians; peak RSS is the command's own (``--format json``), against ``--max-memory``;
CPU seconds are the command's user + system time.

    python benchmarks/bench_hf_megatron.py --gb 4 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from bench_export_hf import evict
from tabulate import tabulate

REPO = Path(__file__).resolve().parents[1]
SHARD = 2 * 10**9


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=4.0, help="size of the megatron-core checkpoint (4x the HF folder)")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--ffn", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--max-memory", default="2GiB")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved rounds; figures are medians")
    ap.add_argument("--workdir", default="/tmp/bench_hf_megatron")
    ap.add_argument("--keep", action="store_true", help="reuse WORKDIR/hf and WORKDIR/mc if there, and leave them")
    ap.add_argument("--smoke", action="store_true", help="tiny run (tests): hidden 64, 1 round")
    args = ap.parse_args(argv)
    if args.smoke:
        args.gb, args.hidden, args.ffn, args.vocab, args.repeats = 0.004, 64, 256, 512, 1
    return args


def llama_shapes(hidden: int, ffn: int, vocab: int, layers: int) -> list[tuple[str, tuple[int, ...]]]:
    kv = hidden // 4  # GQA: 8 heads of 128 (or hidden / 8), 2 key/value heads
    out = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        at = f"model.layers.{i}"
        out += [(f"{at}.input_layernorm.weight", (hidden,)), (f"{at}.self_attn.q_proj.weight", (hidden, hidden)),
                (f"{at}.self_attn.k_proj.weight", (kv, hidden)), (f"{at}.self_attn.v_proj.weight", (kv, hidden)),
                (f"{at}.self_attn.o_proj.weight", (hidden, hidden)),
                (f"{at}.post_attention_layernorm.weight", (hidden,)), (f"{at}.mlp.gate_proj.weight", (ffn, hidden)),
                (f"{at}.mlp.up_proj.weight", (ffn, hidden)), (f"{at}.mlp.down_proj.weight", (hidden, ffn))]
    return out + [("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]


def make_hf(root: Path, args: argparse.Namespace) -> int:
    """The synthetic folder; returns its layer count. Tensors hold a repeated block of small normal values
    (norms: ones), written block by block."""
    h, ffn, vocab = args.hidden, args.ffn, args.vocab
    per_layer = sum(4 * np.prod(s) for _, s in llama_shapes(h, ffn, vocab, 1)[1:-2])
    fixed = 4 * (2 * vocab * h + h)
    layers = max(1, round((args.gb * 1e9 / 4 - fixed) / per_layer))
    heads = max(1, h // 128) if h >= 1024 else 8
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": h, "intermediate_size": ffn,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": max(1, heads // 4),
        "head_dim": h // heads, "vocab_size": vocab, "rms_norm_eps": 1e-5, "hidden_act": "silu",
        "max_position_embeddings": 4096, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False, "dtype": "float32"}))
    shapes = llama_shapes(h, ffn, vocab, layers)
    groups: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in shapes:
        n = 4 * int(np.prod(shape))
        if groups[-1] and size + n > SHARD:
            groups.append([])
            size = 0
        groups[-1].append((name, shape))
        size += n
    block = (np.random.default_rng(0).standard_normal(1 << 20) * 0.02).astype(np.float32).tobytes()
    weight_map = {}
    for i, group in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        header, off = {}, 0
        for name, shape in group:
            n = 4 * int(np.prod(shape))
            header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [off, off + n]}
            off += n
            weight_map[name] = fname
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        with open(root / fname, "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            for _, shape in group:
                n = 4 * int(np.prod(shape))
                data = np.ones(shape[0], np.float32).tobytes() if len(shape) == 1 else None
                if data is not None:
                    f.write(data)
                    continue
                while n:
                    k = min(n, len(block))
                    f.write(block[:k])
                    n -= k
    (root / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": sum(4 * int(np.prod(s)) for _, s in shapes)}, "weight_map": weight_map}))
    return layers


def ratio(r: float) -> str:
    """Two decimals, or two significant digits below 0.01 (a smoke run's tiny copy is not shown as 0.00x)."""
    return f"{r:.2f}x" if r >= 0.01 else f"{r:.2g}x"


def size(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def cpu_children() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def timed(cmd: list[str], src: Path, out: Path) -> tuple[float, int | None, float]:
    """Wall seconds (fresh subprocess, SRC's pages evicted first), the command's own peak RSS and its CPU
    seconds (user + system: what a shared 2-core machine's wall times hide under other jobs' load)."""
    os.sync()
    evict(src)
    c0, t0 = cpu_children(), time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    dt, cpu = time.perf_counter() - t0, cpu_children() - c0
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed: {r.stderr[-2000:]}")
    shutil.rmtree(out)
    peak = json.loads(r.stdout).get("peak_rss_bytes") if cmd[0] != "cp" else None
    return dt, peak, cpu


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    work = Path(args.workdir)
    hf, mc = work / "hf", work / "mc"
    ckpt = [sys.executable, "-m", "ckpt_tool.cli"]
    load0 = os.getloadavg()[0]
    if not (args.keep and hf.is_dir() and mc.is_dir()):
        shutil.rmtree(work, ignore_errors=True)
        layers = make_hf(hf, args)
        topo = ["--tp", str(args.tp), "--dp", str(args.dp)]
        r = subprocess.run([*ckpt, "import", str(hf), str(mc), "--from", "hf", "--to", "megatron-core", *topo,
                            "--format", "json"], capture_output=True, text=True, env={**os.environ,
                                                                                    "PYTHONPATH": str(REPO)})
        if r.returncode != 0:
            raise SystemExit(r.stderr[-2000:])
    layers = json.loads((hf / "config.json").read_text())["num_hidden_layers"]
    gb_hf, gb_mc = size(hf) / 1e9, size(mc) / 1e9
    mem = ["--max-memory", args.max_memory, "--format", "json"]
    out = work / "out"
    cmds = {
        "cp -r MC": (["cp", "-r", str(mc), str(out)], mc),
        "cp -r HF": (["cp", "-r", str(hf), str(out)], hf),
        "import hf -> megatron-core": ([*ckpt, "import", str(hf), str(out), "--from", "hf", "--to", "megatron-core",
                                        "--tp", str(args.tp), "--dp", str(args.dp), *mem], hf),
        "export megatron-core -> hf": ([*ckpt, "export", str(mc), str(out), "--to", "hf", *mem], mc),
    }
    times: dict[str, list[float]] = {k: [] for k in cmds}
    peaks: dict[str, list[int]] = {k: [] for k in cmds}
    cpus: dict[str, list[float]] = {k: [] for k in cmds}
    try:
        for _ in range(args.repeats):
            for name, (cmd, src) in cmds.items():
                dt, peak, cpu = timed(cmd, src, out)
                times[name].append(dt)
                cpus[name].append(cpu)
                if peak:
                    peaks[name].append(peak)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    load1 = os.getloadavg()[0]
    cp = times["cp -r MC"]
    rows = []
    for name, ts in times.items():
        ratios = [c / t for c, t in zip(cp, ts)]
        rows.append({"command": name, "median s": round(statistics.median(ts), 2),
                     "min-max s": f"{min(ts):.2f}-{max(ts):.2f}",
                     "vs cp -r MC (medians)": ratio(statistics.median(cp) / statistics.median(ts)),
                     "per round min-median-max": f"{ratio(min(ratios))[:-1]}-{ratio(statistics.median(ratios))[:-1]}-"
                                                 f"{ratio(max(ratios))}",
                     "median CPU s": round(statistics.median(cpus[name]), 2),
                     "peak RSS MiB": round(max(peaks[name]) / 2**20) if peaks[name] else "-"})
    print(f"HF folder {gb_hf:.2f} GB ({layers} layers, hidden {args.hidden}, ffn {args.ffn}, vocab {args.vocab}, "
          f"fp32); megatron-core checkpoint {gb_mc:.2f} GB (tp{args.tp} dp{args.dp}, dp_reshardable); "
          f"{args.repeats} rounds; --max-memory {args.max_memory}; load {load0:.1f} -> {load1:.1f}; "
          f"{os.cpu_count()} CPUs, {platform.machine()}, Python {platform.python_version()}")
    print(tabulate(rows, headers="keys", tablefmt="github"))
    print(json.dumps({"gb_hf": gb_hf, "gb_mc": gb_mc, "times": times, "peaks": peaks, "cpu": cpus}))


if __name__ == "__main__":
    main()
