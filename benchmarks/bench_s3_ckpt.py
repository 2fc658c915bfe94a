"""``verify --data``, ``export --to hf`` and the save's upload on a bucket, against boto3's transfer manager.

Why: issue 28's target is at least 0.8x boto3's own transfer manager for the same objects. Measured in
one run, on moto's S3 server at 127.0.0.1 (``tests/helpers/s3_server.py``), on one checkpoint that the
launcher writes first (2 gloo ranks, one step):

* *upload*: the one writer's commit to a bucket (:class:`gtp_format.storage.upload.Upload`, what
  ``--save s3://`` and ``ckpt reshard ... s3://`` run after the files are written) of the finished
  folder, against ``upload_file`` of the same files;
* *verify --data* and *export --to hf* from the bucket (``ckpt`` in-process: every byte read by ranged
  requests, decoded and checked, or written out), against ``download_file`` of the same objects to a
  local folder, which is only the transfer that either would need first.

Each workload runs ``--rounds`` times in turn with its baseline; the best round counts.

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
    with tempfile.TemporaryDirectory(prefix="bench_s3_ckpt_") as tmp, s3_server.moto_server() as endpoint:
        os.environ.update(s3_server.environment(endpoint))
        work = Path(tmp)
        run_dir = generate(args, work / "run")
        folder = sorted(run_dir.glob("iter_*"))[-1]
        files = files_of(folder)
        total = sum(p.stat().st_size for p in files)
        client = boto3.client("s3", endpoint_url=endpoint)
        client.create_bucket(Bucket=BUCKET)
        tm = TransferConfig()  # the defaults: 8 MiB parts, 10 threads
        best: dict[str, float] = {}

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
            t = time.perf_counter()
            with contextlib.redirect_stdout(io.StringIO()):
                code = run(["verify", url, "--data", "--format", "json"])
            if code != 0:
                raise SystemExit("verify --data failed on the bucket")
            keep("verify --data", time.perf_counter() - t)
            t = time.perf_counter()
            with contextlib.redirect_stdout(io.StringIO()):
                code = run(["export", url, str(work / f"hf{r}"), "--to", "hf", "--format", "json"])
            if code != 0:
                raise SystemExit("export failed on the bucket")
            keep("export --to hf", time.perf_counter() - t)
            shutil.rmtree(work / f"hf{r}")
    rows = [
        ["upload (save's commit)", f"{best['upload ours']:.2f}", f"{best['upload boto3']:.2f}",
         f"{best['upload boto3'] / best['upload ours']:.2f}x"],
        ["verify --data", f"{best['verify --data']:.2f}", f"{best['download boto3']:.2f}",
         f"{best['download boto3'] / best['verify --data']:.2f}x"],
        ["export --to hf", f"{best['export --to hf']:.2f}", f"{best['download boto3']:.2f}",
         f"{best['download boto3'] / best['export --to hf']:.2f}x"],
    ]
    table = tabulate(rows, headers=["workload", "ours s", "boto3 s", "ratio (boto3 s / ours s)"], tablefmt="github")
    print(f"checkpoint: {len(files)} files, {total / 1e6:.1f} MB")
    print(table)
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
            ["- *verify --data* and *export* do all of their work (decode, hash, NaN counts; write the HF folder) "
             "on top of the transfer; the baseline is the download alone.",
             "- The server (moto on werkzeug) shares the 2 cores, so these ratios say little about a real store."])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
