#!/usr/bin/env python3
"""Save, load and resume, plus the ``ckpt`` CLI, on every supported Python (3.10 to 3.13).

Why: ``pyproject.toml`` declares ``>=3.10`` and the suite runs on one interpreter, so a
version-specific break goes unseen until someone resumes a run. One did: Python 3.13 pickles
paths as ``pathlib._local.PosixPath`` and ``--load`` refused the runtime's own checkpoints.

For each version this makes (once, then reuses) a virtualenv ``.venv-3.X`` with the project
installed, then in ``runs/pyversions/3.X/``:

1. *save*: a CP-folded run (2 gloo ranks, cp 2, ``--fold-cp``) trains 4 steps, saving at 2 and 4;
2. *resume*: a second run loads ``iter_0000002`` and trains steps 3-4, saving at 4;
3. *compare*: the resumed run's per-step loss, grad norm and zero count equal the uninterrupted
   run's bit for bit, and ``ckpt diff`` finds the two ``iter_0000004`` checkpoints identical;
4. *cli*: ``ckpt inspect`` and ``ckpt verify --data`` on both runs and on a frozen fixture written
   by an earlier version;
5. *cross*: once every version has run, each resumes from the ``iter_0000002`` the previous one
   saved (3.10 from the last), so a checkpoint written by one Python loads on another. Whether
   those rows equal the saving version's bit for bit is reported, not required: the torch builds
   differ (CPU wheel on 3.11, CUDA wheels elsewhere) and may round differently.

Standard library only, so any Python 3 can start it. Exit 0 when every version passed. Timings
(seconds per phase) are printed as a table and written to ``runs/pyversions/summary.json``.

Examples::

    python3 scripts/pyversions.py                     # 3.10 3.11 3.12 3.13
    python3 scripts/pyversions.py 3.13 --resume-only  # what CI runs: set-up, save, resume, compare
    python3 scripts/pyversions.py 3.12 --python 3.12=/opt/py312/bin/python3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")
REPO = Path(__file__).resolve().parents[1]
VERSIONS = ("3.10", "3.11", "3.12", "3.13")
MODEL = ["--nproc-per-node", "2", "--cp", "2", "--fold-cp", "--steps", "4", "--save-interval", "2"]
FIXTURE = REPO / "fixtures" / "gtp" / "fold_cp2_g2_dp2"  # written by an earlier version: must still verify
IMPORT_CHECK = "import gtp_format, gtp_runtime, ckpt_tool, torch, typer, pytest, hypothesis"


class Failed(Exception):
    """One step failed; the message names it and carries the tail of its output."""


def find_python(version: str, given: dict[str, str]) -> str:
    if version in given:
        return given[version]
    root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    found = sorted(root.glob(f"{version}.*/bin/python"), key=lambda p: [int(x) for x in p.parts[-3].split(".")
                                                                          if x.isdigit()])
    if found:
        return str(found[-1])
    on_path = shutil.which(f"python{version}")
    if on_path:
        return on_path
    raise Failed(f"no Python {version}: install it with pyenv, or pass --python {version}=PATH")


def run(argv: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run a step with its output in ``log``; raise :class:`Failed` with the output's tail if it fails."""
    proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True)
    log.write_text(f"$ {' '.join(argv)}\n{proc.stdout}\n{proc.stderr}")
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        raise Failed(f"`{' '.join(argv)}` exited {proc.returncode} (log: {log}):\n{tail}")
    return proc


def setup(version: str, python: str, out: Path) -> Path:
    """The cached virtualenv ``.venv-<version>`` with the project installed; its python."""
    venv = REPO / f".venv-{version}"
    py = venv / "bin" / "python"
    if not py.exists():
        run([python, "-m", "venv", str(venv)], out / "venv.log")
    if subprocess.run([str(py), "-c", IMPORT_CHECK], cwd=REPO, capture_output=True).returncode != 0:
        run([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", "-e", ".[test]"],
            out / "pip.log")
    got = subprocess.run([str(py), "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                         capture_output=True, text=True).stdout.strip()
    if got != version:
        raise Failed(f"{venv} runs Python {got}, not {version}: remove it and run again")
    return py


def rows(log_json: Path) -> list[tuple[object, ...]]:
    return [(r["step"], r["loss"], r["grad_norm"], r["num_zeros"]) for r in json.loads(log_json.read_text())["rows"]]


def train(py: Path, out: Path, name: str, env: dict[str, str], *extra: str) -> None:
    run([str(py), "-m", "gtp_runtime.train", *MODEL, "--save", str(out / name), "--log-json",
         str(out / f"{name}.json"), *extra], out / f"{name}.log", env)


def compare(py: Path, out: Path, env: dict[str, str]) -> None:
    full, resumed = rows(out / "full.json"), rows(out / "resumed.json")
    if [r[0] for r in full] != [1, 2, 3, 4] or resumed != full[2:]:
        raise Failed(f"resume is not bit-exact: uninterrupted steps 3-4 {full[2:]}, resumed {resumed}")
    ckpt = str(py.with_name("ckpt"))
    run([ckpt, "diff", str(out / "full" / "iter_0000004"), str(out / "resumed" / "iter_0000004")],
        out / "diff.log", env)


def cli(py: Path, out: Path, env: dict[str, str]) -> None:
    ckpt = str(py.with_name("ckpt"))
    for name, folder in (("full", out / "full"), ("resumed", out / "resumed"), ("fixture", FIXTURE)):
        run([ckpt, "inspect", str(folder)], out / f"inspect-{name}.log", env)
        report = run([ckpt, "verify", str(folder), "--data", "--format", "json"], out / f"verify-{name}.log", env)
        json.loads(report.stdout)  # one JSON document, as promised to scripts


def cross(versions: list[str], root: Path, summary: dict[str, dict[str, Any]]) -> None:
    """Each version resumes from the checkpoint the previous version saved (step 5 of the docstring)."""
    for i, version in enumerate(versions):
        source = versions[i - 1]
        out, py = root / version, REPO / f".venv-{version}" / "bin" / "python"
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        t0 = time.perf_counter()
        try:
            train(py, out, "cross", env, "--load", str(root / source / "full" / "iter_0000002"))
        except Failed as e:
            summary[version].update(ok=False, error=f"resuming {source}'s checkpoint: {e}")
            print(f"FAIL {version}: {summary[version]['error']}", file=sys.stderr)
            continue
        same = rows(out / "cross.json") == rows(root / source / "full.json")[2:]
        summary[version].update(cross_from=source, cross_bitexact=same, cross=round(time.perf_counter() - t0, 1))
        print(f"ok   Python {version} resumed Python {source}'s checkpoint "
              f"({'bit-exact' if same else 'rows differ in the last bits'}) {summary[version]['cross']}s", flush=True)


def check_version(version: str, python: str, root: Path, resume_only: bool) -> dict[str, float]:
    out = root / version
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    times: dict[str, float] = {}

    def timed(phase: str, fn: Callable[..., T], *args: Any) -> T:
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            times[phase] = round(time.perf_counter() - t0, 1)

    py = timed("setup", setup, version, python, out)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PATH": f"{py.parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    timed("save", train, py, out, "full", env)
    timed("resume", train, py, out, "resumed", env, "--load", str(out / "full" / "iter_0000002"))
    timed("compare", compare, py, out, env)
    if not resume_only:
        timed("cli", cli, py, out, env)
    return times


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="examples:\n  python3 scripts/pyversions.py\n"
                                        "  python3 scripts/pyversions.py 3.13 --resume-only")
    ap.add_argument("versions", nargs="*", default=list(VERSIONS), help="Python versions (default: all four)")
    ap.add_argument("--python", action="append", default=[], metavar="X.Y=PATH", help="interpreter for a version")
    ap.add_argument("--resume-only", action="store_true", help="set-up, save, resume and compare; no CLI checks")
    ap.add_argument("--out", default=str(REPO / "runs" / "pyversions"), help="where runs and logs go")
    args = ap.parse_args(argv)
    bad = [v for v in args.versions if v not in VERSIONS]
    if bad or any("=" not in p for p in args.python):
        ap.error(f"versions are {', '.join(VERSIONS)}; --python takes X.Y=PATH")
    given = dict(p.split("=", 1) for p in args.python)
    root = Path(args.out)
    summary: dict[str, dict[str, Any]] = {}
    for version in args.versions:
        t0 = time.perf_counter()
        try:
            times = check_version(version, find_python(version, given), root, args.resume_only)
            summary[version] = {"ok": True, **times}
        except Failed as e:
            summary[version] = {"ok": False, "error": str(e)}
            print(f"FAIL {version}: {e}", file=sys.stderr)
        summary[version]["total"] = round(time.perf_counter() - t0, 1)
        print(f"{'ok  ' if summary[version]['ok'] else 'FAIL'} Python {version}  "
              + "  ".join(f"{k} {v}s" for k, v in summary[version].items() if isinstance(v, float)), flush=True)
    passed = [v for v in args.versions if summary[v]["ok"]]
    if not args.resume_only and len(passed) > 1:
        cross(passed, root, summary)
    root.mkdir(parents=True, exist_ok=True)
    (root / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return 0 if all(s["ok"] for s in summary.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
