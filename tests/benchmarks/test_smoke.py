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
checked in test_bench_units.py; the real tiny run is a ``gpu`` test. ``bench_megatron_save.py`` needs the megatron
venv (fixtures/megatron/setup_venv.sh); its report path runs from a saved result everywhere.
"""

from __future__ import annotations

import json
import re
import subprocess
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
from bench_run import BENCH
from bench_run import explain as _explain
from bench_run import last_json as _last_json
from bench_run import run as _run
from bench_run import table as _table

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
    "bench_hf_megatron.py": ["--workdir", "{tmp}/hf_megatron"],
    "bench_muon.py": [],
    "bench_data_read.py": ["--dir", "{tmp}/data_read"],
    "convergence.py": ["--out", "{tmp}/convergence"],
    "bench_record_crc.py": ["--workdir", "{tmp}/record_crc"],
    "disk_ceiling.py": ["--workdir", "{tmp}/disk_ceiling", "--out", "{tmp}/disk_ceiling.json"],
    "fuzz_readers.py": ["--out", "{tmp}/fuzz"],
    "bench_s3.py": [],
    "bench_s3_ckpt.py": ["--server-process"],  # the in-thread server is what tests/s3 use
    "ckpt_io_stages.py": ["--dir", "{tmp}"],
    "bench_sink.py": [],
    "bench_cli_scale.py": ["--workdir", "{tmp}/cli_scale", "--out", "{tmp}/cli_scale_out"],
    "bench_dist_ckpt.py": ["--workdir", "{tmp}/dist_ckpt", "--out", "{tmp}/dist_ckpt_out"],
    "cli_stages.py": ["--workdir", "{tmp}/cli_stages", "--out", "{tmp}/cli_stages.json"],
    "meta_stages.py": ["--workdir", "{tmp}/meta_stages"],
    "verify_data_stages.py": ["--out", "{tmp}/verify_data_stages.json"],
    "copy_cpu_stages.py": ["--workdir", "{tmp}/copy_cpu_stages", "--out", "{tmp}/copy_cpu_stages.json"],
    "copy_cpu_ab.py": ["--workdir", "{tmp}/copy_cpu_ab", "--out", "{tmp}/copy_cpu_ab.json"],
    "bench_launch.py": [],
}
# Not run with --smoke by the test above; each has its own test below.
# save_stages.py is bench_save_integrity.py's timers: its stage table is checked in check_save_integrity.
OTHERS = {"bench_megatron_save.py", "report_gpu.py", "docs_section.py", "trace_exposed.py", "fuzz_targets.py",
          "save_stages.py", "pairs.py"}








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
    assert head[0] == "algorithm" and len(rows) == 5
    assert rows[0][0] == "crc32 (zlib)" and rows[0][2] == "1.00x"  # the baseline against itself
    assert all(float(r[1]) > 0 and float(r[3]) > 0 for r in rows)


def check_chunk_hash(p: subprocess.CompletedProcess[str], tmp: Path) -> None:
    head, *rows = _table(p.stdout)
    assert head[0] == "read + hash" and [r[0] for r in rows[:2]] == ["cat", "dd bs=2M"]
    assert rows[0][2] == "1.00x" and len(rows) == 5  # cat against itself, then dd and the three candidates
    assert all(float(r[1]) > 0 for r in rows) and all(float(r[3]) > 0 for r in rows[2:])


def check_save_integrity(p: subprocess.CompletedProcess[str], tmp: Path) -> None:
    head, row, vhead, vrow, shead, *rest = _table(p.stdout)  # save, verify, stages in the save, statistics passes
    assert head[:8] == ["GB", "save without s", "save with s", "added (fastest)", "added (median)",
                        "added (paired median)", "added (paired mean ± se)", "95% bound"]
    assert len(row) == len(head) == 13 and "sink xxh3 from memory s" in head
    assert float(row[0]) > 0 and all(float(v) >= 0 for v in row[8:]) and all(c.endswith("%") for c in row[3:6])
    assert vhead[0] == "cat GB/s" and len(vrow) == len(vhead) == 5 and all(float(v.rstrip("x")) > 0 for v in vrow)
    assert shead == ["stage (rank 0, CPU s per save)", "without records", "with records", "added"]
    stages = {r[0]: r for r in rest if len(r) == 4}
    assert stages["whole rank (median)"][1] != "0" and float(stages["whole rank (median)"][2]) > 0
    assert {"sink xxh3-128", "statistics (in the sink)", "sink crc32c"} <= stages.keys()
    assert stages["sink xxh3-128"][1] == "0" and stages["statistics (in the sink)"][1] == "0"  # none without records
    passes = [r for r in rest if len(r) == 2]
    assert passes[0] == ["statistics pass (rank 0, alone)", "CPU s"] and len(passes) == 8


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


def check_launch(p: subprocess.CompletedProcess[str], tmp: Path) -> None:
    head, *rows = _table(p.stdout)
    assert head[0] == "run" and [r[0] for r in rows] == ["no save", "save"], rows
    assert all(float(c) > 0 for r in rows for c in r[1:5]) and all(_ratio(r[5]) > 0 for r in rows), rows


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


def check_hf_megatron(p: subprocess.CompletedProcess[str], tmp: Path) -> None:
    """Both commands and both copies ran once, with a ratio against ``cp -r`` of the megatron-core
    checkpoint and the commands' own peak RSS; the synthetic folders are removed."""
    head, *rows = _table(p.stdout)
    assert [r[0] for r in rows] == ["cp -r MC", "cp -r HF", "import hf -> megatron-core",
                                    "export megatron-core -> hf"]
    assert all(_ratio(r[head.index("vs cp -r MC (medians)")]) > 0 for r in rows)
    assert all(int(r[head.index("peak RSS MiB")]) > 0 for r in rows[2:])
    doc = json.loads(p.stdout.strip().splitlines()[-1])
    assert doc["gb_mc"] > doc["gb_hf"] > 0 and all(len(t) == 1 for t in doc["times"].values())
    assert not (tmp / "hf_megatron").exists()


def check_s3(p: subprocess.CompletedProcess[str], tmp: Path) -> None:
    """Every client ran every workload (each run checks sizes itself), with a ratio against boto3's."""
    rows = _table(p.stdout)
    assert rows[0][:2] == ["workload", "client"]
    got = {(r[0], r[1]): _ratio(r[4]) for r in rows[1:]}
    assert set(got) == {(w, c) for w in ("write", "read whole", "ranged read") for c in ("boto3", "s3fs", "obstore")}
    assert all(got[(w, "boto3")] == 1.0 for w in ("write", "read whole", "ranged read"))
    assert all(v > 0 for v in got.values())


def check_s3_ckpt(p: subprocess.CompletedProcess[str], tmp: Path) -> None:
    """The five workloads against their boto3 baselines (each run checks its own exit code), with the
    requests each read sent (counted from obstore's calls: at least one GET, none larger than the cap)."""
    rows = _table(p.stdout)
    assert [r[0] for r in rows[1:]] == ["upload (save's commit)", "verify --data", "export --to hf",
                                        "export --to torch", "reshard --dp 1"]
    assert all(_ratio(r[3]) > 0 for r in rows[1:])
    for r in rows[2:]:
        gets, each = re.match(r"(\d+) GET \(([\d.]+) MB each\)", r[5]).groups()
        assert int(gets) >= 1 and 0 < float(each) <= 64 * 1.048576
    assert '"ok"' not in p.stdout  # the commands' own output is not mixed into the report
    moto = re.search(r"a 64 KiB ranged GET takes ([\d.]+) ms, the whole object ([\d.]+) ms", p.stdout)
    assert moto and 0 < float(moto.group(1)) and 0 < float(moto.group(2))  # the server's own cost per request


def check_io_stages(p: subprocess.CompletedProcess[str], tmp: Path) -> None:
    """Every stage ran and reported a positive rate; nothing is left in the working folder."""
    doc = json.loads(p.stdout.strip().splitlines()[-1])
    stages = {r["stage"] for r in doc["rows"]}
    assert {"dd direct write", "sink O_DIRECT + crc32c + xxh3", "torch.save to null",
            "write_rank_files from pinned, integrity True", "dcp.load FileSystemReader into device",
            "O_DIRECT read into pinned + H2D (per file)"} <= stages, stages
    assert all(r["gbps"] > 0 for r in doc["rows"])
    assert not list(tmp.glob("io_stages_*"))


def check_sink(p: subprocess.CompletedProcess[str], tmp: Path) -> None:
    head, *rows = _table(p.stdout)
    assert head[0] == "what" and [r[0] for r in rows[:2]] == ["sink, no chunk records", "sink, chunk records"]
    assert rows[0][3] == "+0.0%" and len(rows) == 4 and all(float(r[1]) > 0 for r in rows)


def check_dist_ckpt(p: subprocess.CompletedProcess[str], tmp: Path) -> None:
    doc = json.loads((tmp / "dist_ckpt_out" / "bench_dist_ckpt.json").read_text())
    assert [r["row"] for r in doc["rows"]] == ["reshard_2_ranks_vs_1", "verify_data_2_ranks_vs_1"]
    assert all(r["ratio"] > 0 and "torchrun" in r["command"] for r in doc["rows"]) and doc["smoke"]
    assert not (tmp / "dist_ckpt").exists()


def check_cli_scale(p: subprocess.CompletedProcess[str], tmp: Path) -> None:
    doc = json.loads((tmp / "cli_scale_out" / "cli_scale_results.json").read_text())
    assert [r["row"] for r in doc["rows"]] == ["verify_data_warm_vs_cat", "reshard_vs_cp", "export_hf_vs_cp",
                                               "inspect_1m_vs_torch", "inspect_1m_rss_vs_torch",
                                               "verify_meta_1m_vs_torch"]
    assert doc["notes"] == ["verify_data_cold_vs_cat skipped: --smoke never drops the page cache"]
    assert all(r["ratio"] > 0 and r["command"] and r["machine"]["nproc"] >= 1 for r in doc["rows"])
    assert doc["rows"][-1]["verify_ok"] and not (tmp / "cli_scale").exists()


def check_disk_ceiling(p: subprocess.CompletedProcess[str], tmp: Path) -> None:
    doc = json.loads((tmp / "disk_ceiling.json").read_text())
    rows = doc["write_gbps"]
    assert {"dd_direct_64M_x1", "dd_direct_64M_x16", "dd_buffered_fsync_64M_x8", "buffered_sync_file_range_x8"} \
        <= rows.keys() and all(v is None or v > 0 for v in rows.values())
    assert doc["copies"]["bytes"] == 16 << 20 and doc["copies"]["cp_r_gbps"] > 0
    reads = doc["cold_read_gbps"]  # None: a file system that refuses O_DIRECT (tmpfs)
    assert {"direct_8M_depth4", "buffered_cat_1x128K", "buffered_willneed_16x_8M_in_2M"} <= reads.keys()
    assert reads["buffered_cat_1x128K"] > 0 and all(v is None or v > 0 for v in reads.values())
    assert isinstance(doc["copies"]["ficlone"], str) and doc["fs"]  # "ok" or the errno the file system gave
    assert not (tmp / "disk_ceiling" / "cp").exists() and not (tmp / "disk_ceiling" / "dd").exists()


def check_cli_stages(p: subprocess.CompletedProcess[str], tmp: Path) -> None:
    doc = json.loads((tmp / "cli_stages.json").read_text())
    assert doc["rc"] == 0 and doc["argv"][0] == "inspect" and doc["wall_s"] > 0 and doc["ticks"] > 0


def check_copy_cpu_stages(p: subprocess.CompletedProcess[str], tmp: Path) -> None:
    doc = json.loads((tmp / "copy_cpu_stages.json").read_text())
    assert doc["rc"] == 0 and doc["argv"][0] == "reshard" and doc["gb"] > 0 and doc["cpu_s"] > 0
    stages = doc["stages_cpu_s"]
    assert stages["read ledger CRC-32C of the bytes read"] >= 0 and stages["chunk statistics (numba)"] > 0
    assert abs(sum(stages.values()) - doc["cpu_s"]) < 0.01  # the stages and the rest add up to the process's CPU
    assert not (tmp / "copy_cpu_stages").exists()


def check_copy_cpu_ab(p: subprocess.CompletedProcess[str], tmp: Path) -> None:
    doc = json.loads((tmp / "copy_cpu_ab.json").read_text())
    got = {(r["tree"], r["cmd"]) for r in doc["results"] if "error" not in r}
    assert got == {("cp -r", "cp")} | {(t, c) for t in ("before", "after")
                                       for c in ("reshard", "export", "import", "verify")}, doc["results"]
    assert all(r["rc"] == 0 and r["cpu_s_per_gb"] > 0 for r in doc["results"] if r["cmd"] != "cp")
    assert not (tmp / "copy_cpu_ab").exists()


def check_meta_stages(p: subprocess.CompletedProcess[str], tmp: Path) -> None:
    doc = json.loads(p.stdout[p.stdout.index("{"):])
    assert doc["chunks"] == 2000 and doc["compiled walk passes"] is False  # under its size threshold
    assert all(doc[k]["cpu_s"] >= 0 for k in ("read", "check_shape (Python)", "model (_entries)"))


def check_verify_data_stages(p: subprocess.CompletedProcess[str], tmp: Path) -> None:
    doc = json.loads((tmp / "verify_data_stages.json").read_text())
    assert {"pread into a new bytes", "preadv into a reused buffer", "zlib CRC-32 (zip record)",
            "pass before pieces: preadv + zlib + scan",
            "pass now: hashing.crc32, 512 KiB pieces"} <= doc["stages"].keys()
    assert doc["crc32"] in ("zlib-ng", "libdeflate", "zlib")
    assert all(r["gbps"] > 0 and r["cpu_s_per_gb"] >= 0 for by in doc["stages"].values() for r in by.values())


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
    "bench_hf_megatron.py": check_hf_megatron,
    "bench_megatron_inspect.py": check_megatron_inspect,
    "bench_verify_cold.py": check_verify_cold,
    "bench_s3.py": check_s3,
    "bench_s3_ckpt.py": check_s3_ckpt,
    "ckpt_io_stages.py": check_io_stages,
    "bench_sink.py": check_sink,
    "bench_cli_scale.py": check_cli_scale, "cli_stages.py": check_cli_stages, "meta_stages.py": check_meta_stages,
    "bench_dist_ckpt.py": check_dist_ckpt, "verify_data_stages.py": check_verify_data_stages,
    "copy_cpu_stages.py": check_copy_cpu_stages, "copy_cpu_ab.py": check_copy_cpu_ab,
    "disk_ceiling.py": check_disk_ceiling, "bench_launch.py": check_launch,
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
