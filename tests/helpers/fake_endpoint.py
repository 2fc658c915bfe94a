"""A scripted HTTP endpoint on 127.0.0.1 for the tests: an S3 imitation's listing pages, STS, the container and
instance-metadata credential services, each answering as a test's function says (hostile answers included).

``serve(answer)`` runs a threaded ``http.server`` on a free loopback port and calls ``answer(request)`` for every
request of any method; :class:`Request` carries what was asked (method, path, query, headers, body) and the
ways to answer (:meth:`Request.reply`, or the raw ``wfile`` for a stream, a trickle or a cut). Every request
is recorded in :attr:`Endpoint.requests`. Nothing leaves the machine: the server binds loopback only.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

MISSING = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>NoSuchKey</Code><Message>The specified key does '
           b"not exist.</Message></Error>")


@dataclass
class Request:
    method: str
    path: str  # without the query
    query: dict[str, list[str]]
    headers: dict[str, str]  # names lower-cased
    body: bytes
    handler: Any = field(repr=False)  # the BaseHTTPRequestHandler: wfile for raw answers

    def q(self, name: str, default: str = "") -> str:
        return self.query.get(name, [default])[0]

    def start(self, code: int, headers: dict[str, str] | None = None) -> Any:
        """Send the status line and ``headers``; return the stream to write the body to (a write to a client
        that hung up raises OSError: wrap it in ``contextlib.suppress(OSError)``)."""
        h = self.handler
        h.send_response(code)
        for k, v in (headers or {}).items():
            h.send_header(k, v)
        h.end_headers()
        return h.wfile

    def reply(self, code: int, body: bytes = b"", content_type: str = "application/xml",
              headers: dict[str, str] | None = None) -> None:
        """A whole answer with its ``Content-Length`` (no body for ``HEAD``)."""
        out = self.start(code, {"Content-Type": content_type, "Content-Length": str(len(body)), **(headers or {})})
        if self.method != "HEAD":
            with contextlib.suppress(OSError):
                out.write(body)


@dataclass
class Endpoint:
    url: str  # http://127.0.0.1:PORT
    requests: list[Request]

    def count(self, method: str | None = None, path: str | None = None) -> int:
        return sum(1 for r in self.requests if (method is None or r.method == method)
                   and (path is None or r.path == path))


@contextlib.contextmanager
def serve(answer: Callable[[Request], None]) -> Iterator[Endpoint]:
    """An endpoint calling ``answer`` for every request; yields it; stops it (and its connections)."""
    requests: list[Request] = []

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"  # one request a connection: an answer may end by closing it

        def log_message(self, *args: object) -> None:
            pass

        def _any(self) -> None:
            n = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(n) if n else b""
            u = urlparse(self.path)
            req = Request(self.command, u.path, parse_qs(u.query), {k.lower(): v for k, v in self.headers.items()},
                          body, self)
            requests.append(req)
            answer(req)

        do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _any  # noqa: N815 - http.server's names

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    try:
        yield Endpoint(f"http://127.0.0.1:{server.server_address[1]}", requests)
    finally:
        server.shutdown()
        server.server_close()


def is_listing(req: Request) -> bool:
    return req.q("list-type") == "2"


# -- the answers of the credential services (their documented shapes) --------------------------------------------

def later(seconds: float = 3600.0) -> str:
    """An expiry ``seconds`` from now, as the services write it (ISO 8601, UTC, ``Z``)."""
    import datetime

    at = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=seconds)
    return at.strftime("%Y-%m-%dT%H:%M:%SZ")


def sts_answer(key: str, secret: str, token: str, expiration: str) -> bytes:
    """STS's ``AssumeRoleWithWebIdentity`` answer (its API reference's example, these keys)."""
    return (f'<AssumeRoleWithWebIdentityResponse xmlns="https://sts.amazonaws.com/doc/2011-06-15/">'
            f"<AssumeRoleWithWebIdentityResult><SubjectFromWebIdentityToken>sub</SubjectFromWebIdentityToken>"
            f"<Audience>sts.amazonaws.com</Audience><AssumedRoleUser><Arn>arn:aws:sts::123456789012:assumed-role/"
            f"r/s</Arn><AssumedRoleId>AROA:s</AssumedRoleId></AssumedRoleUser><Credentials>"
            f"<SessionToken>{token}</SessionToken><SecretAccessKey>{secret}</SecretAccessKey>"
            f"<Expiration>{expiration}</Expiration><AccessKeyId>{key}</AccessKeyId></Credentials>"
            f"<Provider>www.amazon.com</Provider></AssumeRoleWithWebIdentityResult><ResponseMetadata><RequestId>"
            f"ad4156e9</RequestId></ResponseMetadata></AssumeRoleWithWebIdentityResponse>").encode()


def container_answer(key: str, secret: str, token: str, expiration: str) -> bytes:
    """The ECS/EKS container endpoint's (and the instance metadata role's) JSON."""
    import json

    return json.dumps({"Code": "Success", "LastUpdated": "2026-12-06T10:00:00Z", "Type": "AWS-HMAC",
                       "AccessKeyId": key, "SecretAccessKey": secret, "Token": token,
                       "Expiration": expiration}).encode()
