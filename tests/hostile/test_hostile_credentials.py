"""Hostile credential services: STS web identity, the container endpoint, the instance metadata service.

Each is a scripted endpoint on 127.0.0.1 (``fake_endpoint``) answering ``ckpt inspect s3://...`` with
something no genuine service sends: a huge answer (declared or streamed), XML nested deep or declaring
entities, text that does not parse, JSON nested past the parser's limit, keys with a line break, expired
keys, an expiry without a zone, an error whose message holds a secret, a redirect elsewhere, silence, a
trickle, an answer cut short (the service dying mid-answer). Every case: exit 2, one line naming the source
and no secret, within seconds and without memory growing by what the answer holds, and no request reached
the bucket's endpoint (nothing was signed with what the service sent) nor the place a redirect pointed to.
On main, these services were asked by obstore (its whole answer read, redirects followed, its whole retry
budget waited), and the tool's own listing refused to run without static keys.
"""

from __future__ import annotations

import contextlib
import os
import resource
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import fake_endpoint
import pytest
from fake_endpoint import Request, container_answer, later, sts_answer
from s3_server import point_env
from s3_server import run_ckpt as ckpt

from gtp_format.storage import credentials

SECRET = "s3cr3t-FROM-HOSTILE-7d1e"
URL = "s3://ckpt-test/run"
HUGE = 60 << 20
STOP = threading.Event()


@pytest.fixture
def store(monkeypatch) -> Iterator[fake_endpoint.Endpoint]:
    """The bucket's endpoint (records requests, answers none usefully); no static keys, no profile."""
    with fake_endpoint.serve(lambda req: req.reply(500)) as ep:
        point_env(monkeypatch, ep.url)
        for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_EC2_METADATA_DISABLED"):
            monkeypatch.delenv(k, raising=False)
        # never the real link-local services of wherever the tests run: a closed loopback port instead
        monkeypatch.setattr(credentials, "CONTAINER_HOST", "127.0.0.1:9")
        monkeypatch.setattr(credentials, "METADATA_ENDPOINT", "http://127.0.0.1:9")
        STOP.clear()
        yield ep
        STOP.set()


def refused(capsys, store: fake_endpoint.Endpoint, *words: str, seconds: float = 15.0) -> str:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t = time.monotonic()
    code, out, err = ckpt(capsys, "inspect", URL)
    took = time.monotonic() - t
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("ckpt: error: "), (code, out, err)
    assert "Traceback" not in out + err and SECRET not in out + err, err
    for w in words:
        assert w in lines[0], (w, lines[0])
    assert not store.requests, "a request reached the bucket, signed with what the service sent"
    assert took < seconds and grown_mb < 40, (took, grown_mb, lines[0])
    return lines[0]


# -- answers ---------------------------------------------------------------------------------------------------

def whole(body: bytes, code: int = 200) -> Callable[[Request], None]:
    return lambda req: req.reply(code, body)


def streamed(head: bytes, block: bytes, size: int, declared: bool) -> Callable[[Request], None]:
    def answer(req: Request) -> None:
        n = size // len(block) + 1
        out = req.start(200, {"Content-Length": str(len(head) + n * len(block))} if declared else {})
        with contextlib.suppress(OSError):  # the client hangs up past its budget
            out.write(head)
            for _ in range(n):
                out.write(block)
    return answer


def silent(req: Request) -> None:
    STOP.wait(20)  # answers nothing until the test ends


def trickle(req: Request) -> None:
    out = req.start(200, {"Content-Length": "1000"})
    with contextlib.suppress(OSError):
        for _ in range(200):
            if STOP.wait(0.3):
                return
            out.write(b" ")
            out.flush()


def trickled_headers(req: Request) -> None:
    """The status line, then one header a byte per receive (each within the socket's timeout): no body ever."""
    out = req.handler.wfile
    with contextlib.suppress(OSError):
        out.write(b"HTTP/1.1 200 OK\r\nX-Slow: ")
        out.flush()
        for _ in range(200):
            if STOP.wait(0.3):
                return
            out.write(b"a")
            out.flush()


def cut(body: bytes) -> Callable[[Request], None]:
    """The service dies mid-answer: its length declared, a third of it sent, the connection closed."""
    def answer(req: Request) -> None:
        out = req.start(200, {"Content-Length": str(len(body))})
        out.write(body[: len(body) // 3])
        out.flush()
        req.handler.close_connection = True
        with contextlib.suppress(OSError):
            req.handler.connection.shutdown(2)
    return answer


def sts(key: str = "ASIAKEY", secret: str = SECRET, token: str = "TOKEN", expiration: str = "") -> bytes:
    return sts_answer(key, secret, token, expiration or later())


def box(key: str = "ASIAKEY", secret: str = SECRET, token: str = "TOKEN", expiration: str = "") -> bytes:
    return container_answer(key, secret, token, expiration or later())


AN_HOUR_AGO = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - 3600))
ERROR = (b'<ErrorResponse xmlns="https://sts.amazonaws.com/doc/2011-06-15/"><Error><Type>Sender</Type><Code>'
         b"AccessDenied</Code><Message>Not authorized: " + SECRET.encode() + b"</Message></Error></ErrorResponse>")
LAUGHS = (b'<?xml version="1.0"?><!DOCTYPE l [<!ENTITY a "' + SECRET.encode() + b'"><!ENTITY b "&a;&a;&a;&a;">]>'
          b"<AssumeRoleWithWebIdentityResponse>&b;</AssumeRoleWithWebIdentityResponse>")

STS_CASES = {
    "huge-declared": (streamed(b"<AssumeRoleWithWebIdentityResponse>", b"<x/>" * 4096, HUGE, True),
                      "more than any credential answer"),
    "huge-streamed": (streamed(b"<AssumeRoleWithWebIdentityResponse>", b"<x/>" * 4096, HUGE, False), "over 64 KiB"),
    "deep": (whole(b"<AssumeRoleWithWebIdentityResponse>" + b"<a>" * 500 + b"</a>" * 500 +
                   b"</AssumeRoleWithWebIdentityResponse>"), "nested over 8 deep"),
    "entities": (whole(LAUGHS), "declares a document type"),
    "malformed": (whole(b"<AssumeRoleWithWebIdentityResponse><Credentials>"), "does not parse"),
    "other-root": (whole(b"<ListBucketResult><AccessKeyId>k</AccessKeyId></ListBucketResult>"),
                   "not an AssumeRoleWithWebIdentityResponse"),
    "no-secret": (whole(sts().replace(b"SecretAccessKey", b"Secret")), "without the secret"),
    "secret-with-a-header": (whole(sts(secret=SECRET + "\r\nX-Injected: 1")), "without the secret"),
    "error-holding-a-secret": (whole(ERROR, 403), "refused the role (HTTP 403 AccessDenied)"),
    "expired": (whole(sts(expiration=AN_HOUR_AGO)), "expired at"),
    "expiry-without-zone": (whole(sts(expiration="2099-01-01T00:00:00")), "not a time with a zone"),
    "cut": (cut(sts()), "the answer was cut"),
}


@pytest.mark.parametrize("case", list(STS_CASES))
def test_a_hostile_sts_answer(store, capsys, monkeypatch, tmp_path: Path, case):
    answer, words = STS_CASES[case]
    (tmp_path / "jwt").write_text("eyJ.jwt.sig")
    with fake_endpoint.serve(answer) as ep:
        monkeypatch.setenv("AWS_WEB_IDENTITY_TOKEN_FILE", str(tmp_path / "jwt"))
        monkeypatch.setenv("AWS_ROLE_ARN", "arn:aws:iam::1:role/r")
        monkeypatch.setenv("AWS_ENDPOINT_URL_STS", ep.url)
        line = refused(capsys, store, words, "AWS_WEB_IDENTITY_TOKEN_FILE")
        assert ep.count() == 1, (ep.count(), line)  # refused, not retried


CONTAINER_CASES = {
    "huge-declared": (streamed(b'{"AccessKeyId": "', b"k" * 4096, HUGE, True), "more than any credential answer"),
    "huge-streamed": (streamed(b'{"AccessKeyId": "', b"k" * 4096, HUGE, False), "over 64 KiB"),
    "deep": (whole(b"[" * 60000 + b"]" * 60000), "more than any credential answer (64 KiB)"),
    "deep-within-budget": (whole(b"[" * 30000 + b"]" * 30000), "nested too deeply"),
    "not-json": (whole(b"<html>login</html>"), "does not parse"),
    "not-an-object": (whole(b"[]"), "not an object"),
    "nan-key": (whole(b'{"AccessKeyId": NaN}'), "without the access key id"),
    "huge-integer": (whole(b'{"AccessKeyId": ' + b"9" * 5000 + b"}"), "does not parse"),
    "key-with-a-space": (whole(box(key="ASIA KEY")), "without the access key id"),
    "no-token": (whole(box().replace(b'"Token"', b'"Tok"')), "without the session token"),
    "expired": (whole(box(expiration=AN_HOUR_AGO)), "expired at"),
    "refused": (whole(b"{}", 401), "refused (HTTP 401)"),
    "silent": (silent, "did not answer with credentials within 2 s"),
    "trickle": (trickle, "still sending its answer after 2 s"),
    "trickled-headers": (trickled_headers, "did not answer with credentials within 2 s (timed out)"),
    "cut": (cut(box()), "the answer was cut"),
}


@pytest.mark.parametrize("case", list(CONTAINER_CASES))
def test_a_hostile_container_answer(store, capsys, monkeypatch, case):
    answer, words = CONTAINER_CASES[case]
    with fake_endpoint.serve(answer) as ep:
        monkeypatch.setenv("AWS_CONTAINER_CREDENTIALS_FULL_URI", ep.url + "/creds")
        refused(capsys, store, words, "AWS_CONTAINER_CREDENTIALS_FULL_URI", ep.url)


def test_a_credential_endpoint_that_redirects_elsewhere(store, capsys, monkeypatch, tmp_path: Path):
    """The token is never sent where an answer points: a 302 (and a 307, which would repeat a POST) are one line."""
    with fake_endpoint.serve(lambda req: req.reply(200, box())) as elsewhere:
        for code in (302, 307):
            to = {"Location": elsewhere.url + "/steal"}
            with fake_endpoint.serve(lambda req, code=code, to=to: req.reply(code, b"", headers=to)) as ep:
                monkeypatch.setenv("AWS_CONTAINER_CREDENTIALS_FULL_URI", ep.url + "/creds")
                monkeypatch.setenv("AWS_CONTAINER_AUTHORIZATION_TOKEN", SECRET)
                refused(capsys, store, f"redirect (HTTP {code})", "AWS_CONTAINER_CREDENTIALS_FULL_URI")
                (tmp_path / "jwt").write_text(SECRET)
                monkeypatch.delenv("AWS_CONTAINER_CREDENTIALS_FULL_URI")
                monkeypatch.setenv("AWS_WEB_IDENTITY_TOKEN_FILE", str(tmp_path / "jwt"))
                monkeypatch.setenv("AWS_ROLE_ARN", "arn:aws:iam::1:role/r")
                monkeypatch.setenv("AWS_ENDPOINT_URL_STS", ep.url)
                refused(capsys, store, f"redirect (HTTP {code})", "AWS_WEB_IDENTITY_TOKEN_FILE")
                monkeypatch.delenv("AWS_WEB_IDENTITY_TOKEN_FILE")
    assert not elsewhere.requests, "a credential request followed a redirect"


def test_a_slow_sts_meets_its_deadline(store, capsys, monkeypatch, tmp_path: Path):
    monkeypatch.setattr(credentials, "STS_SECONDS", 2.0)
    (tmp_path / "jwt").write_text("t")
    with fake_endpoint.serve(silent) as ep:
        monkeypatch.setenv("AWS_WEB_IDENTITY_TOKEN_FILE", str(tmp_path / "jwt"))
        monkeypatch.setenv("AWS_ROLE_ARN", "arn:aws:iam::1:role/r")
        monkeypatch.setenv("AWS_ENDPOINT_URL_STS", ep.url)
        refused(capsys, store, "did not answer with credentials within 2 s", seconds=8)


def imds(role: bytes = b"r", keys: Callable[[Request], None] | None = None, token_code: int = 200,
         roles: Callable[[Request], None] | None = None):
    def answer(req: Request) -> None:
        if req.method == "PUT":
            req.reply(token_code, b"T" if token_code == 200 else b"")
        elif req.path.endswith("/security-credentials/"):
            (roles or whole(role))(req)
        elif keys is not None:
            keys(req)
        else:
            req.reply(200, box())
    return answer


IMDS_CASES = {
    "role-that-is-a-path": (imds(role=b"../../latest/user-data"), "names no IAM role"),
    "huge-role-list": (imds(roles=streamed(b"", b"r" * 4096, HUGE, True)), "more than any credential answer"),
    "token-refused": (imds(token_code=403), "refused a session token (HTTP 403)"),
    "expired": (imds(keys=whole(box(expiration=AN_HOUR_AGO))), "expired at"),
    "huge-keys": (imds(keys=streamed(b"{", b" " * 4096, HUGE, False)), "over 64 KiB"),
}


@pytest.mark.parametrize("case", list(IMDS_CASES))
def test_a_hostile_instance_metadata_service(store, capsys, monkeypatch, case):
    answer, words = IMDS_CASES[case]
    with fake_endpoint.serve(answer) as ep:
        monkeypatch.setenv("AWS_METADATA_ENDPOINT", ep.url)
        refused(capsys, store, words, "instance metadata service")


@pytest.mark.parametrize(("var", "value", "words"), [
    ("AWS_CONTAINER_CREDENTIALS_FULL_URI", "http://192.0.2.7/creds", "nor http:// to a loopback address"),
    ("AWS_CONTAINER_CREDENTIALS_FULL_URI", "file:///etc/passwd", "is not an https:// URL"),
    ("AWS_ENDPOINT_URL_STS", "http://192.0.2.7", "AWS_ENDPOINT_URL_STS='http://192.0.2.7' is not an https:// URL"),
    ("AWS_ENDPOINT_URL_STS", "https://[::1", "is not an https:// URL"),
    ("AWS_CONTAINER_CREDENTIALS_FULL_URI", "http://127.0.0.1:99999/c", "is not an https:// URL"),
    ("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "@192.0.2.7/creds", "is not a path starting with '/'"),
    ("AWS_METADATA_ENDPOINT", "http://[fd00:ec2::254", "AWS_METADATA_ENDPOINT"),
])
def test_a_credential_url_the_token_must_not_go_to(store, capsys, monkeypatch, tmp_path: Path, var, value, words):
    """Plain HTTP elsewhere than loopback (or the container addresses) would carry the token in the clear: refused
    before anything is sent (192.0.2.7 is a documentation address: a request there would hang, not answer)."""
    monkeypatch.setenv(var, value)
    if var == "AWS_ENDPOINT_URL_STS":
        (tmp_path / "jwt").write_text("t")
        monkeypatch.setenv("AWS_WEB_IDENTITY_TOKEN_FILE", str(tmp_path / "jwt"))
        monkeypatch.setenv("AWS_ROLE_ARN", "arn:aws:iam::1:role/r")
    refused(capsys, store, words, seconds=3)


@pytest.mark.parametrize("kind", ["fifo", "directory", "sparse-1GiB", "missing", "two-lines"])
def test_a_hostile_token_file(store, capsys, monkeypatch, tmp_path: Path, kind):
    """The web identity token file: never a hang on a FIFO, never read past 64 KiB, one token only."""
    path = tmp_path / "jwt"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    elif kind == "sparse-1GiB":
        with open(path, "wb") as f:
            f.truncate(1 << 30)
    elif kind == "two-lines":
        path.write_text(f"eyJ.a.b\n{SECRET}\n")
    words = {"fifo": "not a regular file", "directory": "not a regular file", "sparse-1GiB": "over 64 KiB",
             "missing": "cannot be read", "two-lines": "does not hold one token"}[kind]
    with fake_endpoint.serve(lambda req: req.reply(200, sts())) as ep:
        monkeypatch.setenv("AWS_WEB_IDENTITY_TOKEN_FILE", str(path))
        monkeypatch.setenv("AWS_ROLE_ARN", "arn:aws:iam::1:role/r")
        monkeypatch.setenv("AWS_ENDPOINT_URL_STS", ep.url)
        refused(capsys, store, words, "AWS_WEB_IDENTITY_TOKEN_FILE", seconds=5)
    assert not ep.requests


DIES = r"""
import os, signal, socket, sys
s = socket.socket()
s.bind(("127.0.0.1", 0))
s.listen(4)
print(s.getsockname()[1], flush=True)
conn, _ = s.accept()
conn.recv(65536)
body = sys.argv[1].encode()
conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
             + body[: len(body) // 2])
os.kill(os.getpid(), signal.SIGKILL)  # the service dies mid-answer
"""


def test_a_credential_service_that_dies_mid_answer(store, capsys, monkeypatch):
    """Fault: the container endpoint's process is killed after half its answer; one line, nothing signed."""
    import subprocess
    import sys

    p = subprocess.Popen([sys.executable, "-c", DIES, box().decode()], stdout=subprocess.PIPE, text=True)
    try:
        port = int(p.stdout.readline())
        monkeypatch.setenv("AWS_CONTAINER_CREDENTIALS_FULL_URI", f"http://127.0.0.1:{port}/creds")
        refused(capsys, store, "the answer was cut", "AWS_CONTAINER_CREDENTIALS_FULL_URI")
        assert p.wait(10) == -9
    finally:
        if p.poll() is None:
            p.kill()
        p.wait()
