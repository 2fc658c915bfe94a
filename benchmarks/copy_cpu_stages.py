"""What each byte of a copy costs in CPU, by stage: ``ckpt reshard``, ``export``, ``import``, ``verify --data``.

    python benchmarks/copy_cpu_stages.py --out cpu.json -- reshard SRC DST --tp 2 --cp 1 --no-fold-cp
    python benchmarks/copy_cpu_stages.py -- export SRC DST --to hf --optimizer
    python benchmarks/copy_cpu_stages.py --smoke --workdir W   # a small reshard made here (seconds)

The command runs in this process (``ckpt_tool.cli.run``) with the functions that do a copy's work per byte
wrapped in timers of the calling thread's own CPU clock (``time.thread_time``: user + system of that thread,
so a hash that releases the GIL is charged its own CPU, and a thread waiting for the GIL or the disk is
charged nothing). Stages nest (the source read inside the assembly of a box, say): each is charged its
exclusive time. What no stage names (the interpreter between the calls, the GIL's hand-overs, the plan, the
imports) is the process's CPU (``getrusage``: every thread, those already gone included) less their sum.

Why not the sampling profile (``benchmarks/cli_stages.py``): it samples wall time of Python frames, so a C
call that holds the GIL delays the sampler and a thread that waits on the disk looks busy; a CPU figure per
byte is what says whether a copy on a shared machine is bound by its own work. ``perf`` (where installed) says
the same by kernel and library symbol, without the stage names.

Output: CPU seconds and CPU s/GB (of the bytes the command wrote, or read for ``verify``) per stage, the
process total, wall time, and the most threads alive at once (a sampler every 10 ms), as a table and JSON.
"""

from __future__ import annotations

import argparse
import collections
import json
import resource
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

_CPU: collections.Counter[str] = collections.Counter()
_CALLS: collections.Counter[str] = collections.Counter()
_LOCK = threading.Lock()
_LOCAL = threading.local()


def process_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def timed(stage: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` charging its calling thread's CPU, less that of stages it calls, to ``stage``."""
    if getattr(fn, "_stage", None) is not None:
        return fn

    def call(*args: Any, **kwargs: Any) -> Any:
        stack = getattr(_LOCAL, "stack", None)
        if stack is None:
            stack = _LOCAL.stack = []
        stack.append(0.0)  # CPU of the stages nested inside this call
        t0 = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            spent = time.thread_time() - t0
            inner = stack.pop()
            if stack:
                stack[-1] += spent
            with _LOCK:
                _CPU[stage] += spent - inner
                _CALLS[stage] += 1

    call._stage = stage  # type: ignore[attr-defined]
    return call


def patch_method(cls: type, name: str, stage: str) -> None:
    setattr(cls, name, timed(stage, getattr(cls, name)))


def patch_function(orig: Callable[..., Any], stage: str) -> None:
    """Every module attribute bound to ``orig`` (``from x import f`` copies the name) now times it."""
    wrapped = timed(stage, orig)
    for mod in list(sys.modules.values()):
        d = getattr(mod, "__dict__", None)
        if not isinstance(d, dict):
            continue
        for k, v in list(d.items()):
            if v is orig:
                d[k] = wrapped


class _Proxy:
    """An object whose named methods are timed, everything else passed through."""

    def __init__(self, inner: Any, stages: dict[str, str]) -> None:
        self._inner = inner
        for name, stage in stages.items():
            setattr(self, name, timed(stage, getattr(inner, name)))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def install() -> None:
    """Wrap the per-byte work of the copy paths and of ``verify --data``."""
    import zlib

    import ckpt_tool.cli  # noqa: F401 - every module the commands use, so that patch_function finds the names
    import ckpt_tool.copying.writers as writers
    from ckpt_tool.copying.source import Source
    from gtp_format.check import data as vdata
    from gtp_format.check.integrity import ReadLedger
    from gtp_format.hashing import CRCS
    from gtp_format.integrity.stats import StatsStream
    from gtp_format.reader.boxes import BoxReader
    from gtp_format.storage.local import LocalFile
    from gtp_format.writer import sink

    patch_method(LocalFile, "read_into", "source read (preadv into the reader's buffer)")
    patch_method(LocalFile, "pread", "source read (pread, new bytes)")
    patch_method(ReadLedger, "record", "read ledger CRC-32C of the bytes read")
    patch_method(ReadLedger, "_gap", "read ledger gap reads + CRC (bytes no copy read)")
    patch_method(Source, "read_full_box", "box assembly (copies between buffers)")
    patch_method(BoxReader, "read_box", "box assembly (copies between buffers)")
    patch_method(BoxReader, "_permuted_rows", "box assembly (copies between buffers)")
    patch_method(StatsStream, "update", "chunk statistics (numba)")
    patch_method(sink.Sink, "_stage", "sink staging copy")
    patch_method(sink.Sink, "_put", "sink pwrite")
    patch_method(sink.Sink, "write_zeros", "sink zeros")
    patch_method(sink.Sink, "close", "sink close (fsync)")
    sink._write_all = timed("sink write (buffered: small stages)", sink._write_all)
    if hasattr(sink, "_pwrite_all"):
        sink._pwrite_all = timed("sink write (in-memory file system, no staging)", sink._pwrite_all)
    writers.zlib = _Proxy(zlib, {"crc32": "zip CRC-32 of a written blob"})  # type: ignore[assignment]
    init = sink.Sink.__init__

    def sink_init(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        if self._crc is not None:
            self._crc = _Proxy(self._crc, {"update": "sink CRC-32C of the output"})
        if self._seg is not None:
            self._seg = _Proxy(self._seg, {"update": "sink xxh3-128 chunk records"})

    sink.Sink.__init__ = sink_init  # type: ignore[method-assign]
    # verify --data: its workers' window steps
    for name, stage in (("_pread", "verify: window read"), ("work", "verify: window work (hash, parse, scan)")):
        for cls in (getattr(vdata, "_FilePass", None),):
            if cls is not None and hasattr(cls, name):
                patch_method(cls, name, stage)
    from gtp_format.storage import local

    local.read_range = timed("source read (read_range, a new buffer per range)", local.read_range)
    try:
        from ckpt_tool.hf.importer import HFModel

        patch_method(HFModel, "read_box", "import: box assembly from HF rows")
    except ImportError:
        pass
    from gtp_format import scan

    patch_function(scan.count_nonfinite, "NaN/Inf scan")
    patch_function(CRCS["crc32"].update, "zlib CRC-32 (other callers)")


def run(argv: list[str], nbytes: int | None = None) -> dict[str, Any]:
    install()
    from ckpt_tool.cli import run as cli_run

    peak = [threading.active_count()]
    done = threading.Event()

    def watch() -> None:
        while not done.wait(0.01):
            peak[0] = max(peak[0], threading.active_count() - 1)

    w = threading.Thread(target=watch, name="thread_counter", daemon=True)
    cpu0, t0 = process_cpu(), time.perf_counter()
    w.start()
    try:
        rc = cli_run(argv)
    finally:
        done.set()
        w.join()
    wall, cpu = time.perf_counter() - t0, process_cpu() - cpu0
    if nbytes is None:
        nbytes = _bytes_of(argv)
    gb = max(nbytes, 1) / 1e9
    staged = dict(_CPU.most_common())
    rest = cpu - sum(staged.values())
    rows = {**{k: round(v, 3) for k, v in staged.items()}, "other (interpreter, plan, GIL, imports)": round(rest, 3)}
    return {"argv": argv, "rc": rc, "gb": round(gb, 3), "wall_s": round(wall, 3), "cpu_s": round(cpu, 3),
            "cpu_s_per_gb": round(cpu / gb, 3), "peak_threads": peak[0],
            "stages_cpu_s": rows, "stages_cpu_s_per_gb": {k: round(v / gb, 3) for k, v in rows.items()},
            "calls": dict(_CALLS)}


def _bytes_of(argv: list[str]) -> int:
    """The bytes the command moved: DST's files for a copy (its second path), SRC's for ``verify``."""
    paths = [Path(a) for a in argv[1:] if not a.startswith("-") and Path(a).exists()]
    if not paths:
        return 0
    root = paths[-1] if argv[0] != "verify" else paths[0]
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def table(doc: dict[str, Any]) -> str:
    lines = [f"{' '.join(doc['argv'][:1])}: {doc['gb']} GB, wall {doc['wall_s']} s, CPU {doc['cpu_s']} s = "
             f"{doc['cpu_s_per_gb']} CPU s/GB, at most {doc['peak_threads']} threads"]
    for k, v in doc["stages_cpu_s_per_gb"].items():
        lines.append(f"  {v:7.3f} CPU s/GB  {doc['stages_cpu_s'][k]:8.3f} s  {k}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="write the result here as JSON")
    ap.add_argument("--smoke", action="store_true", help="reshard a small checkpoint made under --workdir")
    ap.add_argument("--workdir", default="/tmp/copy_cpu_stages_smoke")
    ap.add_argument("argv", nargs=argparse.REMAINDER, help="-- then the ckpt command line")
    args = ap.parse_args()
    argv = [a for a in args.argv if a != "--"] if args.argv else []
    if args.smoke:
        import shutil

        sys.path.insert(0, str(REPO / "benchmarks"))
        import bench_reshard

        work = Path(args.workdir)
        shutil.rmtree(work, ignore_errors=True)
        ns = argparse.Namespace(vocab=512, hidden=64, ffn=256)
        bench_reshard.make_source(work / "src", 2, ns)
        argv = ["reshard", str(work / "src"), str(work / "dst"), "--tp", "2", "--cp", "1", "--no-fold-cp"]
    if not argv:
        ap.error("give the ckpt command after --, or --smoke")
    doc = run(argv)
    print(table(doc), file=sys.stderr)
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=1))
    if args.smoke:
        shutil.rmtree(args.workdir, ignore_errors=True)
    return 0 if doc["rc"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
