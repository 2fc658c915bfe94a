"""``verify --data``, ``export``, ``reshard`` and the save's upload on a bucket, against boto3's transfer manager.

Why: the target is at least 0.8x boto3's own transfer manager for the same objects. Measured in
one run, on moto's S3 server at 127.0.0.1 (``tests/helpers/s3_server.py``), on one checkpoint that the
launcher writes first (2 gloo ranks, one step):

* *upload*: the one writer's commit to a bucket (:class:`gtp_format.storage.upload.Upload`, what
  ``--save s3://`` and ``ckpt reshard ... s3://`` run after the files are written) of the finished
  folder, against ``upload_file`` of the same files;
* *verify --data*, *export --to hf* and *export --to torch* from the bucket (``ckpt`` in-process: every
  byte read by ranged requests, decoded and checked, or written out), against ``download_file`` of the
  same objects to a local folder, which is only the transfer that either would need first; and the same
  command on the local folder, the bound a faster transfer cannot beat.

Each workload runs ``--rounds`` times in turn with its baseline; the best round counts. The requests
each command sent (``GET`` s, ``HEAD`` s, listings) and the bytes per ``GET`` are counted by wrapping
obstore's functions: the profile that found export's 3545 ``GET`` s of 7.5 KB (docs/object-stores.md).

    python benchmarks/bench_s3_ckpt.py --write-docs
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "helpers"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

BUCKET = "bench"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, one round; never writes the docs")
    ap.add_argument("--write-docs", action="store_true", help="update docs/performance.md")
    ap.add_argument("--checkpoint", type=Path, help="an existing run folder to use instead of training one")
    ap.add_argument("--server-process", action="store_true",
                    help="run moto in a process of its own (by default in this one's threads, sharing its GIL)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.hidden, args.layers, args.rounds, args.write_docs = 64, 1, 1, False
    return args


def generate(args: argparse.Namespace, out: Path) -> Path:
    cmd = [sys.executable, "-m", "gtp_runtime.train", "--nproc-per-node", "2", "--device", "cpu", "--cp", "2",
           "--fold-cp", "--hidden", str(args.hidden), "--ffn-hidden", str(4 * args.hidden), "--num-heads", "4",
           "--num-layers", str(args.layers), "--seq-length", "16", "--vocab-size", "128", "--steps", "1",
           "--save", str(out)]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    if p.returncode != 0:
        raise SystemExit(f"generating the checkpoint failed:\n{p.stderr[-3000:]}")
    return out


def files_of(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file())


class Requests:
    """Counts obstore's requests (by function) and the bytes its ranged GETs asked for, thread-safe."""

    NAMES = ("get_range", "head", "list_with_delimiter", "get", "get_ranges")

    def __init__(self) -> None:
        import threading

        import obstore

        self.lock, self.calls, self.bytes = threading.Lock(), {n: 0 for n in self.NAMES}, 0
        for name in self.NAMES:
            setattr(obstore, name, self._wrap(name, getattr(obstore, name)))

    def _wrap(self, name: str, real):  # noqa: ANN001, ANN202 - obstore's own signatures
        def counted(*a, **k):  # noqa: ANN002, ANN003, ANN202
            with self.lock:
                self.calls[name] += 1
                self.bytes += int(k.get("length", 0))
            return real(*a, **k)
        return counted

    def take(self) -> tuple[int, int, int]:
        """(GETs, other requests, bytes asked for by GETs) since the last take."""
        with self.lock:
            gets, other = self.calls["get_range"] + self.calls["get"], sum(self.calls.values())
            out = (gets, other - gets, self.bytes)
            self.calls, self.bytes = {n: 0 for n in self.NAMES}, 0
        return out


def server_cost(client: object, prefix: str, folder: Path, files: list[Path]) -> str:
    """The test server's own cost of a request: one ranged ``GET`` of 64 KiB against one whole ``GET`` of the
    largest object (boto3, best of 5). moto copies the whole object to answer a ranged ``GET``, so there the
    small request costs most of the large one, and every request costs its object's size."""
    big = max(files, key=lambda p: p.stat().st_size)
    key = f"{prefix}/{big.relative_to(folder)}"

    def best(**kw: str) -> float:
        times = []
        for _ in range(5):
            t = time.perf_counter()
            client.get_object(Bucket=BUCKET, Key=key, **kw)["Body"].read()  # type: ignore[attr-defined]
            times.append(time.perf_counter() - t)
        return min(times)

    ranged, whole = best(Range="bytes=0-65535"), best()
    return (f"moto, one {big.stat().st_size / 1e6:.1f} MB object: a 64 KiB ranged GET takes {ranged * 1e3:.1f} ms, "
            f"the whole object {whole * 1e3:.1f} ms ({ranged / whole:.2f} of it)")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import boto3
    import s3_server
    from boto3.s3.transfer import TransferConfig
    from tabulate import tabulate

    from ckpt_tool.cli import run
    from gtp_format.storage import upload
    from gtp_format.storage.location import parse_location

    for k in s3_server.UNSET:
        os.environ.pop(k, None)
    server = s3_server.moto_process() if args.server_process else s3_server.moto_server()
    with tempfile.TemporaryDirectory(prefix="bench_s3_ckpt_") as tmp, server as endpoint:
        os.environ.update(s3_server.environment(endpoint))
        work = Path(tmp)
        run_dir = args.checkpoint or generate(args, work / "run")
        folder = sorted(run_dir.glob("iter_*"))[-1]
        files = files_of(folder)
        total = sum(p.stat().st_size for p in files)
        client = boto3.client("s3", endpoint_url=endpoint)
        client.create_bucket(Bucket=BUCKET)
        tm = TransferConfig()  # the defaults: 8 MiB parts, 10 threads
        best: dict[str, float] = {}
        requests: dict[str, tuple[int, int, int]] = {}
        counter = Requests()

        def keep(name: str, seconds: float) -> None:
            best[name] = min(seconds, best.get(name, float("inf")))

        for r in range(args.rounds):
            t = time.perf_counter()
            for p in files:
                client.upload_file(str(p), BUCKET, f"boto{r}/{p.relative_to(folder)}", Config=tm)
            keep("upload boto3", time.perf_counter() - t)
            target = parse_location(f"s3://{BUCKET}/ours{r}/{folder.name}")
            t = time.perf_counter()
            upload.Upload(target).run(folder)
            keep("upload ours", time.perf_counter() - t)
            url = str(target)
            down = work / f"down{r}"
            t = time.perf_counter()
            for p in files:
                rel = str(p.relative_to(folder))
                (down / rel).parent.mkdir(parents=True, exist_ok=True)
                client.download_file(BUCKET, f"ours{r}/{folder.name}/{rel}", str(down / rel), Config=tm)
            keep("download boto3", time.perf_counter() - t)
            shutil.rmtree(down)
            commands = {"verify --data": ["verify", "{src}", "--data", "--format", "json"],
                        "export --to hf": ["export", "{src}", "{dst}", "--to", "hf", "--format", "json"],
                        "export --to torch": ["export", "{src}", "{dst}", "--to", "torch", "--format", "json"],
                        # a new topology (dp 2 -> 1): every source chunk read, into a local folder
                        "reshard --dp 1": ["reshard", "{src}", "{dst}", "--dp", "1", "--format", "json"]}
            for name, argv_ in commands.items():
                for where, src in (("", url), (" local", str(folder))):
                    dst = work / f"out{r}{where.strip()}"
                    counter.take()
                    t = time.perf_counter()
                    with contextlib.redirect_stdout(io.StringIO()):
                        code = run([a.format(src=src, dst=dst) for a in argv_])
                    if code != 0:
                        raise SystemExit(f"{name} failed on {src}")
                    keep(name + where, time.perf_counter() - t)
                    if not where:
                        requests[name] = counter.take()
                    shutil.rmtree(dst, ignore_errors=True) if dst.is_dir() else dst.unlink(missing_ok=True)
            if r == 0:
                moto = server_cost(client, f"ours0/{folder.name}", folder, files)
                # reshard's requests without its read-ahead (as reshard read before it had one), once
                from gtp_format.reader import boxes

                real = boxes.BoxReader.prefetch_chunks
                boxes.BoxReader.prefetch_chunks = lambda self, order, budget=0: None  # type: ignore[method-assign]
                counter.take()
                with contextlib.redirect_stdout(io.StringIO()):
                    code = run(["reshard", url, str(work / "unplanned"), "--dp", "1"])
                unplanned = counter.take()
                boxes.BoxReader.prefetch_chunks = real  # type: ignore[method-assign]
                shutil.rmtree(work / "unplanned", ignore_errors=True)
    rows = [["upload (save's commit)", f"{best['upload ours']:.2f}", f"{best['upload boto3']:.2f}",
             f"{best['upload boto3'] / best['upload ours']:.2f}x", "", ""]]
    for name, (gets, other, nbytes) in requests.items():
        rows.append([name, f"{best[name]:.2f}", f"{best['download boto3']:.2f}",
                     f"{best['download boto3'] / best[name]:.2f}x", f"{best[name + ' local']:.2f}",
                     f"{gets} GET ({nbytes / max(1, gets) / 1e6:.2f} MB each), {other} other"])
    table = tabulate(rows, headers=["workload", "ours s", "boto3 s", "ratio (boto3 s / ours s)",
                                         "same command, local folder s", "requests of one run"], tablefmt="github")
    print(f"checkpoint: {len(files)} files, {total / 1e6:.1f} MB")
    print(table)
    print(moto)
    print(f"reshard --dp 1 without its read-ahead: {unplanned[0]} GET, {unplanned[1]} other")
    if args.write_docs:
        from docs_section import write_report

        write_report(
            "Checkpoints on a bucket (S3 API) against boto3",
            f"One checkpoint of {len(files)} files, {total / 1e6:.0f} MB (the launcher, 2 gloo ranks, cp 2 folded, "
            f"hidden {args.hidden}, {args.layers} layers, fp32, one step), on moto's S3 server at 127.0.0.1. "
            f"Baselines: boto3 {boto3.__version__}'s transfer manager (`upload_file` / `download_file`, defaults) "
            f"on the same files and objects. Best of {args.rounds} rounds, each workload beside its baseline. "
            f"Machine: {os.cpu_count()} CPU cores shared with other jobs, {platform.machine()}, Python "
            f"{platform.python_version()}.",
            f"python benchmarks/bench_s3_ckpt.py --hidden {args.hidden} --layers {args.layers} --rounds {args.rounds} "
            "--write-docs", table,
            ["- *verify --data* and *export* do all of their work (decode, hash, NaN counts; write the HF folder or "
             "the torch.save file) on top of the transfer; the baseline is the download alone, and the local "
             "column is the same command on the downloaded folder: no transfer, so the most a faster read could give.",
             f"- {moto}.",
             "- The server (moto on werkzeug) shares the 2 cores, so these ratios say little about a real store."])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
