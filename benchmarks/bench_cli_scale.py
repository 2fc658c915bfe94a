"""Benchmark: the CLI at scale against its baselines, each in the same run: one table in one command.

Rows (each a ratio against its baseline, measured in this run, on this machine):

* ``verify_data_warm_vs_cat``: ``ckpt verify DIR --data`` against ``cat`` of the same files to
  /dev/null, both after an untimed ``cat`` (page cache warm), on a checkpoint written by PyTorch's
  own ``dcp.save`` (``--verify-gb``; one ``FileSystemWriter`` thread per ``--dcp-files``). Ratio:
  cat's time over verify's (throughput; above 1.0x verify is faster);
* ``verify_data_cold_vs_cat``: the same with the page cache dropped before each command
  (``/proc/sys/vm/drop_caches``, root only; skipped with a note where it cannot be written, and
  always under ``--smoke``);
* ``reshard_vs_cp``, ``export_hf_vs_cp``: ``ckpt reshard SRC DST --tp 2 --cp 1 --no-fold-cp`` and
  ``ckpt export SRC DST --to hf --optimizer`` against ``cp -r SRC COPY`` (bench_reshard.py's
  synthetic dp_reshardable source, ``--layers/--hidden/--ffn``); an untimed ``sync`` before each; the
  ``sync`` after each is timed apart (``cp -r`` returns with its bytes in the page cache, ours after
  their ``fsync``), giving ``ratio_vs_cp_then_sync``, beside this disk's ``dd oflag=direct`` write speed;
* ``inspect_1m_vs_torch``, ``inspect_1m_rss_vs_torch``: ``ckpt inspect DIR --format json`` against a
  process that runs PyTorch's ``FileSystemReader(DIR).read_metadata()``, on bench_inspect.py's
  synthetic ``.metadata`` of ``--meta-chunks`` chunks (``CKPT_MAX_METADATA_BYTES`` raised: its data
  files are sparse). Ratios: our time (peak RSS) over torch's; below 1.0x ckpt is faster (smaller);
* ``verify_meta_1m_vs_torch``: ``ckpt verify DIR --format json`` (no ``--data``) against the same torch process.
  Rounds run with the metadata scan compiled in numba's cache (one untimed ``CKPT_COMPILE_SCAN=1`` run first);
  the inspect row also records a fresh machine's time (an empty ``NUMBA_CACHE_DIR``: the file is read the old
  way, the scan not being worth compiling for it) as ``fresh_cache_s``, and the compiling run as
  ``fresh_cache_compiling_s``.

Every command is a fresh process, start-up included, timed by wall clock; ``os.wait4`` gives its
peak RSS and CPU seconds (user + system), which are recorded too: on a shared machine CPU seconds
say more than wall time. The best of ``--repeats`` rounds is kept for each command (rounds
interleave ours and the baseline). The results go to ``--out`` (or ``$CKPT_BENCH_OUT``) as
``cli_scale_results.json``, with the command line and the machine (nproc, CPU model); ``--write-docs``
also merges the rows into docs/cli_scale_results.json (a row replaces the one of the same name and machine).

    python benchmarks/bench_cli_scale.py --out /tmp/scale_out            # the full sizes
    python benchmarks/bench_cli_scale.py --smoke --out /tmp/scale_smoke  # seconds (tests/benchmarks)
    python benchmarks/bench_cli_scale.py --merge OUT/cli_scale_results.json  # rows from another machine
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[1]
DOCS_JSON = REPO / "docs" / "cli_scale_results.json"
ROWS = ("verify_data_warm_vs_cat", "verify_data_cold_vs_cat", "reshard_vs_cp", "export_hf_vs_cp",
        "inspect_1m_vs_torch", "inspect_1m_rss_vs_torch", "verify_meta_1m_vs_torch")
GROUPS = ("verify", "reshard", "meta")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("CKPT_BENCH_OUT"),
                    help="folder for cli_scale_results.json (default: $CKPT_BENCH_OUT, else /tmp/bench_cli_scale_out)")
    ap.add_argument("--workdir", default="/tmp/bench_cli_scale", help="generated inputs go here (removed after)")
    ap.add_argument("--only", default=",".join(GROUPS), help=f"comma list of groups: {', '.join(GROUPS)}")
    ap.add_argument("--verify-gb", type=float, default=12.9, help="size of the dcp.save checkpoint")
    ap.add_argument("--dcp-files", type=int, default=1, help="dcp.save's FileSystemWriter thread_count (files)")
    ap.add_argument("--tensor-mib", type=int, default=64, help="size of each tensor of the dcp.save checkpoint")
    ap.add_argument("--dcp-dir", help="the verify rows' dcp.save checkpoint: made here when absent and kept, so "
                                      "that a second run (under taskset, say) reads the same files without writing "
                                      "12.9 GB again")
    ap.add_argument("--layers", type=int, default=16, help="reshard source (bench_reshard.py): layers")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--ffn", type=int, default=8192)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--meta-chunks", type=int, default=1_000_000, help="chunks of the synthetic .metadata")
    ap.add_argument("--repeats", type=int, default=2, help="rounds per row (best kept)")
    ap.add_argument("--workers", type=int, help="verify --workers (default: the CLI's own)")
    ap.add_argument("--against", metavar="DIR",
                    help="another checkout of this repository (main's tree, say): its verify --data is timed in the "
                         "same rounds as ours, right after it, and recorded in the verify rows (against_s)")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=VAR=VALUE[,VAR=VALUE...]",
                    help="also time our verify --data with these environment variables set, in the same rounds "
                         "(recorded in the verify rows under variants.NAME); repeatable")
    ap.add_argument("--no-cold", action="store_true", help="skip the cold row (a machine shared with others)")
    ap.add_argument("--no-warm", action="store_true", help="skip the warm row (its results written before a cold run)")
    ap.add_argument("--host", help="words for the machine, recorded with the rows (\"lent H100 host\", say)")
    ap.add_argument("--write-docs", action="store_true", help="merge the rows into docs/cli_scale_results.json")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, seconds (tests/benchmarks); never drops caches")
    ap.add_argument("--merge", nargs="+", metavar="JSON",
                    help="only merge the rows of these cli_scale_results.json files (copied back from another "
                         "machine) into docs/cli_scale_results.json")
    ap.add_argument("--make", nargs=2, metavar=("KIND", "PATH"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    for v in args.variant:
        name, _, pairs = v.partition("=")
        settings = [x.partition("=") for x in pairs.split(",")]
        if not name or not pairs or any(not var or not sep for var, sep, _ in settings):
            ap.error(f"--variant {v!r}: write NAME=VAR=VALUE[,VAR=VALUE...] "
                     "(direct=CKPT_VERIFY_DIRECT=1, say, or span8=CKPT_VERIFY_DIRECT=1,CKPT_VERIFY_SPAN_MIB=8)")
    if args.smoke:
        args.verify_gb, args.tensor_mib, args.dcp_files = 0.02, 2, 2
        args.layers, args.hidden, args.ffn, args.vocab = 1, 64, 256, 512
        args.meta_chunks, args.repeats = 2000, 1
    return args


def cpus() -> int:
    """The cores this process may run on (``taskset`` narrows them; ``host_cpus`` is the machine's)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def machine(host: str | None = None) -> dict[str, object]:
    model = platform.processor() or platform.machine()
    try:
        model = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    nproc = cpus()  # the CPUs this run may use (taskset, a cpuset): a 2-core run on a 16-core host is a 2-core row
    return {"nproc": nproc, "cpus": nproc, "cpu": model, "python": platform.python_version(),
            "load_avg_1m": round(os.getloadavg()[0], 2),
            **({"host_cpus": os.cpu_count()} if nproc != os.cpu_count() else {}), **({"host": host} if host else {})}


# -- one command, timed ---------------------------------------------------------------------------

def timed(cmd: list[str], env: dict[str, str] | None = None, ok: tuple[int, ...] = (0,),
          tree: Path = REPO) -> dict[str, float]:
    """One fresh process: wall seconds, CPU seconds (user + system) and peak RSS bytes (``os.wait4``), stdout.
    ``tree``: the checkout it runs from (its folder and ``PYTHONPATH``)."""
    full = {**os.environ, "PYTHONPATH": str(tree), **(env or {})}
    t = time.perf_counter()
    with open(os.devnull, "wb") as devnull, tempfile.TemporaryFile() as errors:  # a file: no pipe to fill
        p = subprocess.Popen(cmd, cwd=tree, env=full, stdin=subprocess.DEVNULL,
                             stdout=devnull if cmd[0] in ("cat", "cp", "dd") else subprocess.PIPE, stderr=errors)
        out = p.stdout.read() if p.stdout else b""
        _, status, usage = os.wait4(p.pid, 0)
        errors.seek(0)
        err = errors.read()
        p.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - t
    if p.returncode not in ok:
        raise SystemExit(f"{shlex.join(cmd)} failed ({p.returncode}): {err.decode()[-2000:]}")
    return {"wall": wall, "cpu": usage.ru_utime + usage.ru_stime, "user": usage.ru_utime, "sys": usage.ru_stime,
            "rss": usage.ru_maxrss * 1024, "rc": p.returncode, "out": out.decode()}


def best(runs: list[dict]) -> dict:
    return min(runs, key=lambda r: r["wall"])


def drop_caches() -> bool:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def row(name: str, ours: dict, base: dict, ratio: float, what: str, size: dict, **extra: object) -> dict:
    return {"row": name, "ratio": round(ratio, 3), "what": what,
            "ours_s": round(ours["wall"], 3), "baseline_s": round(base["wall"], 3),
            "ours_cpu_s": round(ours["cpu"], 3), "baseline_cpu_s": round(base["cpu"], 3),
            "ours_user_s": round(ours.get("user", 0.0), 3), "ours_sys_s": round(ours.get("sys", 0.0), 3),
            "ours_peak_rss_mib": round(ours["rss"] / 2**20, 1), "baseline_peak_rss_mib": round(base["rss"] / 2**20, 1),
            **size, **extra}


CKPT = [sys.executable, "-m", "ckpt_tool.cli"]


# -- verify --data against cat, on a dcp.save checkpoint ------------------------------------------

def make_dcp(folder: Path, gb: float, tensor_mib: int, files: int) -> int:
    """A checkpoint written by PyTorch's own ``dcp.save`` (one process, no process group): fp32 tensors
    of ``tensor_mib`` each, values sliced from one random buffer (finite, no NaN/Inf)."""
    import torch
    import torch.distributed.checkpoint as dcp

    base = torch.randn(1 << 22)  # 16 MiB of values
    numel = (tensor_mib << 20) // 4
    n = max(1, round(gb * 1e9 / (tensor_mib << 20)))
    state = {}
    for i in range(n):
        t = torch.empty(numel)
        for lo in range(0, numel, base.numel()):
            t[lo:lo + base.numel()] = base[: min(base.numel(), numel - lo)].roll(i)
        state[f"layer{i // 4}.w{i % 4}"] = t.view(-1, 1024) if numel % 1024 == 0 else t
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(folder), thread_count=files))
    del state
    return sum(p.stat().st_size for p in folder.iterdir() if p.name.endswith(".distcp"))


def bench_verify(args: argparse.Namespace, work: Path) -> tuple[list[dict], list[str]]:
    folder = Path(args.dcp_dir) if args.dcp_dir else work / "dcp"
    if args.dcp_dir and (folder / ".metadata").is_file():
        nbytes = sum(p.stat().st_size for p in folder.iterdir() if p.name.endswith(".distcp"))
    else:
        nbytes = make(args, "dcp", folder)["bytes"]
    files = sorted(str(p) for p in folder.iterdir() if p.is_file())
    size = {"ckpt_gb": round(nbytes / 1e9, 3), "data_files": sum(f.endswith(".distcp") for f in files)}
    verify = [*CKPT, "verify", str(folder), "--data", "--format", "json",
              *(["--workers", str(args.workers)] if args.workers else [])]
    rows, notes = [], []
    for cold in (False, True):
        if not cold and args.no_warm:
            continue
        if cold and (args.smoke or args.no_cold or not drop_caches()):
            why = "--smoke never drops the page cache" if args.smoke else "--no-cold" if args.no_cold \
                else "/proc/sys/vm/drop_caches is not writable here (needs root)"
            notes.append(f"verify_data_cold_vs_cat skipped: {why}")
            continue
        # who -> (tree, extra environment); each round runs them in this order, the cache emptied (or warmed) first
        whos: dict[str, tuple[Path, dict[str, str]]] = {"cat": (REPO, {}), "ours": (REPO, {})}
        if args.against:
            whos["against"] = (Path(args.against).resolve(), {})
        for v in args.variant:
            name, _, pairs = v.partition("=")
            whos[f"variant:{name}"] = (REPO, dict(x.split("=", 1) for x in pairs.split(",")))  # type: ignore[misc]
        got: dict[str, list[dict]] = {w: [] for w in whos}
        for rnd in range(args.repeats):
            for who, (tree, env) in whos.items():
                if cold:
                    drop_caches()
                else:
                    subprocess.run(["cat", *files], stdout=subprocess.DEVNULL, check=True)  # untimed warm-up
                if who == "cat":
                    got[who].append(timed(["cat", *files]))
                else:
                    r = timed(verify, env, tree=tree)
                    doc = json.loads(r["out"])
                    if not doc["ok"] or "data" not in doc["checks"]:
                        raise SystemExit(f"verify --data ({who}) did not pass on {folder}: {r['out'][-2000:]}")
                    got[who].append(r)
                r = got[who][-1]
                print(f"{'cold' if cold else 'warm'} round {rnd} {who}: {r['wall']:.3f} s, {r['cpu']:.2f} CPU s, "
                      f"{r['rss'] / 2**20:.0f} MiB", flush=True)
        cats, ours = got["cat"], got["ours"]
        c, o = best(cats), best(ours)
        name = "verify_data_cold_vs_cat" if cold else "verify_data_warm_vs_cat"
        gb = nbytes / 1e9
        extra: dict[str, object] = {}
        if args.against:
            a = best(got["against"])
            extra.update(against_tree=args.against, against_s=round(a["wall"], 3),
                         against_ratio=round(c["wall"] / a["wall"], 3),
                         against_all_s=[round(r["wall"], 3) for r in got["against"]],
                         against_peak_rss_mib=round(a["rss"] / 2**20, 1), against_cpu_s=round(a["cpu"], 3))
        if args.variant:
            extra["variants"] = {w.split(":", 1)[1]: {
                "env": whos[w][1], "best_s": round(best(got[w])["wall"], 3),
                "ratio": round(c["wall"] / best(got[w])["wall"], 3), "all_s": [round(r["wall"], 3) for r in got[w]],
                "peak_rss_mib": round(best(got[w])["rss"] / 2**20, 1), "cpu_s": round(best(got[w])["cpu"], 3)}
                for w in whos if w.startswith("variant:")}
        rows.append(row(name, o, c, c["wall"] / o["wall"], "throughput: cat s / verify --data s (higher is better)",
                        size, ours_gbps=round(gb / o["wall"], 2), baseline_gbps=round(gb / c["wall"], 2),
                        command=shlex.join(verify), baseline_command="cat FILES > /dev/null",
                        within_128_mib=o["rss"] <= 128 << 20, ours_all_s=[round(r["wall"], 3) for r in ours],
                        baseline_all_s=[round(r["wall"], 3) for r in cats], **extra))
    if not args.dcp_dir:
        shutil.rmtree(folder, ignore_errors=True)
    return rows, notes


# -- reshard and export --to hf --optimizer against cp -r ----------------------------------------

def bench_reshard(args: argparse.Namespace, work: Path) -> list[dict]:
    src = work / "src"
    nbytes = make(args, "reshard", src)["bytes"]
    size = {"ckpt_gb": round(nbytes / 1e9, 3), "layers": args.layers, "hidden": args.hidden, "ffn": args.ffn}
    dsts = {"cp": work / "copy", "reshard": work / "rs", "export": work / "hf"}
    cmds = {"cp": ["cp", "-r", str(src), str(work / "copy")],
            "reshard": [*CKPT, "reshard", str(src), str(work / "rs"), "--tp", "2", "--cp", "1", "--no-fold-cp",
                        "--format", "json"],
            "export": [*CKPT, "export", str(src), str(work / "hf"), "--to", "hf", "--optimizer", "--format", "json"]}
    got: dict[str, list[dict]] = {k: [] for k in cmds}
    for _ in range(args.repeats):
        for name, cmd in cmds.items():
            os.sync()  # untimed: no earlier command's writeback during this one
            got[name].append(timed(cmd))
            t = time.perf_counter()
            os.sync()  # timed apart: what the command left for the disk (ours fsync before they commit)
            got[name][-1]["sync"] = time.perf_counter() - t
            shutil.rmtree(dsts[name], ignore_errors=True)
    cp = best(got["cp"])
    disk = direct_write_gbps(work, min(nbytes, 8 << 30))
    rows = []
    for name, label in (("reshard", "reshard_vs_cp"), ("export", "export_hf_vs_cp")):
        o = best(got[name])
        rows.append(row(label, o, cp, cp["wall"] / o["wall"], f"throughput: cp -r s / {name} s (higher is better)",
                        size, command=shlex.join(cmds[name]), baseline_command=shlex.join(cmds["cp"]),
                        baseline_sync_s=round(cp["sync"], 3), ours_sync_s=round(o["sync"], 3),
                        ratio_vs_cp_then_sync=round((cp["wall"] + cp["sync"]) / (o["wall"] + o["sync"]), 3),
                        ours_gbps=round(nbytes / 1e9 / o["wall"], 2), dd_direct_write_gbps=disk))
    shutil.rmtree(src, ignore_errors=True)
    return rows


def direct_write_gbps(work: Path, nbytes: int) -> float | None:
    """The disk's durable write speed here: ``dd oflag=direct conv=fsync`` of ``nbytes`` in 16 MiB blocks (one
    stream). ``cp -r`` returns once its bytes are in the page cache; ``reshard`` and ``export`` return once
    theirs are on the disk (``O_DIRECT`` and ``fsync``), so this is their floor, not ``cp``'s."""
    out = work / "dd.bin"
    cmd = ["dd", "if=/dev/zero", f"of={out}", "bs=16M", f"count={max(1, nbytes >> 24)}", "oflag=direct",
           "conv=fsync", "status=none"]
    try:
        os.sync()
        r = timed(cmd)
    except SystemExit:
        return None
    finally:
        out.unlink(missing_ok=True)
    return round((max(1, nbytes >> 24) << 24) / 1e9 / r["wall"], 2)


# -- inspect and verify of a 1M-chunk .metadata against torch's read_metadata ----------------------

TORCH_READ = ("import sys; from torch.distributed.checkpoint import FileSystemReader; "
              "FileSystemReader(sys.argv[1]).read_metadata()")


def bench_meta(args: argparse.Namespace, work: Path) -> list[dict]:
    folder = work / "meta"
    info = make(args, "meta", folder)
    env = {"CKPT_MAX_METADATA_BYTES": str(1 << 32), "OMP_NUM_THREADS": "1"}
    size = {"chunks": info["chunks"], "keys": info["keys"], "metadata_mib": round(info["metadata_bytes"] / 2**20, 1)}
    cmds = {"torch": [sys.executable, "-c", TORCH_READ, str(folder)],
            "inspect": [*CKPT, "inspect", str(folder), "--format", "json"],
            "verify": [*CKPT, "verify", str(folder), "--format", "json"]}
    got: dict[str, list[dict]] = {k: [] for k in cmds}
    with tempfile.TemporaryDirectory() as fresh:  # a machine whose numba cache is empty, as a fresh CI container
        first = timed(cmds["inspect"], {**env, "NUMBA_CACHE_DIR": fresh})
        compiling = timed(cmds["inspect"], {**env, "NUMBA_CACHE_DIR": fresh, "CKPT_COMPILE_SCAN": "1"})
    timed(cmds["inspect"], {**env, "CKPT_COMPILE_SCAN": "1"})  # untimed: the scan compiled in numba's own cache
    for _ in range(args.repeats):
        for name, cmd in cmds.items():
            got[name].append(timed(cmd, env, ok=(0, 1) if name == "verify" else (0,)))
    torch_r, ins, ver = best(got["torch"]), best(got["inspect"]), best(got["verify"])
    verdict = json.loads(ver["out"])
    rows = [row("inspect_1m_vs_torch", ins, torch_r, ins["wall"] / torch_r["wall"],
                "time: inspect s / torch read_metadata process s (lower is better)", size,
                command=shlex.join(cmds["inspect"]), baseline_command=shlex.join(cmds["torch"]),
                fresh_cache_s=round(first["wall"], 3), fresh_cache_compiling_s=round(compiling["wall"], 3)),
            row("inspect_1m_rss_vs_torch", ins, torch_r, ins["rss"] / torch_r["rss"],
                "peak RSS: inspect / torch read_metadata process (lower is better)", size,
                command=shlex.join(cmds["inspect"]), baseline_command=shlex.join(cmds["torch"])),
            row("verify_meta_1m_vs_torch", ver, torch_r, ver["wall"] / torch_r["wall"],
                "time: verify (no --data) s / torch read_metadata process s (lower is better)", size,
                command=shlex.join(cmds["verify"]), baseline_command=shlex.join(cmds["torch"]),
                verify_ok=verdict["ok"], verify_errors=verdict["errors"],
                verify_vs_inspect=round(ver["wall"] / ins["wall"], 3))]
    shutil.rmtree(folder, ignore_errors=True)
    return rows


# -- inputs, each made in a child process ------------------------------------------------------------

def make(args: argparse.Namespace, kind: str, path: Path) -> dict:
    """Write one input in a child process and return what it reports.

    Why a child: ``ru_maxrss`` survives ``exec``, so every command this process starts would report at
    least this process's own peak; kept free of torch and of the inputs' buffers, that floor is small.
    """
    argv = [sys.executable, __file__, "--make", kind, str(path), *(["--smoke"] if args.smoke else []),
            "--verify-gb", str(args.verify_gb), "--tensor-mib", str(args.tensor_mib), "--dcp-files",
            str(args.dcp_files), "--layers", str(args.layers), "--hidden", str(args.hidden), "--ffn", str(args.ffn),
            "--vocab", str(args.vocab), "--meta-chunks", str(args.meta_chunks)]
    t = time.perf_counter()
    r = timed(argv, {"PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "benchmarks")])})
    print(f"made {kind} input in {time.perf_counter() - t:.1f} s", flush=True)
    return json.loads(r["out"].strip().splitlines()[-1])


def make_child(args: argparse.Namespace) -> None:
    kind, path = args.make[0], Path(args.make[1])
    if kind == "dcp":
        info = {"bytes": make_dcp(path, args.verify_gb, args.tensor_mib, args.dcp_files)}
    elif kind == "reshard":
        from bench_reshard import make_source

        info = {"bytes": make_source(path, args.layers, SimpleNamespace(hidden=args.hidden, ffn=args.ffn,
                                                                         vocab=args.vocab))}
    else:
        from bench_inspect import generate

        info = generate(path, args.meta_chunks, SimpleNamespace(chunks_per_key=100, chunk_numel=4096, files=4))
    print(json.dumps(info))


def merge_docs(rows: list[dict], path: Path = DOCS_JSON) -> None:
    """Rows replace those of the same name on the same machine (nproc, the cores it ran on, CPU model); others
    stay. A row from before the cores were recorded ran on all of them."""
    old = json.loads(path.read_text()) if path.exists() else {"rows": []}
    key = lambda r: (r["row"], r["machine"]["nproc"], r["machine"].get("cpus", r["machine"]["nproc"]),  # noqa: E731
                     r["machine"]["cpu"], r.get("smoke", False))
    new = {key(r) for r in rows}
    old["rows"] = [r for r in old["rows"] if key(r) not in new] + rows
    path.write_text(json.dumps(old, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.make:
        make_child(args)
        return 0
    if args.merge:
        for name in args.merge:
            merge_docs([r for r in json.loads(Path(name).read_text())["rows"] if not r.get("smoke")])
        return 0
    groups = [g for g in args.only.split(",") if g]
    if unknown := set(groups) - set(GROUPS):
        raise SystemExit(f"--only: unknown group(s) {', '.join(sorted(unknown))}; choose from {', '.join(GROUPS)}")
    work = Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    out = Path(args.out) if args.out else work.parent / "bench_cli_scale_out"
    command = shlex.join(["python", "benchmarks/bench_cli_scale.py", *(argv if argv is not None else sys.argv[1:])])
    where = machine(args.host)
    rows: list[dict] = []
    notes: list[str] = []
    t0 = time.perf_counter()
    try:
        if "verify" in groups:
            got, notes = bench_verify(args, work)
            rows += got
        if "reshard" in groups:
            rows += bench_reshard(args, work)
        if "meta" in groups:
            rows += bench_meta(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for r in rows:
        r.update(run_command=command, machine=where, smoke=args.smoke)
    doc = {"command": command, "machine": where, "seconds": round(time.perf_counter() - t0, 1), "notes": notes,
           "rows": rows}
    out.mkdir(parents=True, exist_ok=True)
    (out / "cli_scale_results.json").write_text(json.dumps(doc, indent=1) + "\n")
    for r in rows:
        print(f"{r['row']:26s} {r['ratio']:6.3f}x  ours {r['ours_s']:8.2f} s ({r['ours_cpu_s']:.2f} CPU s, "
              f"{r['ours_peak_rss_mib']:.0f} MiB)  baseline {r['baseline_s']:8.2f} s ({r['baseline_cpu_s']:.2f} CPU s, "
              f"{r['baseline_peak_rss_mib']:.0f} MiB)")
    for n in notes:
        print(n)
    if args.write_docs and not args.smoke:
        merge_docs(rows)
    print(json.dumps({"rows": [[r["row"], r["ratio"]] for r in rows], "notes": notes, "out": str(out)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
