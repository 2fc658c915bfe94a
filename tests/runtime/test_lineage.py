"""Lineage end to end: real 2-rank gloo runs save, resume and go wrong for real, and ``ckpt log`` reads them.

Each failure the issue names is produced by the runtime itself (a fault hook where the bug lived, or
what a person does to a folder), never by editing a manifest: the async save that writes its first
save's state again (``GTP_FAULT_INJECT=stale_staging``), the resume that drops the optimizer state
(``drop_optimizer_load``), a second run saving into the same folder, an iteration copied under a later
name with the marker moved. A healthy run with ``--lr 0`` (weights unchanged on purpose) stays clean.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import launcher_cases as lc
import pytest
from cli_helpers import cli

REPO = Path(__file__).resolve().parents[2]
MODEL = ["--nproc-per-node", "2", "--cp", "2", "--fold-cp", "--device", "cpu", "--hidden", "32", "--ffn-hidden", "64",
         "--num-layers", "1", "--seq-length", "16", "--vocab-size", "128"]


def train(*argv: str, **env: str) -> subprocess.CompletedProcess[str]:
    e = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
         "OMP_NUM_THREADS": "1", **env}
    e.pop("GTP_FAULT_INJECT", None) if "GTP_FAULT_INJECT" not in env else None
    p = subprocess.run([sys.executable, "-m", "gtp_runtime.train", *MODEL, *argv], cwd=REPO, env=e,
                       capture_output=True, text=True, timeout=600)
    return p


def log(run: Path | str) -> tuple[int, dict]:
    r = cli("log", str(run), "--format", "json")
    assert r.exit_code in (0, 1), (r.exit_code, r.stdout[-2000:], r.stderr[-2000:])
    return r.exit_code, json.loads(r.stdout)


def by_folder(doc: dict) -> dict[str, dict]:
    return {e["folder"]: e for e in doc["iterations"]}


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> Path:
    """Run A: 4 steps saving every 2, then resumed from its latest into the same folder up to 8."""
    run = tmp_path_factory.mktemp("lineage") / "a"
    p = train("--steps", "4", "--save", str(run), "--save-interval", "2")
    assert p.returncode == 0, p.stderr[-3000:]
    p = train("--steps", "8", "--load", str(run), "--save", str(run), "--save-interval", "2")
    assert p.returncode == 0, p.stderr[-3000:]
    return run


def test_clean_run_logs_clean_with_parents_chained(clean):
    code, doc = log(clean)
    assert code == 0, doc
    it = by_folder(doc)
    assert list(it) == ["iter_0000002", "iter_0000004", "iter_0000006", "iter_0000008"]
    runs = {e["run_id"] for e in doc["iterations"]}
    assert len(runs) == 1 and None not in runs, "the run id is carried through --load"
    assert it["iter_0000002"]["parent"] is None and it["iter_0000004"]["parent"] is None
    for later in ("iter_0000006", "iter_0000008"):
        p = it[later]["parent"]
        assert p == {"run_id": it["iter_0000004"]["run_id"], "root_hash": it["iter_0000004"]["root_hash"],
                     "iteration": 4, "via": "load"}
    assert all(e["problems"] == [] for e in doc["iterations"])
    assert it["iter_0000006"]["changed"] == {"weights": "changed", "masters": "changed", "moments": "changed",
                                             "step": "changed", "rng": "n/a", "data": "changed"}
    assert len({e["root_hash"] for e in doc["iterations"]}) == 4
    table = cli("log", str(clean))
    assert table.exit_code == 0 and "no problems" in table.stdout
    # inspect shows the same identity, table and JSON
    ins = cli("inspect", str(clean / "iter_0000006"), "--format", "json")
    lin = json.loads(ins.stdout)["lineage"]
    assert lin["root_hash"] == it["iter_0000006"]["root_hash"] and lin["parent"]["via"] == "load"
    assert "root hash" in cli("inspect", str(clean)).stdout


def test_log_reads_no_tensor_data(clean, monkeypatch):
    """Every byte read from a data file is counted (os-level reads by the files they came from): none."""
    import gtp_format.reader.storage as storage

    data = {p.name for p in clean.rglob("*.distcp")}
    opened: dict[int, str] = {}
    read = {"data": 0, "other": 0}
    real_open, real_pread, real_read = os.open, os.pread, os.read

    def counting_open(path, flags, *a, **k):  # noqa: ANN001, ANN202
        fd = real_open(path, flags, *a, **k)
        opened[fd] = os.path.basename(os.fsdecode(path))
        return fd

    def tally(fd: int, n: int) -> None:
        read["data" if opened.get(fd) in data else "other"] += n

    def counting_pread(fd, n, off):  # noqa: ANN001, ANN202
        out = real_pread(fd, n, off)
        tally(fd, len(out))
        return out

    def counting_read(fd, n):  # noqa: ANN001, ANN202
        out = real_read(fd, n)
        tally(fd, len(out))
        return out

    monkeypatch.setattr(os, "open", counting_open)
    monkeypatch.setattr(os, "pread", counting_pread)
    monkeypatch.setattr(os, "read", counting_read)
    import builtins

    real_builtin_open = builtins.open

    def guarded(file, mode="r", *a, **k):  # noqa: ANN001, ANN202
        assert not (isinstance(file, (str, os.PathLike)) and os.path.basename(os.fsdecode(file)) in data), file
        return real_builtin_open(file, mode, *a, **k)

    monkeypatch.setattr(builtins, "open", guarded)
    assert storage is not None
    code, _ = log(clean)
    assert code == 0
    assert read["data"] == 0, read
    assert read["other"] > 0, "the counter sees the side files read"


def test_async_saves_log_clean(tmp_path):
    run = tmp_path / "async"
    p = train("--steps", "6", "--save", str(run), "--save-interval", "2", "--async-save")
    assert p.returncode == 0, p.stderr[-3000:]
    code, doc = log(run)
    assert code == 0, doc
    assert len({e["root_hash"] for e in doc["iterations"]}) == 3


def test_stale_async_save_is_named(tmp_path):
    """Megatron's async bug reproduced: every save after the first writes the first save's staged state."""
    run = tmp_path / "stale"
    p = train("--steps", "6", "--save", str(run), "--save-interval", "2", "--async-save",
              GTP_FAULT_INJECT="stale_staging")
    assert p.returncode == 0, p.stderr[-3000:]
    code, doc = log(run)
    assert code == 1
    it = by_folder(doc)
    assert it["iter_0000002"]["problems"] == []
    assert "stale save" in it["iter_0000004"]["problems"][0] and "iter_0000002" in it["iter_0000004"]["problems"][0]
    table = cli("log", str(run))
    assert table.exit_code == 1 and "stale save" in table.stdout


def test_lr_zero_is_not_stale(tmp_path):
    run = tmp_path / "lr0"
    p = train("--steps", "4", "--save", str(run), "--save-interval", "2", "--lr", "0", "--weight-decay", "0")
    assert p.returncode == 0, p.stderr[-3000:]
    code, doc = log(run)
    assert code == 0, doc
    ch = by_folder(doc)["iter_0000004"]["changed"]
    assert ch["weights"] == "unchanged" and ch["masters"] == "unchanged" and ch["moments"] == "changed", ch


def test_copied_iteration_with_marker_moved(clean, tmp_path):
    run = tmp_path / "copied"
    shutil.copytree(clean, run)
    shutil.copytree(run / "iter_0000008", run / "iter_0000010")
    (run / "latest_checkpointed_iteration.txt").write_text("10\n")
    code, doc = log(run)
    assert code == 1
    probs = by_folder(doc)["iter_0000010"]["problems"]
    assert any("records iteration 8 but its folder name says 10" in p for p in probs), probs
    r = cli("log", str(run))
    assert r.exit_code == 1 and "iter_0000010" in r.stdout


def test_marker_naming_an_older_iteration(clean, tmp_path):
    run = tmp_path / "marker"
    shutil.copytree(clean, run)
    (run / "latest_checkpointed_iteration.txt").write_text("4\n")
    code, doc = log(run)
    assert code == 1 and "names iteration 4" in doc["problems"][0] and "newest complete iteration is 8" in \
        doc["problems"][0]
    # --load: newer iterations of the same run, clean, are what a save stopped before its marker leaves
    # (tests/runtime/test_checkpoint.py resumes from the marker then): a note, not a refusal
    from gtp_format.check.lineage import resume_check

    refusal, note = resume_check(run, "iter_0000004", str(run))
    assert refusal is None and "same run" in note and "resuming from iteration 4" in note


def test_second_run_in_the_same_folder(clean, tmp_path):
    run = tmp_path / "reused"
    shutil.copytree(clean, run)
    p = train("--steps", "2", "--save", str(run))  # a fresh run: no --load
    assert p.returncode == 0, p.stderr[-3000:]
    code, doc = log(run)
    assert code == 1
    probs = by_folder(doc)["iter_0000004"]["problems"]
    assert any("another run's iteration mixed into this folder" in p for p in probs), probs
    assert "newest complete iteration is 8" in doc["problems"][0]
    # the runtime refuses to resume from it, naming the reason and the command; the flag overrides
    p = train("--steps", "10", "--load", str(run))
    assert p.returncode == 2, p.stdout[-2000:] + p.stderr[-2000:]
    assert "refusing to resume" in p.stderr and f"ckpt log {run}" in p.stderr and "--no-check-lineage" in p.stderr
    assert p.stderr.strip().count("\n") == 0, p.stderr
    p = train("--steps", "3", "--load", str(run), *lc.LINEAGE_OVERRIDE)
    assert p.returncode == 0, p.stderr[-3000:]


def test_resume_that_drops_optimizer_state(clean, tmp_path):
    run = tmp_path / "dropped"
    run.mkdir()
    for it in ("iter_0000002", "iter_0000004"):
        shutil.copytree(clean / it, run / it)
    (run / "latest_checkpointed_iteration.txt").write_text("4\n")
    p = train("--steps", "6", "--load", str(run), "--save", str(run), GTP_FAULT_INJECT="drop_optimizer_load")
    assert p.returncode == 0, p.stderr[-3000:]
    code, doc = log(run)
    assert code == 1
    probs = by_folder(doc)["iter_0000006"]["problems"]
    assert any("step counter went back from 4 to 2" in p and "optimizer state restarted" in p for p in probs), probs
    p = train("--steps", "8", "--load", str(run))
    assert p.returncode == 2 and "optimizer state restarted" in p.stderr, p.stderr[-2000:]


def test_conversions_name_their_source(clean, tmp_path):
    """reshard, export and import: the output's parent is the source (its run id kept), and the attestation
    beside it gives source and target root hashes; ``inspect`` and ``ckpt log`` show it."""
    _, doc = log(clean)
    src = by_folder(doc)["iter_0000008"]
    r = cli("reshard", str(clean), str(tmp_path / "re"), "--dp", "2", "--format", "json")
    assert r.exit_code == 0, r.stderr
    ins = json.loads(cli("inspect", str(tmp_path / "re"), "--format", "json").stdout)
    lin, att = ins["lineage"], ins["attestation"]
    assert lin["parent"] == {"run_id": src["run_id"], "root_hash": src["root_hash"], "iteration": 8, "via": "reshard"}
    assert lin["run_id"] == src["run_id"] and lin["topology"] != src["topology"]
    assert att["source"]["root_hash"] == src["root_hash"] and att["target"]["root_hash"] == lin["root_hash"]
    assert att["command"].startswith("ckpt reshard") and att["tensors"] > 0
    code, redoc = log(tmp_path / "re")
    assert code == 0 and redoc["iterations"][0]["attestation"]["command"].startswith("ckpt reshard")
    assert "attestation" in cli("inspect", str(tmp_path / "re")).stdout
    r = cli("export", str(clean), str(tmp_path / "hf"), "--to", "hf", "--format", "json")
    assert r.exit_code == 0, r.stderr
    exported = json.loads((tmp_path / "hf" / "gtp_attestation.json").read_text())
    assert exported["source"]["root_hash"] == src["root_hash"] and exported["command"] == "ckpt export --to hf"
    r = cli("import", str(tmp_path / "hf"), str(tmp_path / "imp"), "--from", "hf", "--cp", "2", "--fold-cp",
            "--format", "json")
    assert r.exit_code == 0, r.stderr
    lin = json.loads(cli("inspect", str(tmp_path / "imp"), "--format", "json").stdout)["lineage"]
    assert lin["run_id"] == src["run_id"] and lin["parent"]["via"] == "import" and lin["parent"]["iteration"] == 8
