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


def reset(endpoint: str) -> None:
    """Forget every bucket and object (moto's own reset call), so tests sharing a server start empty."""
    req = urllib.request.Request(f"{endpoint}/moto-api/reset", method="POST")
    with urllib.request.urlopen(req, timeout=30) as r:
        r.read()


def environment(endpoint: str) -> dict[str, str]:
    """The AWS variables that point a client at ``endpoint`` with dummy credentials."""
    return {**DUMMY_ENV, "AWS_ENDPOINT_URL": endpoint}
