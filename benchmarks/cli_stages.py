"""Where a ``ckpt`` command's time goes, over all its threads: a sampling profile by stage.

    python benchmarks/cli_stages.py --out prof.json -- reshard SRC DST --tp 2 --cp 1 --no-fold-cp
    python benchmarks/cli_stages.py --out prof.json -- export SRC DST --to hf --optimizer
    python benchmarks/cli_stages.py --smoke --workdir W --out prof.json   # ckpt inspect of a small one (seconds)

The command runs in this process (``ckpt_tool.cli.run``); a sampler thread reads every thread's
innermost Python frame every ``--interval`` seconds (``sys._current_frames``) and names the stage by
the first frame (innermost first) that is in :data:`STAGES`, else by the innermost frame of this
project. A call into C (a hash, ``pread``, ``pwrite``, a numpy copy, ``fsync``) is charged to the
Python line that made it, so the line is the stage: a hash that releases the GIL is sampled as it
runs; one that holds it delays the sampler, which then charges the wait to whatever runs next
(seen as fewer samples than its threads' time, not as another stage). Threads that wait on a lock,
a future or a queue are counted apart (``waiting``), so ``busy`` thread-seconds say where the CPU
and the disk were used. Why not py-spy: it is not installed on the lent machines.

Output: the wall time, the busy thread-seconds per stage (samples x interval), and the same per
thread role (main, the file writers, the sinks' writer threads, other pools), as JSON and a table.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import threading
import time
from pathlib import Path
from types import FrameType

REPO = Path(__file__).resolve().parents[1]
WAIT_NAMES = {"wait", "acquire", "result", "_wait_for_tstate_lock", "join", "get", "_worker", "select", "sleep"}
# (file suffix, function[, line substring]) -> stage: the lines that do the work of a reshard or an export
STAGES: list[tuple[str, str, str, str]] = [
    ("writer/sink.py", "write", "_crc.update", "output CRC-32C (sink)"),
    ("writer/sink.py", "write", "_seg.update", "chunk record xxh3 (sink)"),
    ("writer/sink.py", "write", "on_piece", "per-piece checks (zip CRC-32, statistics)"),
    ("writer/sink.py", "_stage", "", "staging copy (sink)"),
    ("writer/sink.py", "_put", "pwrite", "pwrite O_DIRECT (sink thread)"),
    ("writer/sink.py", "_put_bytes", "", "buffered write (sink)"),
    ("writer/sink.py", "close", "fsync", "fsync"),
    ("writer/sink.py", "_wait", "", "waiting for the sink's previous write"),
    ("copying/writers.py", "__call__", "crc32", "zip CRC-32 of a chunk"),
    ("copying/writers.py", "__call__", "stats", "chunk statistics"),
    ("integrity/stats.py", "", "", "chunk statistics"),
    ("check/integrity.py", "", "", "read ledger (CRC-32C of read bytes, gaps)"),
    ("reader/storage.py", "pread", "", "source pread"),
    ("reader/storage.py", "pread_into", "", "source pread"),
    ("reader/preads.py", "", "", "source pread"),
    ("hashing.py", "", "", "CRC-32C (hashing.py)"),
    ("copying/ahead.py", "", "", "export read-ahead"),
    ("export/engine.py", "", "", "export (other lines)"),
    ("reshard/engine.py", "", "", "reshard engine (other lines)"),
    ("copying/engine.py", "", "", "copy kernel (other lines)"),
    ("copying/source.py", "", "", "source assembly (other lines)"),
    ("check/gate.py", "", "", "gate (open, checks)"),
    ("<frozen importlib", "", "", "imports"),
]
GENERIC = {"CRC-32C (hashing.py)"}  # named by the caller where one of the next frames out is a stage


def stage_of(frame: FrameType | None) -> str | None:
    """The stage of one thread's stack, or ``None`` while it waits (a lock, a future, a queue)."""
    if frame is None:
        return None
    if frame.f_code.co_name in WAIT_NAMES and "threading" in frame.f_code.co_filename \
            or frame.f_code.co_name in WAIT_NAMES and "concurrent" in frame.f_code.co_filename \
            or frame.f_code.co_name in WAIT_NAMES and "queue" in frame.f_code.co_filename:
        return None
    f: FrameType | None = frame
    own = generic = None
    depth = 0
    while f is not None and (generic is None or depth < 3):
        name, code = f.f_code.co_filename, f.f_code.co_name
        line = _line(name, f.f_lineno)
        stage = next((st for suffix, func, text, st in STAGES
                      if suffix in name and (not func or func == code) and (not text or text in line)), None)
        if stage is not None and "(other lines)" in stage and own is not None:
            return own  # a deeper frame of this project that no stage names says more
        if stage is not None and stage not in GENERIC:
            return stage.replace("(other lines)", f"{code}:{f.f_lineno}")
        if stage is not None and generic is None:
            generic = stage
        if generic is not None:
            depth += 1
        if own is None and str(REPO) in name:
            own = f"{Path(name).relative_to(REPO)}:{code}:{f.f_lineno}"
        f = f.f_back
    return generic or own or f"{Path(frame.f_code.co_filename).name}:{frame.f_code.co_name}"


_LINES: dict[str, list[str]] = {}


def _line(filename: str, lineno: int) -> str:
    lines = _LINES.get(filename)
    if lines is None:
        try:
            lines = Path(filename).read_text().splitlines()
        except (OSError, UnicodeDecodeError):
            lines = []
        _LINES[filename] = lines
    # a frame sampled as its thread starts (or ends) may have no line yet
    return lines[lineno - 1] if lineno is not None and 0 < lineno <= len(lines) else ""


def role_of(thread: threading.Thread | None, main_id: int) -> str:
    if thread is None:
        return "other"
    if thread.ident == main_id:
        return "main"
    name = thread.name
    return name.rsplit("_", 1)[0] if "_" in name else name


def profile(argv: list[str], interval: float) -> dict:
    from ckpt_tool.cli import run

    samples: collections.Counter[str] = collections.Counter()
    by_role: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    waiting: collections.Counter[str] = collections.Counter()
    done = threading.Event()
    main_id = threading.main_thread().ident or 0
    ticks = [0]

    def sample() -> None:
        me = threading.get_ident()
        while not done.wait(interval):
            ticks[0] += 1
            threads = {t.ident: t for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                role = role_of(threads.get(ident), main_id)
                stage = stage_of(frame)
                if stage is None:
                    waiting[role] += 1
                    continue
                samples[stage] += 1
                by_role[role][stage] += 1

    sampler = threading.Thread(target=sample, name="stage_sampler", daemon=True)
    t = time.perf_counter()
    sampler.start()
    try:
        rc = run(argv)
    finally:
        done.set()
        sampler.join()
    wall = time.perf_counter() - t
    scale = wall / max(1, ticks[0])  # seconds per tick as it really ran (the sampler can be late)
    return {"argv": argv, "rc": rc, "wall_s": round(wall, 3), "ticks": ticks[0], "s_per_tick": round(scale, 5),
            "busy_thread_s": {k: round(v * scale, 3) for k, v in samples.most_common()},
            "busy_by_role": {r: {k: round(v * scale, 3) for k, v in c.most_common(12)} for r, c in by_role.items()},
            "waiting_thread_s": {k: round(v * scale, 3) for k, v in waiting.most_common()}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="write the profile here as JSON")
    ap.add_argument("--interval", type=float, default=0.005)
    ap.add_argument("--smoke", action="store_true", help="profile `ckpt inspect` of a 2,000-chunk .metadata made here")
    ap.add_argument("--workdir", default="/tmp/cli_stages_smoke", help="--smoke: where its input is made")
    ap.add_argument("argv", nargs=argparse.REMAINDER, help="-- then the ckpt command line")
    args = ap.parse_args()
    argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    if args.smoke:
        from types import SimpleNamespace

        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from bench_inspect import generate

        generate(Path(args.workdir), 2000, SimpleNamespace(chunks_per_key=100, chunk_numel=4096, files=4))
        argv = ["inspect", args.workdir, "--format", "json"]
    result = profile(argv, args.interval)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"{' '.join(argv)}: rc {result['rc']}, wall {result['wall_s']} s", file=sys.stderr)
    for stage, s in result["busy_thread_s"].items():
        print(f"  {s:8.2f} thread-s  {stage}", file=sys.stderr)
    print(f"  waiting: {result['waiting_thread_s']}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
