"""A local S3-API server (moto's server mode) on 127.0.0.1, for the tests and ``benchmarks/bench_s3.py``.

Why moto's server and not its in-process mock: the code under test speaks HTTP to an endpoint
(``AWS_ENDPOINT_URL``), as it does against a real store, and the launcher's ranks and ``ckpt``
subprocesses reach the same server. Nothing leaves the machine: the server binds loopback only.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

DUMMY_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_REGION": "us-east-1",
    # no user config or credential files: a developer's own profile must not leak into a test
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    "AWS_EC2_METADATA_DISABLED": "true",
}
UNSET = ("AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_SECURITY_TOKEN")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def moto_server() -> Iterator[str]:
    """Start moto's ``ThreadedMotoServer`` on a free loopback port; yield its endpoint URL; stop it."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one access-log line per request otherwise
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


@contextlib.contextmanager
def moto_process() -> Iterator[str]:
    """moto's server in a process of its own on a free loopback port; yield its endpoint URL; stop it.

    For benchmarks: :func:`moto_server` runs in this process's threads, so the server holds the same GIL as
    the command it answers (at 26.5 MB a fetch thread idle at 24 ms took its request only at 57 ms).
    """
    import subprocess
    import sys
    import time

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        endpoint = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=2):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("moto's server process did not start") from None
                time.sleep(0.1)
        yield endpoint
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def reset(endpoint: str) -> None:
    """Forget every bucket and object (moto's own reset call), so tests sharing a server start empty."""
    req = urllib.request.Request(f"{endpoint}/moto-api/reset", method="POST")
    with urllib.request.urlopen(req, timeout=30) as r:
        r.read()


def environment(endpoint: str) -> dict[str, str]:
    """The AWS variables that point a client at ``endpoint`` with dummy credentials."""
    return {**DUMMY_ENV, "AWS_ENDPOINT_URL": endpoint}


def point_env(mp: Any, endpoint: str) -> None:
    """Point the environment (``mp``: a pytest ``MonkeyPatch``, so ranks and subprocesses see it too) at
    ``endpoint`` with dummy credentials."""
    for k in UNSET:
        mp.delenv(k, raising=False)
    for k, v in environment(endpoint).items():
        mp.setenv(k, v)


def point_at(mp: Any, endpoint: str, bucket: str) -> Any:
    """:func:`point_env`, then create ``bucket``; return a boto3 client of it (the tests' own view)."""
    import boto3

    point_env(mp, endpoint)
    client = boto3.client("s3", endpoint_url=endpoint)
    client.create_bucket(Bucket=bucket)
    return client


def upload_tree(client: Any, bucket: str, folder: Path, prefix: str) -> None:
    """Every file of ``folder`` as an object below ``prefix`` (boto3: independent of the code under test)."""
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            client.upload_file(str(p), bucket, f"{prefix}/{p.relative_to(folder)}")


def upload(s3: Any, folder: Path, prefix: str) -> str:
    """Every file of ``folder`` below ``prefix`` of the test bucket (``tests/s3/conftest.py:S3``); its URL."""
    upload_tree(s3.client, s3.bucket, folder, prefix)
    return str(s3.url(prefix))


def run_ckpt(capsys: Any, *argv: str) -> tuple[int, str, str]:
    """``ckpt ARGV`` in-process (``capsys``: pytest's capture): exit code, stdout, stderr."""
    from ckpt_tool.cli import run

    code = run(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err
