"""Faults of the store: one line and exit 2 within a bounded time, never a hang or a traceback.

The misbehaving servers are tiny sockets on 127.0.0.1 written here: one that accepts and never
answers, one that answers every request with S3's own credential refusal.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import s3_server

from ckpt_tool.cli import run
from gtp_format.storage import objects

REFUSAL = (b"HTTP/1.1 403 Forbidden\r\nContent-Type: application/xml\r\nContent-Length: %d\r\n"
           b"Connection: close\r\n\r\n%s")
BODY = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>InvalidAccessKeyId</Code><Message>The AWS Access '
        b"Key Id you provided does not exist in our records.</Message></Error>")


@contextlib.contextmanager
def fake_server(answer: bytes | None) -> Iterator[tuple[str, list[int]]]:
    """A server on a free loopback port: ``answer`` sent to every request, or (None) silence while the
    connection stays open. Yields its endpoint and a list counting the connections it accepted."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    sock.settimeout(0.2)
    stop, held, count = threading.Event(), [], []

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = sock.accept()
            except OSError:
                continue
            count.append(1)
            if answer is None:
                held.append(conn)  # never answered, never closed until the test ends
                continue
            with conn:
                conn.settimeout(2)
                with contextlib.suppress(OSError):
                    conn.recv(65536)
                    conn.sendall(answer)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", count
    finally:
        stop.set()
        t.join(5)
        for c in held:
            c.close()
        sock.close()


@pytest.fixture
def env(monkeypatch):
    def point_at(endpoint: str) -> None:
        for k in s3_server.UNSET:
            monkeypatch.delenv(k, raising=False)
        for k, v in s3_server.environment(endpoint).items():
            monkeypatch.setenv(k, v)

    return point_at


def one_line(capsys, argv: list[str]) -> tuple[int, str, float]:
    t = time.monotonic()
    code = run(argv)
    took = time.monotonic() - t
    out = capsys.readouterr()
    lines = out.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ckpt: error: "), out.err
    return code, lines[0], took


def test_a_server_that_stops_answering(env, monkeypatch, capsys):
    with fake_server(None) as (endpoint, count):
        env(endpoint)
        monkeypatch.setenv(objects.TIMEOUT_ENV, "1")
        code, line, took = one_line(capsys, ["inspect", "s3://ckpt-test/run"])
    assert code == 2 and "did not answer" in line and objects.TIMEOUT_ENV in line, line
    assert took < 45, took  # 1 s per try, 3 retries with backoff, inside the 30 s retry budget
    assert len(count) >= 2  # it retried


def test_no_server_at_the_endpoint(env, capsys):
    env(f"http://127.0.0.1:{s3_server.free_port()}")  # nothing listens there: connection refused
    code, line, took = one_line(capsys, ["verify", "s3://ckpt-test/run"])
    assert code == 2 and "s3://ckpt-test/run" in line and took < 45, (line, took)


def test_wrong_credentials(env, capsys):
    with fake_server(REFUSAL % (len(BODY), BODY)) as (endpoint, count):
        env(endpoint)
        code, line, _ = one_line(capsys, ["inspect", "s3://ckpt-test/run"])
    assert code == 2 and "refused the credentials" in line and "AWS_ACCESS_KEY_ID" in line, line
    assert count


def test_no_credentials_sends_nothing(env, monkeypatch, capsys):
    with fake_server(REFUSAL % (len(BODY), BODY)) as (endpoint, count):
        env(endpoint)
        monkeypatch.delenv("AWS_ACCESS_KEY_ID")
        code, line, _ = one_line(capsys, ["show", "s3://ckpt-test/run", "some.key"])
    assert code == 2 and "no credentials in the environment" in line, line
    assert not count  # refused before any request, so no client falls back to the instance-metadata address


def test_a_bad_timeout_setting(env, monkeypatch, capsys):
    env("http://127.0.0.1:9")
    monkeypatch.setenv(objects.TIMEOUT_ENV, "soon")
    code, line, _ = one_line(capsys, ["inspect", "s3://ckpt-test/run"])
    assert code == 2 and f"{objects.TIMEOUT_ENV}='soon'" in line
