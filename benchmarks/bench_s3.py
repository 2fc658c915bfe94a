"""Object-store clients against boto3's transfer manager, on the same objects in the same run.

Why: the S3 client is chosen by measurement among well-kept libraries: fsspec
with s3fs, and obstore (Rust's ``object_store`` behind Python bindings); the baseline is boto3's own
transfer manager (``upload_file`` / ``download_file``, multipart and threaded), which is what a user
would run to copy a checkpoint by hand. Three workloads, each on the same objects for every client:

* *write*: each local file uploaded to its own key (multipart where the client does it);
* *read whole*: each object downloaded to a local file;
* *ranged read*: every object read as ``--range-mib`` ranges into memory, the way ``verify --data``
  and ``export`` read chunks. boto3 has no ranged bulk call, so its baseline here is ``get_object``
  with a ``Range`` header on a thread pool of the transfer manager's default size (10).

The server is moto's (``tests/helpers/s3_server.py``) on 127.0.0.1, so absolute figures are the
local server's, not a real store's; the ratios say which client loses least on top of it. Each
client runs once per round, rounds interleave the clients, the best round counts.

    python benchmarks/bench_s3.py --write-docs
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "helpers"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

BUCKET = "bench"
THREADS = 10  # boto3's TransferConfig default max_concurrency; the others get the same


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--objects", type=int, default=4, help="objects per workload (default: 4)")
    ap.add_argument("--object-mib", type=int, default=64, help="size of each object in MiB (default: 64)")
    ap.add_argument("--range-mib", type=int, default=8, help="ranged reads: bytes per request in MiB (default: 8)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds; the best counts (default: 3)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, one round; never writes the docs")
    ap.add_argument("--write-docs", action="store_true", help="update docs/performance.md")
    args = ap.parse_args(argv)
    if args.smoke:
        args.objects, args.object_mib, args.range_mib, args.rounds, args.write_docs = 2, 2, 1, 1, False
    return args


class Clients:
    """The three clients, each pointed at the local server through the standard AWS environment."""

    def __init__(self, endpoint: str) -> None:
        import boto3
        import obstore
        import s3fs
        from boto3.s3.transfer import TransferConfig
        from obstore.store import S3Store

        self.boto = boto3.client("s3", endpoint_url=endpoint)
        self.tm = TransferConfig(max_concurrency=THREADS)
        self.fs = s3fs.S3FileSystem(endpoint_url=endpoint, max_concurrency=THREADS)
        self.ob = obstore
        self.store = S3Store(BUCKET, endpoint=endpoint, client_options={"allow_http": True})

    # -- write --------------------------------------------------------------------------------
    def write_boto3(self, local: Path, key: str) -> None:
        self.boto.upload_file(str(local), BUCKET, key, Config=self.tm)

    def write_s3fs(self, local: Path, key: str) -> None:
        self.fs.put_file(str(local), f"{BUCKET}/{key}")

    def write_obstore(self, local: Path, key: str) -> None:
        self.ob.put(self.store, key, local, chunk_size=8 << 20, max_concurrency=THREADS)

    # -- read whole ---------------------------------------------------------------------------
    def read_boto3(self, key: str, local: Path) -> None:
        self.boto.download_file(BUCKET, key, str(local), Config=self.tm)

    def read_s3fs(self, key: str, local: Path) -> None:
        self.fs.get_file(f"{BUCKET}/{key}", str(local))

    def read_obstore(self, key: str, local: Path) -> None:
        with open(local, "wb") as f:
            for part in self.ob.get(self.store, key).stream(min_chunk_size=8 << 20):
                f.write(memoryview(part))

    # -- ranged -------------------------------------------------------------------------------
    def ranged_boto3(self, key: str, ranges: list[tuple[int, int]]) -> int:
        def one(r: tuple[int, int]) -> int:
            body = self.boto.get_object(Bucket=BUCKET, Key=key, Range=f"bytes={r[0]}-{r[1] - 1}")["Body"]
            return len(body.read())

        with ThreadPoolExecutor(THREADS) as pool:
            return sum(pool.map(one, ranges))

    def ranged_s3fs(self, key: str, ranges: list[tuple[int, int]]) -> int:
        got = self.fs.cat_ranges([f"{BUCKET}/{key}"] * len(ranges), [a for a, _ in ranges], [b for _, b in ranges])
        return sum(len(g) for g in got)

    def ranged_obstore(self, key: str, ranges: list[tuple[int, int]]) -> int:
        got = self.ob.get_ranges(self.store, key, starts=[a for a, _ in ranges], ends=[b for _, b in ranges])
        return sum(len(memoryview(g)) for g in got)


CLIENTS = ("boto3", "s3fs", "obstore")


def timed(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def measure(args: argparse.Namespace, endpoint: str, work: Path) -> dict[str, dict[str, float]]:
    """Best seconds per (workload, client) over the rounds."""
    c = Clients(endpoint)
    c.boto.create_bucket(Bucket=BUCKET)
    size = args.object_mib << 20
    files = []
    for i in range(args.objects):
        p = work / f"src_{i}.bin"
        with open(p, "wb") as f:
            f.write(os.urandom(size))
        files.append(p)
    step = args.range_mib << 20
    ranges = [(a, min(a + step, size)) for a in range(0, size, step)]
    best: dict[str, dict[str, float]] = {w: {} for w in ("write", "read whole", "ranged read")}

    def keep(workload: str, client: str, seconds: float) -> None:
        best[workload][client] = min(seconds, best[workload].get(client, float("inf")))

    for r in range(args.rounds):
        order = CLIENTS[r % 3:] + CLIENTS[:r % 3]  # each client goes first in some round
        for name in order:
            keys = [f"{name}/obj_{i}" for i in range(args.objects)]
            write = getattr(c, f"write_{name}")
            keep("write", name, timed(lambda w=write, k=keys: [w(f, key) for f, key in zip(files, k)]))
            for key in keys:
                if c.boto.head_object(Bucket=BUCKET, Key=key)["ContentLength"] != size:
                    raise SystemExit(f"{name} wrote {key} with the wrong size")
            read = getattr(c, f"read_{name}")
            outs = [work / f"out_{name}_{i}.bin" for i in range(args.objects)]
            keep("read whole", name, timed(lambda rd=read, k=keys, o=outs: [rd(key, p) for key, p in zip(k, o)]))
            for p in outs:
                if p.stat().st_size != size:
                    raise SystemExit(f"{name} read {p.name} with the wrong size")
                p.unlink()
            ranged = getattr(c, f"ranged_{name}")
            got: list[int] = []
            keep("ranged read", name, timed(lambda rg=ranged, k=keys, g=got: g.extend(rg(key, ranges) for key in k)))
            if got != [size] * args.objects:
                raise SystemExit(f"{name} ranged reads returned {got}, expected {size} each")
    return best


def report(args: argparse.Namespace, best: dict[str, dict[str, float]]) -> tuple[str, list[list[Any]]]:
    from tabulate import tabulate

    total = args.objects * (args.object_mib << 20)
    rows = []
    for workload, secs in best.items():
        for name in CLIENTS:
            rows.append([workload, name, f"{secs[name]:.2f}", f"{total / secs[name] / 1e6:.0f}",
                         f"{secs['boto3'] / secs[name]:.2f}x"])
    headers = ["workload", "client", "best s", "MB/s", "vs boto3 (higher is faster)"]
    return tabulate(rows, headers=headers, tablefmt="github"), rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import s3_server

    for k in s3_server.UNSET:
        os.environ.pop(k, None)
    with s3_server.moto_server() as endpoint, tempfile.TemporaryDirectory(prefix="bench_s3_") as tmp:
        os.environ.update(s3_server.environment(endpoint))
        best = measure(args, endpoint, Path(tmp))
    table, _ = report(args, best)
    print(table)
    if args.write_docs:
        import boto3
        import obstore
        import s3fs
        from docs_section import write_report

        write_report(
            "Object-store clients (S3 API)",
            f"{args.objects} objects of {args.object_mib} MiB each, random bytes, on moto's S3 server "
            f"(`ThreadedMotoServer`) at 127.0.0.1; ranged reads of {args.range_mib} MiB. boto3 "
            f"{boto3.__version__} (transfer manager, {THREADS} threads), s3fs {s3fs.__version__}, obstore "
            f"{obstore.__version__}; best of {args.rounds} interleaved rounds. Machine: {os.cpu_count()} CPU cores "
            f"shared with other jobs, {platform.machine()}, Python {platform.python_version()}.",
            "python benchmarks/bench_s3.py --write-docs", table,
            ["- The server is Python (moto on werkzeug) on the same 2 cores, so it bounds every client; the ratios "
             "say what each client adds on top of it. A real store's figures are not these."])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
