"""Where a checkpoint save's and load's time goes, one stage at a time, against ``dd`` in the same run.

    python benchmarks/ckpt_io_stages.py --device cuda --gb 8 --json stages.json

One process, synthetic chunks (256 MiB each, bf16 and fp32, like the runtime's bucket chunks). Each
row is one stage run alone over every chunk, as GB/s of checkpoint bytes, and ``gil``: how fast a
pure-Python thread spins meanwhile, against idle (1.0: the stage leaves the interpreter free, as a
training thread needs it; near 0: the stage holds the GIL). Stages: ``dd`` direct write and read;
the device-to-host copy into pageable memory (what DCP's writer does per item) and into pinned
buffers allocated once; the ``O_DIRECT`` sink alone (no checksums, then with CRC-32C and the chunk
hashes) over T files in parallel; ``torch.save`` into a null stream (its zip CRC-32); the runtime's
``write_rank_files`` (DCP + the sink) from pinned memory and from the device; DCP's own
``FileSystemWriter``; and loads: ``dcp.load`` through the runtime's reader, and ``O_DIRECT`` reads
into pinned buffers then a copy to the device. Page cache: every file is dropped from it
(``posix_fadvise(DONTNEED)``) before it is read.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from bench_ckpt_async import dd_rates  # the same dd baselines as the async-save benchmark
from bench_export_hf import evict

CHUNK = 256 << 20


class _Spin:
    """A pure-Python thread counting as fast as it can: its rate during a stage over its idle rate."""

    def __init__(self) -> None:
        self.n, self.stop = 0, False
        self.t = threading.Thread(target=self._run, daemon=True)
        self.t.start()
        time.sleep(0.05)
        n0 = self.n
        time.sleep(0.3)
        self.idle = (self.n - n0) / 0.3

    def _run(self) -> None:
        while not self.stop:
            self.n += 1

    def measure(self, fn: Any) -> tuple[float, float]:
        n0 = self.n
        time.sleep(0.2)  # the idle rate just before, so other load on the machine cancels out
        self.idle = (self.n - n0) / 0.2
        n0, t0 = self.n, time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        return dt, (self.n - n0) / dt / self.idle


def _drop(folder: Path) -> None:
    os.sync()
    evict(folder)


def _shares(items: list[Any], n: int) -> list[list[Any]]:
    out: list[list[Any]] = [[] for _ in range(n)]
    for i, x in enumerate(items):
        out[i % n].append(x)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--gb", type=float, default=8.0)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--threads", default="1,4,8")
    ap.add_argument("--json", default=None)
    ap.add_argument("--chunk-mib", type=int, default=CHUNK >> 20, help="bytes per synthetic chunk (default 256)")
    ap.add_argument("--smoke", action="store_true", help="tiny run (tests/benchmarks): 8 chunks of 4 MiB")
    args = ap.parse_args()
    if args.smoke:
        args.gb, args.chunk_mib, args.threads = 0.034, 4, "1,2"
    chunk = args.chunk_mib << 20
    from gtp_format.writer.sink import STAGE, Sink
    from gtp_runtime.checkpoint.dcp_chunks import ChunkLoadPlanner, Chunks
    from gtp_runtime.checkpoint.io import write_rank_files

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:  # a free port: two runs on one machine must not collide
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(sock.getsockname()[1])
    dist.init_process_group("gloo", rank=0, world_size=1)
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    n = max(2, int(args.gb * 1e9 // chunk))
    chunks = []
    for i in range(n):
        dt = torch.bfloat16 if i % 4 == 0 else torch.float32
        chunks.append(torch.randn(chunk // (2 if dt == torch.bfloat16 else 4), device=dev).to(dt))
    nbytes = sum(t.nbytes for t in chunks)
    gb = nbytes / 1e9
    root = Path(tempfile.mkdtemp(prefix="io_stages_", dir=args.dir))
    spin = _Spin()
    rows: list[dict[str, Any]] = []

    def row(stage: str, fn: Any, threads: int | None = None, sync: bool = True) -> float:
        if cuda and sync:
            torch.cuda.synchronize()
        dt, gil = spin.measure(lambda: (fn(), torch.cuda.synchronize() if cuda and sync else None))
        r = {"stage": stage, "threads": threads, "gbps": round(gb / dt, 3), "s": round(dt, 3), "gil": round(gil, 2)}
        rows.append(r)
        print(json.dumps(r), flush=True)
        return dt

    try:
        ddw, ddr = dd_rates(root / "dd.bin", nbytes)
        rows.append({"stage": "dd direct write", "gbps": round(ddw, 3)})
        rows.append({"stage": "dd direct read", "gbps": round(ddr, 3)})
        print(rows[-2], rows[-1], flush=True)
        pinned = [torch.empty(t.shape, dtype=t.dtype, pin_memory=cuda) for t in chunks]
        if cuda:
            row("pin alloc (once)", lambda: [torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                                             for t in chunks[:4]])
            row("D2H pageable .cpu()", lambda: [t.cpu() for t in chunks])
        row("D2H into pinned", lambda: [p.copy_(t, non_blocking=cuda) for p, t in zip(pinned, chunks)])
        flat = [p.view(torch.uint8).numpy() for p in pinned]
        threads = [int(x) for x in args.threads.split(",")]

        def sinks(k: int, checksum: bool, segments: bool) -> None:
            folder = root / f"sink_{k}_{checksum}"
            folder.mkdir()

            def one(j: int, arrs: list[np.ndarray]) -> None:
                s = Sink(folder / f"f{j}", STAGE, checksum=checksum, segments=segments)
                for a in arrs:
                    s.write([a])
                    s.cut()
                s.close()

            with ThreadPoolExecutor(k) as ex:
                list(ex.map(one, range(k), _shares(flat, k)))
            shutil.rmtree(folder)

        for k in threads:
            row("sink O_DIRECT, no hashes", lambda k=k: sinks(k, False, False), k, sync=False)
        for k in threads:
            row("sink O_DIRECT + crc32c + xxh3", lambda k=k: sinks(k, True, True), k, sync=False)

        class Null:
            def write(self, b: Any) -> int:
                return memoryview(b).nbytes

            def flush(self) -> None:
                pass

        def tsave(k: int) -> None:
            with ThreadPoolExecutor(k) as ex:
                list(ex.map(lambda ts: [torch.save(t, Null()) for t in ts], _shares(pinned, k)))

        for k in threads:
            row("torch.save to null", lambda k=k: tsave(k), k, sync=False)

        def sd_of(ts: list[torch.Tensor]) -> dict[str, Any]:
            sd = {}
            for i, t in enumerate(ts):
                c = Chunks((t.numel(),), t.dtype)
                c.add((0,), t)
                sd[f"k{i}"] = c
            return sd

        for src, ts in (("pinned", pinned), (args.device, chunks)):
            for k in threads[1:]:
                for integ in (True, False):
                    folder = root / f"w_{src}_{k}_{integ}"
                    folder.mkdir()
                    row(f"write_rank_files from {src}, integrity {integ}",
                        lambda f=folder, k=k, i=integ, ts=ts: write_rank_files(sd_of(ts), f, "torch_dist", k,
                                                                              integrity=i), k)
                    if not (src == "pinned" and k == threads[-1] and integ):
                        shutil.rmtree(folder)
        import torch.distributed.checkpoint as dcp

        plain = {f"k{i}": t for i, t in enumerate(pinned)}
        row("dcp.save (FileSystemWriter) from pinned", lambda: dcp.save(plain, checkpoint_id=str(root / "dcp")))
        shutil.rmtree(root / "dcp")
        folder = root / f"w_pinned_{threads[-1]}_True"
        dests = [torch.empty_like(t) for t in chunks]
        _drop(folder)
        row("dcp.load FileSystemReader into device",
            lambda: dcp.load(sd_of(dests), checkpoint_id=str(folder), planner=ChunkLoadPlanner()))
        files = sorted(folder.glob("*.distcp"))

        def raw_read(k: int) -> None:
            def one(p: Path) -> None:
                size = p.stat().st_size
                cap = size + (-size % 4096)
                buf = torch.empty(cap + 4096, dtype=torch.uint8, pin_memory=cuda)
                arr = buf.numpy()
                skip = -arr.ctypes.data % 4096
                fd = os.open(p, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
                try:
                    done, view = 0, memoryview(arr[skip:skip + cap])
                    step = 64 << 20
                    while done < size:
                        got = os.preadv(fd, [view[done:done + step]], done)
                        if got <= 0:
                            break
                        done += got
                finally:
                    os.close(fd)
                if cuda:
                    torch.empty(size, dtype=torch.uint8, device=dev).copy_(buf[skip:skip + size], non_blocking=True)
            with ThreadPoolExecutor(k) as ex:
                list(ex.map(one, files))
        for k in threads[1:]:
            _drop(folder)
            row("O_DIRECT read into pinned + H2D (per file)", lambda k=k: raw_read(k), k)
    finally:
        spin.stop = True
        shutil.rmtree(root, ignore_errors=True)
        dist.destroy_process_group()
    out = {"device": torch.cuda.get_device_name() if cuda else "cpu", "gb": round(gb, 3),
           "cores": os.cpu_count(), "torch": torch.__version__, "rows": rows}
    print(json.dumps(out))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
