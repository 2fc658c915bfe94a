"""The hostile corpus against every ``ckpt`` command it targets and against ``train --load``.

For each crafted input and command: exit code 1 or 2, exactly one line on stderr and no
traceback, peak RSS of the child under 512 MB, a bounded time, no file opened outside the
checkpoint (audit hook), no code run (a canary file and process-start events), no terminal
control characters or outside secrets in the output, and the input unchanged. The corpus is
generated here (tests/hostile/make_corpus.py) and run in batches by tests/hostile/runner.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))

from hostile_bounds import DATA_SPECS  # noqa: E402
from make_corpus import SECRET, build_corpus, build_data_corpus, case_specs  # noqa: E402

MAX_RSS_MB = 512
CKPT_TIMEOUT_S = 60
LOAD_TIMEOUT_S = 120
UNSAFE = ["\x1b", "\x07", "\u202e", "\u2066", "\u2069"]


def _snapshot(root: Path) -> dict[str, str]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st = os.lstat(p)
            rel = str(p.relative_to(root))
            if stat.S_ISLNK(st.st_mode):
                out[rel] = "link:" + os.readlink(p)
            elif stat.S_ISREG(st.st_mode) and st.st_size > (1 << 20) and st.st_blocks * 512 < st.st_size // 2:
                with open(p, "rb") as f:  # sparse (up to 16 TiB of holes): its size, blocks and stored head
                    out[rel] = f"sparse:{st.st_size}:{st.st_blocks}:{hashlib.sha256(f.read(1 << 20)).hexdigest()}"
            elif stat.S_ISREG(st.st_mode):
                with open(p, "rb") as f:
                    out[rel] = f"{st.st_size}:{hashlib.file_digest(f, 'sha256').hexdigest()}"
            else:
                out[rel] = f"mode:{stat.S_IFMT(st.st_mode)}"
    return out


def _run_batch(mode: str, root: Path, cases: list, argv_for: callable, timeout: int) -> dict:
    out, cwd = root / "_out", root / "_cwd"
    out.mkdir()
    cwd.mkdir()
    jobs = []
    for c in cases:
        for i, argv in enumerate(argv_for(c)):
            jid = f"{c.name}-{i}"
            jobs.append({"id": jid, "argv": argv, "stdout": str(out / f"{jid}.out"), "stderr": str(out / f"{jid}.err"),
                         "audit": str(out / f"{jid}.audit"), "cwd": str(cwd), "corpus": str(root),
                         "allowed": str(Path(c.dir) / "run"), "timeout": timeout})
    (root / "jobs.json").write_text(json.dumps(jobs))
    before = {c.name: _snapshot(Path(c.dir)) for c in cases}
    subprocess.run([sys.executable, str(HERE / "runner.py"), mode, str(root / "jobs.json"), str(root / "results.json")],
                   cwd=REPO, check=True, timeout=len(jobs) * (timeout + 5) + 120)
    results = json.loads((root / "results.json").read_text())
    for job in jobs:
        case_name = job["id"].rsplit("-", 1)[0]
        r = results[job["id"]]
        r["stdout"] = Path(job["stdout"]).read_text(errors="surrogateescape")
        r["stderr"] = Path(job["stderr"]).read_text(errors="surrogateescape")
        r["audit"] = Path(job["audit"]).read_text() if Path(job["audit"]).exists() else ""
        r["changed"] = before[case_name] != _snapshot(Path(next(c.dir for c in cases if c.name == case_name)))
        r["argv"] = job["argv"]
    return results


@pytest.fixture(scope="session")
def ckpt_results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("hostile")
    cases = build_corpus(root, canary=root / "CANARY")
    results = _run_batch("ckpt", root, cases, lambda c: c.commands, CKPT_TIMEOUT_S)
    results["_canary"] = (root / "CANARY").exists()
    return results


@pytest.fixture(scope="session")
def load_results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("hostile-load")
    save = root / "_saved"
    subprocess.run([sys.executable, "-m", "gtp_runtime.train", "--nproc-per-node", "1", "--steps", "1", "--device",
                    "cpu", "--save", str(save)], cwd=REPO, check=True, capture_output=True, timeout=600)
    base = next(save.glob("iter_*"))
    cases = build_corpus(root, bases={"dcp": base}, canary=root / "CANARY", only_load=True)
    argv = ["--nproc-per-node", "1", "--steps", "1", "--device", "cpu", "--load"]
    results = _run_batch("train", root, cases, lambda c: [[*argv, str(Path(c.dir) / c.target)]], LOAD_TIMEOUT_S)
    results["_canary"] = (root / "CANARY").exists()
    return results


@pytest.fixture(scope="session")
def data_results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """``train --data-path`` on each crafted dataset (issue 22): one rank, in a forked child."""
    root = tmp_path_factory.mktemp("hostile-data")
    cases = build_data_corpus(root)
    argv = ["--nproc-per-node", "1", "--steps", "1", "--device", "cpu", "--data-path"]
    results = _run_batch("train", root, cases, lambda c: [[*argv, c.data_path]], LOAD_TIMEOUT_S)
    results["_canary"] = False
    return results


def _check(r: dict, prefix: str, limit: int, canary: bool) -> None:
    why = f"{r['argv']}\nexit {r['exit']} in {r['seconds']} s, {r['maxrss_mb']} MB\nstdout: {r['stdout'][-1500:]}\n" \
          f"stderr: {r['stderr'][-3000:]}\naudit: {r['audit'][:1500]}"
    assert r["exit"] in (1, 2), why
    lines = [line for line in r["stderr"].splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(prefix), why
    assert "Traceback" not in r["stderr"] + r["stdout"], why
    assert r["maxrss_mb"] < MAX_RSS_MB, why
    assert r["seconds"] < limit, why
    assert not r["audit"], why
    assert not canary, "a crafted pickle ran code: the canary file exists"
    for text in (r["stdout"], r["stderr"]):
        assert not any(u in text for u in UNSAFE), why
        assert SECRET not in text, why
    assert not r["changed"], "the input was modified\n" + why


CKPT_IDS = [f"{name}-{i}" for name, _, n in case_specs() for i in range(n)]
DATA_IDS = [f"{name}-0" for name, _, _ in DATA_SPECS]
LOAD_IDS = [f"{name}-0" for name, _, _ in case_specs(only_load=True)]


def test_corpus_covers_every_class():
    classes = {k for _, k, _ in case_specs()}
    assert classes >= {"crash", "outside", "memory", "time", "traceback", "mutation", "code", "integrity", "terminal"}
    assert len(case_specs()) >= 60


@pytest.mark.parametrize("job", CKPT_IDS)
def test_ckpt_survives(ckpt_results: dict, job: str):
    _check(ckpt_results[job], "ckpt: error: ", CKPT_TIMEOUT_S, ckpt_results["_canary"])


@pytest.mark.slow
@pytest.mark.parametrize("job", LOAD_IDS)
def test_load_survives(load_results: dict, job: str):
    _check(load_results[job], "error: ", LOAD_TIMEOUT_S, load_results["_canary"])


@pytest.mark.parametrize("job", DATA_IDS)
def test_data_path_survives(data_results: dict, job: str):
    _check(data_results[job], "error: ", LOAD_TIMEOUT_S, False)
