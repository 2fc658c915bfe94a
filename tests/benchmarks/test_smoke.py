"""Every script in benchmarks/ runs at a tiny size (``--smoke``) and prints its report.

Why: benchmarks run rarely, by hand, and nothing else imports them, so an API change breaks them
silently. ``bench_migrate.py`` did: the torch-free dtype change made it pass a format ``DType``
to ``torch.empty``, and nobody noticed until the next measurement. Here each one runs end to end
in a subprocess, as a user starts it, and its report is checked for the structure the docs are
built from (and for the properties a tiny run still shows, e.g. folding halves the dense bytes).

The runs are started together (a few at a time) when the first of them is needed, since most of
their time is Python and torch start-up in child processes. ``--smoke`` never writes
docs/performance.md and never drops the page cache.

What needs hardware CI lacks: ``bench_gpu.py`` needs 2 CUDA devices; without them it must refuse
in one line (exit 2), and its CPU-side pieces (interval arithmetic of the exposed-communication
measure, kernel classes, the FLOP count, ``report_gpu.py`` on numbers in its JSON layout) are
checked here; the real tiny run is a ``gpu`` test. ``bench_megatron_save.py`` needs the megatron
venv (fixtures/megatron/setup_venv.sh); its report path runs from a saved result everywhere.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import re
import subprocess
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "benchmarks"
MEGATRON_PY = REPO / "fixtures" / "megatron" / "_venv" / "bin" / "python"
TIMEOUT = 900  # seconds per run; a busy 2-core machine stretches start-up many times over
PARALLEL = 3

# Scripts run with --smoke, and the extra arguments each needs ({tmp}: this session's scratch folder).
SMOKE = {
    "bench_ckpt_cpu.py": [],
    "bench_ckpt_async.py": ["--dir", "{tmp}"],
    "bench_fold_cpu.py": [],
    "bench_hash.py": [],
    "bench_chunk_hash.py": [],
    "bench_save_integrity.py": [],
    "bench_inspect.py": ["--workdir", "{tmp}/inspect"],
    "bench_megatron_inspect.py": ["--workdir", "{tmp}/megatron_inspect"],
    "bench_migrate.py": ["--workdir", "{tmp}/migrate"],
    "bench_verify.py": ["--workdir", "{tmp}/verify", "--clean"],
    "bench_verify_cold.py": ["--workdir", "{tmp}/verify_cold"],
    "bench_gpu.py": ["--json", "{tmp}/gpu.json"],
    "bench_reshard.py": ["--workdir", "{tmp}/reshard"],
    "bench_copy_checks.py": ["--workdir", "{tmp}/copy_checks"],
    "bench_export_hf.py": ["--workdir", "{tmp}/export_hf"],
    "bench_muon.py": [],
    "bench_data_read.py": ["--dir", "{tmp}/data_read"],
    "convergence.py": ["--out", "{tmp}/convergence"],
    "bench_record_crc.py": ["--workdir", "{tmp}/record_crc"],
    "fuzz_readers.py": ["--out", "{tmp}/fuzz"],
    "bench_s3.py": [],
    "bench_s3_ckpt.py": [],
}
# Not run with --smoke by the test above; each has its own test below.
OTHERS = {"bench_megatron_save.py", "report_gpu.py", "docs_section.py", "trace_exposed.py", "fuzz_targets.py"}


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(BENCH)]), "OMP_NUM_THREADS": "1"}


def _run(argv: list[str], python: str = sys.executable) -> subprocess.CompletedProcess[str]:
    return subprocess.run([python, *argv], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=TIMEOUT)


def _explain(p: subprocess.CompletedProcess[str]) -> str:
    return f"exit {p.returncode}\n--- stdout\n{p.stdout[-3000:]}\n--- stderr\n{p.stderr[-3000:]}"


class Runs:
    """The smoke runs the selected tests need, started together on first use."""

    def __init__(self, tmp: Path, wanted: set[str]) -> None:
        self.tmp, self.wanted = tmp, wanted
        self.lock = threading.Lock()
        self.futures: dict[str, Future[subprocess.CompletedProcess[str]]] = {}
        self.pool = ThreadPoolExecutor(PARALLEL)

    def get(self, script: str) -> subprocess.CompletedProcess[str]:
        with self.lock:
            if not self.futures:
                for name in sorted(self.wanted | {script}, key=list(SMOKE).index):
                    argv = [str(BENCH / name), "--smoke", *(a.replace("{tmp}", str(self.tmp)) for a in SMOKE[name])]
                    self.futures[name] = self.pool.submit(_run, argv)
        return self.futures[script].result()


@pytest.fixture(scope="module")
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    wanted = {item.callspec.params["script"] for item in request.session.items
              if item.name.startswith("test_smoke_run[") and hasattr(item, "callspec")}
    r = Runs(tmp_path_factory.mktemp("bench_smoke"), wanted)
    yield r
    r.pool.shutdown(wait=True)


def _table(stdout: str) -> list[list[str]]:
    """The rows of the first github-style table in ``stdout`` (header first, rule dropped)."""
    lines = [ln for ln in stdout.splitlines() if ln.startswith("|")]
    rows = [[c.strip() for c in ln.strip("|").split("|")] for ln in lines if not set(ln) <= set("|-: ")]
    assert rows, stdout[-2000:]
    return rows


def _last_json(stdout: str) -> dict:
    return json.loads(next(ln for ln in reversed(stdout.splitlines()) if ln.startswith("{")))


def _ratio(cell: str) -> float:
    return float(cell.rstrip("x"))


def check_ckpt_cpu(p: subprocess.CompletedProcess[str], tmp: Path) -> None:
    head, *rows = _table(p.stdout)
    assert head[:2] == ["layout", "GB"] and "save ratio" in head and "load ratio" in head
    assert [r[0] for r in rows] == ["torch_dist", "safetensors"]
    assert all(float(r[head.index("save ratio")]) > 0 and float(r[head.index("load ratio")]) > 0 for r in rows)


def check_ckpt_async(p: subprocess.CompletedProcess[str], tmp: Path) -> None:
    (row,) = json.loads(p.stdout[p.stdout.index("["):])
    for k in ("async_blocking_s", "save_gbps", "dd_direct_write_gbps", "load_gbps", "dd_cold_read_gbps",
              "torch_load_gbps", "step_ms", "step_ms_during_write", "staging_gib", "dcp_save_gbps"):
        assert k in row, k
    assert len(row["staging_gib"]) == 2 and row["staging_gib"][0] == row["staging_gib"][1] > 0, "staging grew"
    assert row["async_blocking_s"] < row["async_durable_s"] and row["save_gbps"] > 0 and row["dcp_save_gbps"] > 0


def check_fold_cpu(p: subprocess.CompletedProcess[str], tmp: Path) -> None:
    head, *rows = _table(p.stdout)
    assert [r[2] for r in rows] == ["unfolded", "folded", "folded/unfolded"], rows
    dense = head.index("dense w+g MiB/rank")
    assert float(rows[2][dense]) == 0.5  # cp2 folding shards the dense weights and grads over 2 ranks more


def check_muon(p: subprocess.CompletedProcess[str], tmp: Path) -> None:
    head, *rows = _table(p.stdout)
    (row,) = rows
    assert row[0] == "cp2-fold" and _ratio(row[head.index("Muon / Adam")]) > 0
    # Folded over cp2 at dp 1, each Muon matrix is half on its owner: the other half crosses each
    # way once, 4 bytes per Muon param in all; measured equals counted (the script exits 1 otherwise).
    measured, counted = row[head.index("Muon bytes/step measured")], row[head.index("counted from layout")]
    assert measured == counted == "32,768" and float(row[head.index("bytes / fp32 Muon params")]) == 1.0


def check_hash(p: subprocess.CompletedProcess[str], tmp: Path) -> None:
    head, *rows = _table(p.stdout)
    assert head[0] == "algorithm" and len(rows) == 4
    assert rows[0][0] == "crc32 (zlib)" and rows[0][2] == "1.00x"  # the baseline against itself
    assert all(float(r[1]) > 0 and float(r[3]) > 0 for r in rows)


def check_chunk_hash(p: subprocess.CompletedProcess[str], tmp: Path) -> None:
    head, *rows = _table(p.stdout)
    assert head[0] == "read + hash" and [r[0] for r in rows[:2]] == ["cat", "dd bs=2M"]
    assert rows[0][2] == "1.00x" and len(rows) == 5  # cat against itself, then dd and the three candidates
    assert all(float(r[1]) > 0 for r in rows) and all(float(r[3]) > 0 for r in rows[2:])


def check_save_integrity(p: subprocess.CompletedProcess[str], tmp: Path) -> None:
    head, row, vhead, vrow = _table(p.stdout)  # the save table, then the verify table
    assert head[:5] == ["GB", "save without s", "save with s", "added (fastest)", "added (median)"]
    assert len(row) == len(head) == 10 and "sink xxh3 from memory s" in head
    assert float(row[0]) > 0 and all(float(v) >= 0 for v in row[5:]) and row[3].endswith("%") and row[4].endswith("%")
    assert vhead[0] == "cat GB/s" and len(vrow) == len(vhead) == 5 and all(float(v.rstrip("x")) > 0 for v in vrow)


def check_verify_cold(p: subprocess.CompletedProcess[str], tmp: Path) -> None:
    head, *rows = _table(p.stdout)
    assert head == ["what", "median s", "min s", "GB/s (median)", "vs cat cold"]
    assert [r[0] for r in rows] == ["cat", "verify CLI", "verify lib", "cat warm"] and rows[0][4] == "1.00x"
    assert all(float(r[1]) > 0 and _ratio(r[4]) > 0 for r in rows)


def check_inspect(p: subprocess.CompletedProcess[str], tmp: Path) -> None:
    (row,) = _last_json(p.stdout)["rows"]
    head = _table(p.stdout)[0]
    assert len(row) == len(head) == 20 and row[0] == "200"
    assert row[-1] == "0/0"  # open_checkpoint and inspect opened no data file
    assert not (tmp / "inspect").exists()  # the generated checkpoints are removed


def check_megatron_inspect(p: subprocess.CompletedProcess[str], tmp: Path) -> None:
    m = re.search(r"layers 20: 19 keys, (\d+) chunks.*\ninspect [\d.]+ s, inspect --params [\d.]+ s, ratio ([\d.]+)",
                  p.stdout)
    assert m is not None and int(m.group(1)) > 20 * 12 and float(m.group(2)) > 0, p.stdout
    assert not (tmp / "megatron_inspect").exists()  # the generated checkpoint is removed


def check_migrate(p: subprocess.CompletedProcess[str], tmp: Path) -> None:
    doc = _last_json(p.stdout)
    (row,), (phases,) = doc["rows"], doc["phases"]
    assert len(row) == 13 and len(phases) == 9
    assert int(row[2]) > 0 and int(row[3]) > 0  # cp2 folded: chunks kept and chunks lost at save
    assert all(_ratio(cell) >= 0 for cell in row[10:])  # speed-ups (a tiny run may round them to 0.0x)


def check_verify(p: subprocess.CompletedProcess[str], tmp: Path) -> None:
    doc = _last_json(p.stdout)
    (row,) = doc["rows"]
    assert doc["dropped_caches"] is False and row[2] == "warm" and len(row) == 13
    assert "within 512 MiB" in p.stdout and not (tmp / "verify").exists()


def check_gpu(p: subprocess.CompletedProcess[str], tmp: Path) -> None:
    import torch

    if torch.cuda.device_count() >= 2:
        assert p.returncode == 0, _explain(p)
        res = json.loads((tmp / "gpu.json").read_text())
        assert {"unfolded", "folded"} <= {r["config"] for r in res["rows"]}
        report = _run([str(BENCH / "report_gpu.py"), str(tmp / "gpu.json")])
        assert report.returncode == 0 and "| config" in report.stdout, _explain(report)
    else:  # no GPU run possible: one line saying why, exit 2, no traceback
        assert p.returncode == 2 and p.stderr.strip().startswith("needs 2 CUDA devices"), _explain(p)
        assert "Traceback" not in p.stderr and not (tmp / "gpu.json").exists()


def check_reshard(p: subprocess.CompletedProcess[str], tmp: Path) -> None:
    head, *rows = _table(p.stdout)
    assert [r[head.index("layers")] for r in rows] == ["1", "2"]
    assert all(float(r[head.index("reshard s")]) > 0 and float(r[head.index("export hf s")]) > 0 for r in rows)
    assert "Time against size, reshard" in p.stdout and not (tmp / "reshard").exists()


def check_data_read(p: subprocess.CompletedProcess[str], tmp: Path) -> None:
    head, *rows = _table(p.stdout)
    assert [r[0] for r in rows] == ["cat", "sequential", "shuffled"], rows
    growth, batch = head.index("RssAnon growth MiB"), head.index("one batch MiB")
    for r in rows[1:]:
        # Memory: what reading adds is the batches in flight, not the file (the smoke file is 20 MB,
        # a copy of it would be 38 MiB of int64 tokens per 10 MB read).
        assert float(r[growth]) < 16 + 4 * float(r[batch]), r
        assert float(r[head.index("seconds")]) > 0
    assert not list((tmp / "data_read").glob("*.bin"))  # the generated dataset is removed


def check_convergence(p: subprocess.CompletedProcess[str], tmp: Path) -> None:
    s = json.loads((tmp / "convergence" / "convergence.json").read_text())["summary"]
    assert s["noise_runs"] == 2 and s["noise_pairs"] == 3 and s["eval_steps"] == [2, 4]
    # Folded and the same-seed repeat take the unfolded run's data and init: on CPU in fp32 their
    # losses are the unfolded run's, step for step; the other data orders are not.
    for name in ("folded", "repeat"):
        c = s["compared"][name]
        assert c["first_step_losses_differ"] is None and c["max_valid_diff"] < 1e-6, c
    assert s["compared"]["repeat"]["control"] and min(s["noise_diff"]) > 0
    assert s["passed"] and "PASSED" in p.stdout


def check_record_crc(p: subprocess.CompletedProcess[str], tmp: Path) -> None:
    head, *rows = _table(p.stdout)
    assert head == ["pass", "s", "GB/s", "vs cat"]
    assert [r[0] for r in rows] == ["cat", "manifest (file CRC-32C)", "no manifest (record CRC-32)",
                                    "no manifest, record CRC off"]
    assert rows[0][3] == "1.00x" and all(_ratio(r[3]) > 0 for r in rows)  # a 0.2 MB fixture: GB/s may round to 0
    assert (tmp / "record_crc").is_dir() and not list((tmp / "record_crc").iterdir())  # the copy is removed


def check_fuzz(p: subprocess.CompletedProcess[str], tmp: Path) -> None:
    report = json.loads(p.stdout[p.stdout.index("{"):])
    assert set(report) >= {"pickle", "zip", "safetensors", "json", "idx", "layout"}
    for name, stats in report.items():
        assert stats["runs"] == 10 and stats["ok"] + stats["refused"] + stats["findings"] >= 10, (name, stats)
        assert stats["findings"] == 0, (name, [f.read_text()[:500] for f in (tmp / "fuzz").glob(f"{name}-*.txt")])


def check_copy_checks(p: subprocess.CompletedProcess[str], tmp: Path) -> None:
    doc = json.loads(p.stdout.splitlines()[0])
    assert [r["command"] for r in doc["rows"]] == ["reshard tp2-cp1", "export hf --optimizer",
                                                   "export hf (weights only)"]
    assert all(r["ledger s"] > 0 and r["no ledger s"] > 0 for r in doc["rows"]) and doc["cp_r_s"] > 0
    assert "| command" in p.stdout and "bench_copy_checks.py" in p.stdout
    assert not (tmp / "copy_checks").exists()  # the work folder is removed


def check_export_hf(p: subprocess.CompletedProcess[str], tmp: Path) -> None:
    head, *rows = _table(p.stdout)
    assert head[0] == "command" and [r[0] for r in rows] == ["cp -r", "export hf", "export hf --optimizer"]
    times = _last_json(p.stdout)["times"]
    assert all(len(ts) == 1 and ts[0] > 0 for ts in times.values())
    assert all(_ratio(r[head.index("vs cp -r (medians)")]) > 0 for r in rows)
    assert not (tmp / "export_hf").exists()  # the synthetic checkpoint is removed


def check_s3(p: subprocess.CompletedProcess[str], tmp: Path) -> None:
    """Every client ran every workload (each run checks sizes itself), with a ratio against boto3's."""
    rows = _table(p.stdout)
    assert rows[0][:2] == ["workload", "client"]
    got = {(r[0], r[1]): _ratio(r[4]) for r in rows[1:]}
    assert set(got) == {(w, c) for w in ("write", "read whole", "ranged read") for c in ("boto3", "s3fs", "obstore")}
    assert all(got[(w, "boto3")] == 1.0 for w in ("write", "read whole", "ranged read"))
    assert all(v > 0 for v in got.values())


def check_s3_ckpt(p: subprocess.CompletedProcess[str], tmp: Path) -> None:
    """The four workloads against their boto3 baselines (each run checks its own exit code), with the
    requests each read sent (counted from obstore's calls: at least one GET, none larger than the cap)."""
    rows = _table(p.stdout)
    assert [r[0] for r in rows[1:]] == ["upload (save's commit)", "verify --data", "export --to hf",
                                        "export --to torch"]
    assert all(_ratio(r[3]) > 0 for r in rows[1:])
    for r in rows[2:]:
        gets, each = re.match(r"(\d+) GET \(([\d.]+) MB each\)", r[5]).groups()
        assert int(gets) >= 1 and 0 < float(each) <= 64 * 1.048576
    assert '"ok"' not in p.stdout  # the commands' own output is not mixed into the report


CHECKS: dict[str, Callable[[subprocess.CompletedProcess[str], Path], None]] = {
    "bench_ckpt_cpu.py": check_ckpt_cpu, "bench_ckpt_async.py": check_ckpt_async,
    "bench_fold_cpu.py": check_fold_cpu, "bench_hash.py": check_hash,
    "bench_chunk_hash.py": check_chunk_hash,
    "bench_save_integrity.py": check_save_integrity,
    "bench_inspect.py": check_inspect, "bench_migrate.py": check_migrate, "bench_verify.py": check_verify,
    "bench_gpu.py": check_gpu, "bench_reshard.py": check_reshard, "bench_muon.py": check_muon,
    "bench_data_read.py": check_data_read, "convergence.py": check_convergence,
    "bench_record_crc.py": check_record_crc, "fuzz_readers.py": check_fuzz,
    "bench_copy_checks.py": check_copy_checks, "bench_export_hf.py": check_export_hf,
    "bench_megatron_inspect.py": check_megatron_inspect,
    "bench_verify_cold.py": check_verify_cold,
    "bench_s3.py": check_s3,
    "bench_s3_ckpt.py": check_s3_ckpt,
}


def test_every_benchmark_script_has_a_smoke_test():
    assert {p.name for p in BENCH.glob("*.py")} == SMOKE.keys() | OTHERS
    assert CHECKS.keys() == SMOKE.keys()
    for name in SMOKE:
        assert "--smoke" in (BENCH / name).read_text(), name


@pytest.mark.parametrize("script", list(SMOKE))
def test_smoke_run(runs: Runs, script: str):
    p = runs.get(script)
    if script != "bench_gpu.py":
        assert p.returncode == 0, _explain(p)
    CHECKS[script](p, runs.tmp)


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
