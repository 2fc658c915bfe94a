"""CPU s/GB per stage of the copy paths, this checkout against another, interleaved in one run.

    python benchmarks/copy_cpu_ab.py --before /path/to/other/checkout --workdir /dev/shm/ab --layers 8 --out ab.json

Builds one synthetic ``dp_reshardable`` checkpoint (``benchmarks/bench_reshard.py``'s, GPT hidden ``--hidden``,
ffn ``--ffn``) and its Hugging Face export under ``--workdir`` (``/dev/shm``: the disk is then not the limit),
then, for each round, each command once per checkout, one after the other (before, this one), each in a fresh
process under ``benchmarks/copy_cpu_stages.py`` (every stage's CPU from per-thread clocks): ``reshard --tp 2
--cp 1 --no-fold-cp``, ``export --to hf --optimizer``, ``import --from hf``, ``verify --data``; and ``cp -r`` of
the source (wall and CPU of the child). Outputs are removed after each command. ``--rounds``: more rounds while
the run is under ``--budget-s`` seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STAGES = REPO / "benchmarks" / "copy_cpu_stages.py"


def children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def profiled(tree: Path, argv: list[str], out: Path) -> dict:
    """``argv`` (a ckpt command) under copy_cpu_stages.py, with ``tree``'s code."""
    script = tree / "benchmarks" / "copy_cpu_stages.py"
    if tree != REPO:
        shutil.copy(STAGES, script)  # the other checkout may predate it: the same profiler for both
    env = dict(os.environ, PYTHONPATH=str(tree))
    r = subprocess.run([sys.executable, str(script), "--out", str(out), "--", *argv], cwd=tree, env=env,
                       capture_output=True, text=True)
    if r.returncode != 0:
        return {"argv": argv, "error": r.stderr[-1500:]}
    return json.loads(out.read_text())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", type=Path, help="the other checkout (its repository root)")
    ap.add_argument("--workdir", type=Path, default=Path("/dev/shm/copy_cpu_ab"))
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--ffn", type=int, default=8192)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--budget-s", type=float, default=200.0, help="no new round once the run is past this")
    ap.add_argument("--only", default="reshard,export,import,verify", help="comma list of commands")
    ap.add_argument("--out", type=Path, help="results as JSON")
    ap.add_argument("--smoke", action="store_true", help="a tiny checkpoint, one round, this checkout as both sides")
    args = ap.parse_args()
    if args.smoke:
        args.before = args.before or REPO
        args.layers, args.hidden, args.ffn, args.vocab, args.rounds = 1, 64, 256, 512, 1
    if args.before is None:
        ap.error("--before: the checkout to compare with")
    t0 = time.perf_counter()
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import tabulate  # noqa: F401 - bench_reshard's report needs it, its source builder does not
    except ImportError:
        import types

        sys.modules["tabulate"] = types.SimpleNamespace(tabulate=lambda *a, **k: "")  # type: ignore[assignment]
    import bench_reshard

    work = args.workdir
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    src, hf, dst = work / "src", work / "hf", work / "dst"
    ns = argparse.Namespace(vocab=args.vocab, hidden=args.hidden, ffn=args.ffn)
    gb = bench_reshard.make_source(src, args.layers, ns) / 1e9
    env = dict(os.environ, PYTHONPATH=str(REPO))
    subprocess.run([sys.executable, "-m", "ckpt_tool.cli", "export", str(src), str(hf), "--to", "hf"], cwd=REPO,
                   env=env, check=True, capture_output=True)
    commands = {
        "reshard": ["reshard", str(src), str(dst), "--tp", "2", "--cp", "1", "--no-fold-cp"],
        "export": ["export", str(src), str(dst), "--to", "hf", "--optimizer"],
        "import": ["import", str(hf), str(dst), "--from", "hf", "--tp", "2", "--dp", "2"],
        "verify": ["verify", "--data", str(src)],
    }
    only = args.only.split(",")
    trees = {"before": args.before.resolve(), "after": REPO}
    results: list[dict] = []
    doc = {"source_gb": round(gb, 3), "layers": args.layers, "hidden": args.hidden, "ffn": args.ffn,
           "nproc": os.cpu_count(), "affinity": len(os.sched_getaffinity(0)), "results": results}
    for rnd in range(args.rounds):
        if rnd and time.perf_counter() - t0 > args.budget_s:
            break
        c0, w0 = children_cpu(), time.perf_counter()
        subprocess.run(["cp", "-r", str(src), str(dst)], check=True)
        results.append({"round": rnd, "tree": "cp -r", "cmd": "cp", "wall_s": round(time.perf_counter() - w0, 3),
                        "cpu_s": round(children_cpu() - c0, 3), "gb": round(gb, 3),
                        "cpu_s_per_gb": round((children_cpu() - c0) / gb, 3)})
        shutil.rmtree(dst, ignore_errors=True)
        for name in only:
            for label, tree in trees.items():
                got = profiled(tree, commands[name], work / f"{name}-{label}.json")
                got.update(round=rnd, tree=label, cmd=name)
                results.append(got)
                shutil.rmtree(dst, ignore_errors=True)
                print(json.dumps({k: got.get(k) for k in ("round", "tree", "cmd", "gb", "wall_s", "cpu_s",
                                                           "cpu_s_per_gb", "peak_threads", "error")}), flush=True)
    doc["seconds"] = round(time.perf_counter() - t0, 1)
    if args.out:
        args.out.write_text(json.dumps(doc, indent=1))
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
