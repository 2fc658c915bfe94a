"""The CPU-side pieces of the benchmarks that CI cannot run whole, checked without their hardware.

Why apart from test_smoke.py: these call a benchmark's functions in-process (interval arithmetic of
the exposed-communication measure against brute force, the FLOP count, ``report_gpu.py`` on numbers in
its JSON layout, the megatron report from a saved result, ``docs_section.py``), where test_smoke.py
runs every script whole in a subprocess.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import sys
from pathlib import Path
from types import ModuleType

import pytest
from bench_run import BENCH, MEGATRON_PY, REPO
from bench_run import explain as _explain
from bench_run import run as _run
from bench_run import table as _table


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name.removesuffix(".py"), BENCH / name)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(BENCH))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCH))
    return module


def test_gpu_exposed_communication_arithmetic_against_brute_force():
    """bench_gpu's interval union/intersection (exposed NCCL time) against a per-nanosecond count."""
    g = _load("bench_gpu.py")
    rnd = random.Random(0)
    for _ in range(200):
        comm = [(s, s + rnd.randint(0, 30)) for s in (rnd.randint(0, 200) for _ in range(rnd.randint(0, 8)))]
        comp = [(s, s + rnd.randint(0, 30)) for s in (rnd.randint(0, 200) for _ in range(rnd.randint(0, 8)))]
        cu, pu = g._union(comm), g._union(comp)
        in_comm = {t for s, e in comm for t in range(s, e)}
        in_comp = {t for s, e in comp for t in range(s, e)}
        assert g._length(cu) == len(in_comm)
        assert g._intersect(cu, pu) == len(in_comm & in_comp)
    assert [g.kernel_kind(n) for n in ("ncclDevKernel_AllGather", "flash_fwd_kernel", "sm90_xmma_gemm", "add")] == \
        ["comm", "attention", "gemm", "other"]


def _synthetic_trace(rnd: random.Random) -> tuple[list[dict], set[int], set[int], set[int]]:
    """Random kernels on a compute and a NCCL stream, each with a host launch no later than its start;
    and, per microsecond, where NCCL ran, where compute ran, and where compute was held back."""
    events: list[dict] = []
    comm_t: set[int] = set()
    comp_t: set[int] = set()
    for i in range(rnd.randint(0, 12)):
        s, d = rnd.randint(0, 300), rnd.randint(1, 40)
        nccl = rnd.random() < 0.4
        launch = s - rnd.randint(0, 60)
        events.append({"cat": "kernel", "name": "ncclDevKernel_AllGather" if nccl else "gemm", "ts": float(s),
                       "dur": float(d), "args": {"correlation": i}})
        events.append({"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": float(launch), "dur": 0.0,
                       "args": {"correlation": i}})
        (comm_t if nccl else comp_t).update(range(s, s + d))
    held: set[int] = set()
    launch_of = {e["args"]["correlation"]: e["ts"] for e in events if e["cat"] == "cuda_runtime"}
    comp = [(e["ts"], launch_of[e["args"]["correlation"]]) for e in events
            if e["cat"] == "kernel" and e["name"] == "gemm"]
    for t in range(-100, 400):  # held: between compute kernels, and a next one was launched by t
        nxt = [s for s, _ in comp if s > t]
        if t not in comp_t and nxt and any(s <= t for s, _ in comp) and \
                min(launch for s, launch in comp if s == min(nxt)) <= t:
            held.add(t)
    return events, comm_t, comp_t, held


def test_trace_exposed_against_brute_force():
    """trace_exposed.py's two measures against a per-microsecond count on random traces: NCCL time
    with no compute beside it, and the part of it in which the compute stream held a launched kernel."""
    tx = _load("trace_exposed.py")
    rnd = random.Random(1)
    for _ in range(300):
        events, comm_t, comp_t, held = _synthetic_trace(rnd)
        out = tx.analyse(events, min_ms=0.0)
        assert out["comm_alone_ms"] == round(len(comm_t - comp_t) / 1e3, 3)
        assert out["comm_wait_ms"] == round(len(comm_t & held) / 1e3, 3)


def test_gpu_flop_count_by_hand():
    from gtp_format.layout.config import ModelConfig

    g = _load("bench_gpu.py")
    cfg = ModelConfig(vocab_size=100, hidden=8, num_layers=2, num_heads=2, ffn_hidden=32, seq_length=16)
    params = 2 * (4 * 8 * 8 + 2 * 8 * 32) + 100 * 8
    assert g.model_flops_per_step(cfg, 64) == 6 * params * 64 + 6 * 2 * 8 * 16 * 64


GPU_RESULT = {  # the layout bench_gpu.py writes, with made-up numbers
    "peak_bf16_tflops": 800.0, "world": 2, "micro_batch": 1, "gpu": "synthetic", "torch": "0", "command": "x",
    "model": {"hidden": 64, "num_layers": 1, "num_heads": 4, "ffn_hidden": 256, "seq_length": 256, "vocab_size": 256},
    "rows": [
        {"config": name, "step_ms": ms, "tokens_per_s": 1e5, "mfu": 0.3, "peak_mem_gib": 2.0, "dense_wgrad_gib": dense,
         "comm_ms": 3.0, "exposed_comm_ms": 1.0, "final_loss": 5.0, "gpu_ms_gemm": 5.0, "gpu_ms_other": 2.0,
         "ckpt_gb": 1.0, "save_gbps": 1.0, "load_gbps": 2.0, "torch_save_gbps": 1.1, "torch_load_gbps": 2.2}
        for name, ms, dense in (("unfolded", 10.0, 0.5), ("folded", 10.5, 0.25),
                                ("folded, no prefetch/overlap", 12.0, 0.25))],
}


def test_report_gpu_on_the_recorded_results(tmp_path: Path):
    """The report runs on the results the GPU benchmark really wrote (docs/gpu_results.json), so a change
    to the row format on either side fails here, not on the next GPU run."""
    recorded = json.loads((REPO / "docs" / "gpu_results.json").read_text())
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps(recorded))
    p = _run([str(BENCH / "report_gpu.py"), str(path)])
    assert p.returncode == 0, _explain(p)
    head, *rows = _table(p.stdout)
    n = len(recorded["rows"])
    assert head[0] == "config" and [r[0] for r in rows[:n]] == [r["config"] for r in recorded["rows"]]
    assert "MFU" in head


def test_report_gpu_plot(tmp_path: Path):
    pytest.importorskip("matplotlib", reason="the plot needs matplotlib, not a project dependency")
    p = _run([str(BENCH / "report_gpu.py"), str(REPO / "docs" / "gpu_results.json"), "--png", str(tmp_path / "p.png")])
    assert p.returncode == 0 and (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG", _explain(p)


def test_megatron_report_from_saved_result(tmp_path: Path):
    """The report half of bench_megatron_save.py (the run half needs megatron-core)."""
    m = _load("bench_megatron_save.py")
    per_rank = {"mg_save_s": 2.0, "torch_save_s": 1.0, "mg_load_s": 1.5, "torch_load_s": 0.5,
                "mg_state_dict_s": 0.2, "mg_load_state_dict_s": 0.3, "local_bytes": 10**8, "peak_rss_mib": 900.0}
    raw = {"per_rank": [per_rank, per_rank], "mg_bytes": 2 * 10**8, "torch_bytes": 2 * 10**8, "n_params": 10**7,
           "megatron_core_version": "0.0", "torch_version": "0", "python_version": "3", "mg_files": []}
    try:
        summary = m.summarize(raw)
    except KeyError as e:  # the fields summarize() reads are the contract with worker(): name what is missing
        pytest.fail(f"bench_megatron_save.summarize needs {e} in the raw result")
    config = {"layers": 1, "hidden": 64, "ffn": 256, "heads": 4, "vocab": 256, "seq": 16, "threads": 1}
    saved = tmp_path / "mg.json"
    saved.write_text(json.dumps({"summary": summary, "raw": raw, "config": config, "command": "x"}))
    p = _run([str(BENCH / "bench_megatron_save.py"), "--from-json", str(saved)])
    assert p.returncode == 0, _explain(p)
    assert "save" in p.stdout and "load" in p.stdout and str(summary["save_ratio"]) in p.stdout
    import argparse

    body = m.docs_body(summary, raw, argparse.Namespace(**config), "x")
    assert "```" in body and str(summary["load_ratio"]) in body


@pytest.mark.skipif(not MEGATRON_PY.exists(), reason="needs the megatron venv (fixtures/megatron/setup_venv.sh)")
def test_megatron_tiny_run(tmp_path: Path):
    out = Path("/tmp") / f"bench_megatron_smoke_{os.getpid()}"
    p = _run([str(BENCH / "bench_megatron_save.py"), "--smoke", "--out-dir", str(out), "--json",
              str(tmp_path / "mg.json")], python=str(MEGATRON_PY))
    assert p.returncode == 0, _explain(p)
    assert json.loads((tmp_path / "mg.json").read_text())["summary"]["save_ratio"] > 0


def test_docs_section_replaces_one_section(tmp_path: Path):
    d = _load("docs_section.py")
    write_section, write_report = d.write_section, d.write_report
    doc = tmp_path / "perf.md"
    write_section("A", "first", doc)  # a missing document starts with its title
    write_section("B", "second", doc)
    write_section("A", "again", doc)  # replaced in place, B kept after it
    assert doc.read_text() == "# Performance\n\n## A\n\nagain\n\n## B\n\nsecond\n"
    write_report("B", "intro", "cmd --x", "| t |", ["- note"], doc)
    assert doc.read_text().endswith("## B\n\nintro\n\n```\ncmd --x\n```\n\n| t |\n\n- note\n")
