"""A bucket listing that never ends: one line naming the endpoint's listing, bounded memory and time.

The endpoint is a small S3 imitation written here (http.server on 127.0.0.1): every ListObjectsV2
page holds 1000 new keys and says there are more. On main, ``inspect`` and ``verify --data``
gathered every page (obstore's ``list_with_delimiter``) past 3 GB. The bound is lowered here
(:data:`objects.MAX_LISTED`), so that the test serves 20 pages instead of a thousand; the code path
and the message are the same.
"""

from __future__ import annotations

import contextlib
import resource
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

import pytest
import s3_server

from ckpt_tool.cli import run
from gtp_format.storage import objects

BUCKET = "ckpt-test"
PAGE = 1000
MISSING = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>NoSuchKey</Code><Message>The specified key does '
           b"not exist.</Message></Error>")


def _page(prefix: str, token: int, subfolder: bool) -> bytes:
    names = [f"{prefix}sub/x" for _ in range(1)] if subfolder else [f"{prefix}f{token * PAGE + i:012d}.distcp"
                                                                     for i in range(PAGE)]
    items = "".join(f"<Contents><Key>{k}</Key><LastModified>2024-01-01T00:00:00.000Z</LastModified><ETag>\"0\""
                    f"</ETag><Size>1</Size><StorageClass>STANDARD</StorageClass></Contents>" for k in names)
    return (f'<?xml version="1.0" encoding="UTF-8"?><ListBucketResult><Name>{BUCKET}</Name><Prefix>{prefix}</Prefix>'
            f"<KeyCount>{len(names)}</KeyCount><MaxKeys>{PAGE}</MaxKeys><IsTruncated>true</IsTruncated>{items}"
            f"<NextContinuationToken>{token + 1}</NextContinuationToken></ListBucketResult>").encode()


@contextlib.contextmanager
def endless(subfolder: bool = False) -> Iterator[tuple[str, list[int]]]:
    """An endpoint whose listings never end (``subfolder``: every page names ``sub/x`` again, whatever the
    start-after); objects are missing. Yields the endpoint and a list counting the pages served."""
    pages: list[int] = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def _send(self, code: int, body: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            q = parse_qs(urlparse(self.path).query)
            if q.get("list-type") == ["2"]:
                pages.append(1)
                self._send(200, _page(q.get("prefix", [""])[0], int(q.get("continuation-token", ["0"])[0]), subfolder))
            else:
                self._send(404, MISSING)

        do_HEAD = do_GET  # noqa: N815

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", pages
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def env(monkeypatch):
    def point_at(endpoint: str) -> None:
        for k in s3_server.UNSET:
            monkeypatch.delenv(k, raising=False)
        for k, v in s3_server.environment(endpoint).items():
            monkeypatch.setenv(k, v)

    return point_at


@pytest.mark.parametrize("argv", [["inspect", f"s3://{BUCKET}/run/iter_0000001"],
                                  ["verify", f"s3://{BUCKET}/run/iter_0000001", "--data"],
                                  ["inspect", f"s3://{BUCKET}/run"]])
def test_a_listing_that_never_ends_is_one_line(env, monkeypatch, capsys, argv):
    monkeypatch.setattr(objects, "MAX_LISTED", 20 * PAGE, raising=False)  # main had no bound: it never ends
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with endless() as (endpoint, pages):
        env(endpoint)
        t = time.monotonic()
        code = run(argv)
        took = time.monotonic() - t
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    out = capsys.readouterr()
    lines = out.err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in out.err, out.err
    assert "listing" in lines[0] and "goes past 20,000 keys" in lines[0] and "AWS_ENDPOINT_URL" in lines[0], lines[0]
    assert 20 <= len(pages) <= 22, len(pages)  # stopped at the bound, not after it
    assert took < 60 and grown_mb < 100, (took, grown_mb)


def test_a_listing_that_repeats_a_subfolder_is_one_line(env, capsys):
    with endless(subfolder=True) as (endpoint, pages):
        env(endpoint)
        code = run(["inspect", f"s3://{BUCKET}/run/iter_0000001"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "returns sub/ again out of order" in lines[0], lines
    assert len(pages) <= 2 * objects.LIST_BATCH + 2  # a batch fills from as many one-key pages as it takes


def test_the_listing_bounds_fit_the_largest_checkpoint_the_tool_plans():
    from gtp_format.layout.config import MAX_TARGET_WORLD

    assert objects.MAX_LISTED > MAX_TARGET_WORLD  # one data file per rank, and the side files
