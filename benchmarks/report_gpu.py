"""Turn ``bench_gpu.py``'s JSON into the GPU section of docs/performance.md and a PNG plot.

    python benchmarks/report_gpu.py docs/gpu_results.json --png docs/gpu_fold.png --write-docs

The checkpoint table comes from docs/gpu_ckpt_results.json (an earlier ``--ckpt`` run).

Needs matplotlib for the plot (``pip install matplotlib``); the table needs only tabulate.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from tabulate import tabulate

SECTION = "## GPU: folded vs unfolded on 2 x H200 (NCCL)"
CKPT_JSON = Path(__file__).resolve().parent.parent / "docs" / "gpu_ckpt_results.json"
TARGET_MFU = 0.50


def _ok(rows: list[dict]) -> list[dict]:
    return [r for r in rows if "error" not in r]


def table(res: dict) -> str:
    rows = []
    for r in [*res.get("baseline_rows", []), *res["rows"]]:
        if "error" in r:
            rows.append({"config": r["config"], "step ms": r["error"][:60]})
            continue
        rows.append({
            "config": r["config"],
            "shape h/L/s": f"{r['hidden']}/{r['layers']}/{r['seq']}",
            "step ms": round(r["step_ms"], 1),
            "MFU": f"{100 * r['mfu']:.1f}%",
            "peak mem GiB": round(r["peak_mem_gib"], 2),
            "dense w+g GiB": round(r["dense_wgrad_gib"], 3),
            "NCCL ms": round(r["comm_ms"], 1),
            "exposed NCCL ms": round(r["exposed_comm_ms"], 1),
            "GEMM ms": round(r.get("gpu_ms_gemm", 0.0), 1),
            "attention ms": round(r.get("gpu_ms_attention", 0.0), 1),
            "other kernels ms": round(r.get("gpu_ms_other", 0.0), 1),
            "no-kernel ms": round(r["step_ms"] - r["gpu_busy_ms"], 1) if "gpu_busy_ms" in r else "-",
        })
    return tabulate(rows, headers="keys", tablefmt="github")


def ckpt_table(res: dict) -> str:
    rows = []
    for r in res["rows"]:
        if "save_gbps" not in r:
            continue
        rows.append({
            "config": r["config"], "checkpoint GB": round(r["ckpt_gb"], 2),
            "save GB/s": round(r["save_gbps"], 2), "torch.save GB/s": round(r["torch_save_gbps"], 2),
            "save ratio": round(r["save_gbps"] / r["torch_save_gbps"], 2),
            "load GB/s": round(r["load_gbps"], 2), "torch.load GB/s": round(r["torch_load_gbps"], 2),
            "load ratio": round(r["load_gbps"] / r["torch_load_gbps"], 2),
        })
    return tabulate(rows, headers="keys", tablefmt="github")


def _row(res: dict, name: str) -> dict | None:
    return next((r for r in _ok(res["rows"]) if r["config"] == name), None)


def sweep_rows(res: dict) -> list[dict]:
    """The folded fused rows of the main width and depth, one per sequence length."""
    m = res["model"]
    rows = [r for r in _ok(res["rows"]) if r["fold_cp"] and r["fused"] != "none" and r["fused"] != "liger"
            and r["overlap"] and r["hidden"] == m["hidden"] and r["layers"] == m["num_layers"]]
    return sorted(rows, key=lambda r: r["seq"])


def plot(res: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m = res["model"]
    main = [r for r in _ok(res["rows"]) if r["hidden"] == m["hidden"] and r["seq"] == m["seq_length"]]
    names = [r["config"].replace(", ", "\n").replace(" ", "\n", 1) for r in main]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    bottom = [0.0] * len(main)
    for key, label, color in (("gpu_ms_gemm", "GEMM", "#4c72b0"), ("gpu_ms_attention", "attention", "#55a868"),
                              ("gpu_ms_other", "other kernels", "#c44e52"), ("exposed_comm_ms", "exposed NCCL",
                                                                             "#dd8452"),
                              ("no_kernel_ms", "no kernel running", "#bbbbbb")):
        vals = [r["step_ms"] - r["gpu_busy_ms"] if key == "no_kernel_ms" else r.get(key, 0.0) for r in main]
        axes[0].bar(names, vals, bottom=bottom, color=color, label=label)
        bottom = [b + v for b, v in zip(bottom, vals)]
    axes[0].set_ylabel("ms per step (kernel split from one traced step)")
    axes[0].set_ylim(0, 1.35 * max(bottom))
    axes[0].set_title(f"where a step goes (h{m['hidden']}, {m['num_layers']} layers, seq {m['seq_length']})")
    axes[0].legend(fontsize=7, loc="upper right")
    axes[1].bar(names, [100 * r["mfu"] for r in main], color="#8172b3")
    axes[1].axhline(100 * TARGET_MFU, color="red", linestyle="--", label="50% target")
    axes[1].set_ylabel("% of measured bf16 peak")
    axes[1].set_title(f"MFU (peak {res['peak_bf16_tflops']:.0f} TFLOP/s)")
    axes[1].legend()
    sw = sweep_rows(res)
    ax = axes[2]
    ax.plot([r["seq"] for r in sw], [100 * r["mfu"] for r in sw], "o-", color="#8172b3", label="MFU %")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length (folded, fused)")
    ax.set_ylabel("MFU %")
    ax2 = ax.twinx()
    ax2.plot([r["seq"] for r in sw], [r["peak_mem_gib"] for r in sw], "s--", color="#55a868", label="peak GiB")
    ax2.set_ylabel("peak allocated GiB per GPU")
    ax.set_title("sequence sweep")
    ax.legend(loc="upper left", fontsize=8)
    ax2.legend(loc="lower right", fontsize=8)
    for a in axes[:2]:
        a.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def where_time_goes(r: dict) -> list[str]:
    idle = ", ".join(f"{k} {v:.1f}" for k, v in sorted(r.get("idle_by_phase_ms", {}).items(), key=lambda kv: -kv[1]))
    top = "; ".join(f"`{n[:90]}` {ms:.1f} ms x{c}" for n, ms, c in r.get("top_other_kernels", [])[:6])
    busy = r.get("gpu_busy_ms", 0.0)
    return [f"- **{r['config']}**: kernels (compute or exposed NCCL) {busy:.1f} ms of a {r['step_ms']:.1f} ms step, so "
            f"about {r['step_ms'] - busy:.1f} ms of an untraced step has no kernel running. The traced step itself "
            f"ran slower (host-side tracing): idle there by phase, ms: {idle}. Largest other kernels: {top}."]


def section(res: dict, png: Path | None) -> str:
    m = res["model"]
    fused = next((r["fused"] for r in _ok(res["rows"]) if r["fused"] not in ("none", "liger")), "compile")
    unf, fol = _row(res, "unfolded"), _row(res, "folded")
    funf, ffol = _row(res, f"unfolded {fused}"), _row(res, f"folded {fused}")
    lines = [
        SECTION, "",
        f"Main shape: hidden {m['hidden']}, {m['num_layers']} layers, {m['num_heads']} heads, ffn {m['ffn_hidden']}, "
        f"sequence {m['seq_length']}, vocab {m['vocab_size']}, micro-batch {res['micro_batch']}; bf16 params, fp32 "
        f"grads and optimizer state; cp2, gtp_remat 1 on {res['world']} x {res['gpu']}, torch {res['torch']}. "
        f"bf16 matmul peak measured in the same run: {res['peak_bf16_tflops']:.0f} TFLOP/s per GPU; MFU counts "
        "6 x params x tokens plus causal attention against it. Rows named `unfolded` / `folded` alone are "
        "unfused (the layers as they were, the path the fp32 reference checks); `compile` rows use "
        "`--fused compile` (torch.compile regions, chunked linear cross-entropy); `liger` uses Liger-Kernel's "
        "RMSNorm, fused add+RMSNorm, RoPE and cross-entropy. Every row but `before #15` has the runtime changes "
        "of issue 15 (weight gradients accumulated in the GEMM, dp/dp_cp buckets reduced during backward, async "
        "parameter all-gathers); `no overlap` turns off prefetch and both overlaps. Exposed NCCL = time NCCL "
        "kernels run while no compute kernel runs, from a CUDA trace of "
        "one step on rank 0. no-kernel ms = step time (mean of 5 untraced "
        "steps) minus the traced step's kernel time (compute and exposed NCCL): the time the GPU waits for the host.",
        "", "```", "# on the 2-GPU machine; the baseline is the same script at the commit before issue 15 (101e36d)",
        "git worktree add /tmp/base 101e36d && (cd /tmp/base && python benchmarks/bench_gpu.py --only unfolded folded "
        "--json /tmp/gpu_baseline.json)",
        "python benchmarks/bench_gpu.py --json docs/gpu_results.json",
        "python benchmarks/report_gpu.py docs/gpu_results.json --baseline docs/gpu_baseline.json "
        "--png docs/gpu_fold.png --write-docs", "```", "",
        table(res), "",
    ]
    base = {r["config"].removeprefix("before #15: "): r for r in res.get("baseline_rows", [])}
    mem_u = base["unfolded"]["peak_mem_gib"] if "unfolded" in base else 29.04
    mem_f = base["folded"]["peak_mem_gib"] if "folded" in base else 26.69
    mem_src = ", same session" if base else ", earlier run"
    if funf and ffol:
        worst = min(funf["mfu"], ffol["mfu"])
        lines += [
            "Targets (issue 15), fused rows of the main shape:", "",
            f"- MFU >= 50% in both: unfolded {100 * funf['mfu']:.1f}%, folded {100 * ffol['mfu']:.1f}% -- "
            + ("met." if worst >= TARGET_MFU else f"**not met** ({100 * (TARGET_MFU - worst):.1f} points short)."),
            f"- Folded step <= 1.0x unfolded: {ffol['step_ms'] / funf['step_ms']:.3f}x -- "
            + ("met." if ffol["step_ms"] <= funf["step_ms"] else "**not met**."),
            f"- Peak memory no worse than before ({mem_f:.1f} folded / {mem_u:.1f} unfolded GiB{mem_src}): "
            f"{ffol['peak_mem_gib']:.1f} / {funf['peak_mem_gib']:.1f} GiB -- "
            + ("met." if ffol["peak_mem_gib"] <= mem_f and funf["peak_mem_gib"] <= mem_u else "**not met**."),
            "- Exposed communication <= 5% of the step: unfolded "
            f"{100 * funf['exposed_comm_ms'] / funf['step_ms']:.1f}%, "
            f"folded {100 * ffol['exposed_comm_ms'] / ffol['step_ms']:.1f}% (rank 0; worst rank "
            f"{funf.get('exposed_comm_ms_worst_rank', 0):.1f} / {ffol.get('exposed_comm_ms_worst_rank', 0):.1f} ms) -- "
            + ("met." if max(funf["exposed_comm_ms"] / funf["step_ms"], ffol["exposed_comm_ms"] / ffol["step_ms"])
               <= 0.05 else "**not met**."),
        ]
        if "unfolded" in base and "folded" in base:
            bu, bf = base["unfolded"], base["folded"]
            lines.append(f"- Against the code before issue 15 (same session, previous call, peak "
                         f"{res.get('baseline_peak', 0):.0f} TFLOP/s): unfolded {bu['step_ms']:.0f} -> "
                         f"{funf['step_ms']:.0f} ms ({bu['step_ms'] / funf['step_ms']:.2f}x), folded "
                         f"{bf['step_ms']:.0f} -> {ffol['step_ms']:.0f} ms "
                         f"({bf['step_ms'] / ffol['step_ms']:.2f}x); MFU "
                         f"{100 * bu['mfu']:.1f}% / {100 * bf['mfu']:.1f}% -> {100 * funf['mfu']:.1f}% / "
                         f"{100 * ffol['mfu']:.1f}%.")
        if unf and fol:
            lines.append(f"- Fusing alone, same run: unfolded {unf['step_ms']:.0f} -> {funf['step_ms']:.0f} ms, folded "
                         f"{fol['step_ms']:.0f} -> {ffol['step_ms']:.0f} ms; other kernels "
                         f"{unf['gpu_ms_other']:.0f} -> {funf['gpu_ms_other']:.0f} ms unfolded.")
        lines.append("")
    sw = sweep_rows(res)
    if sw:
        lines += ["Folded, fused, sequence sweep (same width and depth):", "",
                  tabulate([{"sequence": r["seq"], "step ms": round(r["step_ms"], 1), "MFU": f"{100 * r['mfu']:.1f}%",
                             "tokens/s": round(r["tokens_per_s"]), "peak mem GiB": round(r["peak_mem_gib"], 2),
                             "attention ms": round(r.get("gpu_ms_attention", 0.0), 1),
                             "exposed NCCL ms": round(r["exposed_comm_ms"], 1)} for r in sw],
                           headers="keys", tablefmt="github"), ""]
    traced = [r for r in (funf, ffol) if r and r.get("top_other_kernels")]
    if traced:
        lines += ["Where the rest of a step goes (one traced step per row, rank 0):", ""]
        for r in traced:
            lines += where_time_goes(r)
        lines.append("")
    if CKPT_JSON.exists():
        old = json.loads(CKPT_JSON.read_text())
        ck = ckpt_table(old)
        if ck.strip():
            lines += ["Checkpoint save / load (`dp_reshardable`, torch_dist, local disk) against `torch.save` / "
                      "`torch.load` of the same tensors, measured before issue 15 by "
                      f"`{old['command']}` (kept in docs/gpu_ckpt_results.json; this issue changed no checkpoint "
                      "code, and the run above skipped `--ckpt` to save device time):", "", ck, ""]
    if png is not None:
        lines += [f"![folded vs unfolded, fused, sweep]({png.name})", ""]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json_file")
    ap.add_argument("--png", default=None)
    ap.add_argument("--baseline", default=None,
                    help="bench_gpu.py JSON of the code before issue 15, run on the same machine in the same session")
    ap.add_argument("--write-docs", action="store_true")
    args = ap.parse_args()
    res = json.loads(Path(args.json_file).read_text())
    if args.baseline:
        base = json.loads(Path(args.baseline).read_text())
        res["baseline_peak"] = base["peak_bf16_tflops"]
        res["baseline_rows"] = [{**r, "config": f"before #15: {r['config']}", "fused": "none",
                                 "hidden": base["model"]["hidden"], "layers": base["model"]["num_layers"],
                                 "seq": base["model"]["seq_length"]} for r in base["rows"]]
    png = Path(args.png) if args.png else None
    if png is not None:
        plot(res, png)
    text = section(res, png)
    print(text)
    if args.write_docs:
        doc = Path(__file__).resolve().parent.parent / "docs" / "performance.md"
        old = doc.read_text() if doc.exists() else "# Performance\n\n"
        pattern = re.compile(re.escape(SECTION) + r".*?(?=\n## |\Z)", re.S)
        new = pattern.sub(lambda _: text.rstrip() + "\n", old) if SECTION in old else old.rstrip() + "\n\n" + text
        doc.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
