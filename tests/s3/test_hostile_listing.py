"""A bucket listing that never ends: one line naming the endpoint's listing, bounded memory and time.

The endpoint is a small S3 imitation written here (http.server on 127.0.0.1): every ListObjectsV2
page holds 1000 new keys and says there are more. On main, ``inspect`` and ``verify --data``
gathered every page (obstore's ``list_with_delimiter``) past 3 GB. The bound is lowered here
(:data:`objects.MAX_LISTED`), so that the test serves 20 pages instead of a thousand; the code path
and the message are the same.
"""

from __future__ import annotations

import contextlib
import os
import resource
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fake_endpoint
import pytest
import s3_server

from ckpt_tool.cli import run
from gtp_format.storage import objects

BUCKET = "ckpt-test"
PAGE = 1000


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

    def answer(req: fake_endpoint.Request) -> None:
        if not fake_endpoint.is_listing(req):
            req.reply(404, fake_endpoint.MISSING)
            return
        pages.append(1)
        req.reply(200, _page(req.q("prefix"), int(req.q("continuation-token", "0")), subfolder))

    with fake_endpoint.serve(answer) as served:
        yield served.url, pages


@pytest.fixture
def env(monkeypatch):
    return lambda endpoint: s3_server.point_env(monkeypatch, endpoint)


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
    assert len(pages) == 2  # the page naming sub/, and the listing after it that names sub/ again


def test_the_listing_bounds_fit_the_largest_checkpoint_the_tool_plans():
    from gtp_format.layout.config import MAX_TARGET_WORLD

    assert objects.MAX_LISTED > MAX_TARGET_WORLD  # one data file per rank, and the side files


HUGE = 60 << 20  # one page of 60 MB: obstore read and parsed it whole, 700 MB


@contextlib.contextmanager
def one_huge_page(declared: bool, head: bytes = b"", size: int = HUGE, entry: bytes = b""
                  ) -> Iterator[tuple[str, list[int]]]:
    """An endpoint whose first listing page is ``size`` bytes of well-formed entries (or of ``entry``), streamed
    (``declared``: with its ``Content-Length``; else ended by closing, as HTTP/1.0 allows); ``head`` goes before
    the root."""
    pages: list[int] = []
    entry = entry or (b"<Contents><Key>run/iter_0000001/f%08d.distcp</Key><LastModified>2024-01-01T00:00:00.000Z"
             b'</LastModified><ETag>"0"</ETag><Size>1</Size><StorageClass>STANDARD</StorageClass></Contents>')
    block = b"".join(entry.replace(b"%08d", b"%08d" % i) if b"%08d" in entry else entry for i in range(1000))
    start = (b'<?xml version="1.0" encoding="UTF-8"?>' + head + b"<ListBucketResult><Name>ckpt-test</Name>"
             b"<IsTruncated>false</IsTruncated>")
    end = b"</ListBucketResult>"
    count = size // len(block) + 1

    def answer(req: fake_endpoint.Request) -> None:
        if not fake_endpoint.is_listing(req):
            req.reply(404, fake_endpoint.MISSING)
            return
        pages.append(1)
        length = {"Content-Length": str(len(start) + count * len(block) + len(end))} if declared else {}
        out = req.start(200, {"Content-Type": "application/xml", **length})
        with contextlib.suppress(OSError):  # the client hangs up once the page is over its budget
            out.write(start)
            for _ in range(count):
                out.write(block)
            out.write(end)

    with fake_endpoint.serve(answer) as served:
        yield served.url, pages


# The child reports its own peak (VmHWM, of the memory it has since exec): ru_maxrss would carry the
# test process's own peak into a child started by vfork and exec.
_PROBE = """
import os, sys
from ckpt_tool.cli import run
try:
    code = run(sys.argv[1:])
finally:
    hwm = next(l for l in open("/proc/self/status") if l.startswith("VmHWM:"))
    open(os.environ["RSS_OUT"], "w").write(hwm.split()[1])
sys.exit(code)
"""
REPO = Path(__file__).resolve().parents[2]


def _measured(endpoint: str, argv: list[str], tmp_path: Path) -> dict:
    """``ckpt ARGV`` against ``endpoint`` in a fresh interpreter: exit code, stderr, peak RSS (MB), seconds."""
    rss = tmp_path / "rss"
    env = {k: v for k, v in os.environ.items() if k not in s3_server.UNSET}
    env.update({**s3_server.environment(endpoint), "PYTHONPATH": str(REPO), "RSS_OUT": str(rss)})
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-c", _PROBE, *argv], cwd=REPO, capture_output=True, text=True, env=env,
                       timeout=300, check=False)
    return {"code": p.returncode, "stderr": p.stderr, "rss_mb": int(rss.read_text()) / 1024,
            "seconds": time.monotonic() - t0}


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "until-close"])
@pytest.mark.parametrize("argv", [["inspect", f"s3://{BUCKET}/run/iter_0000001"],
                                  ["verify", f"s3://{BUCKET}/run/iter_0000001", "--data"]])
def test_one_huge_listing_page_is_one_line_in_bounded_memory(tmp_path, argv, declared):
    with one_huge_page(declared, size=1 << 10) as (endpoint, _):
        good = _measured(endpoint, argv, tmp_path)  # a small page: the same command's own footprint
    with one_huge_page(declared) as (endpoint, pages):
        bad = _measured(endpoint, argv, tmp_path)
    # measured: main parsed the whole page, +110 MB over the small page's run (60 MB of 360k short entries);
    # now +6 MB at most (a page is read up to its 4 MiB budget)
    assert bad["rss_mb"] < good["rss_mb"] + 40 and bad["seconds"] < 30, (bad, good)
    from gtp_format.storage import listing

    lines = bad["stderr"].strip().splitlines()
    assert bad["code"] == 2 and len(lines) == 1 and "Traceback" not in bad["stderr"], bad
    assert f"over {listing.PAGE_BYTES >> 20} MiB" in lines[0] and endpoint in lines[0], lines[0]
    assert "AWS_ENDPOINT_URL" in lines[0] and f"s3://{BUCKET}/run/iter_0000001" in lines[0], lines[0]
    assert len(pages) == 1  # refused, not retried


@pytest.mark.parametrize(("entry", "words"), [(b"<x/>", "no object below it"), (b"<a>", "nested over 8 deep")],
                         ids=["a-million-elements", "deep"])
def test_a_page_within_the_budget_keeps_no_tree(tmp_path, entry, words):
    """4 MiB of empty elements (a million) are parsed and dropped as they end; nesting is refused."""
    argv = ["inspect", f"s3://{BUCKET}/run/iter_0000001"]
    with one_huge_page(False, size=1 << 10) as (endpoint, _):
        good = _measured(endpoint, argv, tmp_path)
    with one_huge_page(False, size=(4 << 20) - (8 << 10), entry=entry) as (endpoint, _):
        bad = _measured(endpoint, argv, tmp_path)
    lines = bad["stderr"].strip().splitlines()
    assert bad["code"] == 2 and len(lines) == 1 and words in lines[0], bad
    assert bad["rss_mb"] < good["rss_mb"] + 40 and bad["seconds"] < 30, (bad, good)


def test_a_listing_page_with_a_document_type_is_refused(env, capsys):
    head = b'<!DOCTYPE lolz [<!ENTITY lol "lol">]>'
    with one_huge_page(False, head) as (endpoint, pages):  # read, not refused by its length
        env(endpoint)
        code = run(["inspect", f"s3://{BUCKET}/run/iter_0000001"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "declares a document type" in lines[0], lines


def test_a_real_page_fits_the_page_budget():
    from gtp_format.storage import listing

    key = "run/iter_0000001/" + "k" * (1024 - 17)  # S3's longest key
    entry = (f"<Contents><Key>{key}</Key><LastModified>2024-01-01T00:00:00.000Z</LastModified><ETag>"
             f"&quot;{'0' * 32}-10000&quot;</ETag><Size>5497558138880</Size><StorageClass>INTELLIGENT_TIERING"
             "</StorageClass></Contents>")
    assert 1000 * len(entry) < listing.PAGE_BYTES // 3


@pytest.mark.parametrize("token", [None, "AQoDYXdzEJr//token+="])
def test_the_listing_signature_is_botocores(token):
    """The request :mod:`listing` signs is the one botocore signs for the same page (the tests' moto server does
    not check signatures; a real store does)."""
    from datetime import datetime, timezone

    from botocore.auth import S3SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    from gtp_format.storage import listing

    c = listing.Client("https://s3.eu-west-3.amazonaws.com", "eu-west-3", "AKIDEXAMPLE", "wJalr/K7MDENG+bPxRfiCY",
                       token, 60.0, 3, 30.0)
    query = [("list-type", "2"), ("prefix", "run a+b/é~x/"), ("start-after", "run a+b/é~x/sub/\U0010ffff")]
    now = datetime(2026, 12, 6, 11, 0, 0, tzinfo=timezone.utc)
    url, headers = listing.request(c, "my.bucket-1", query, now)
    req = AWSRequest(method="GET", url=url, headers={"X-Amz-Date": headers["x-amz-date"],
                                                     "X-Amz-Content-SHA256": headers["x-amz-content-sha256"],
                                                     **({"X-Amz-Security-Token": token} if token else {})})
    auth = S3SigV4Auth(Credentials("AKIDEXAMPLE", "wJalr/K7MDENG+bPxRfiCY", token), "s3", "eu-west-3")
    req.context["timestamp"] = headers["x-amz-date"]
    canonical = auth.canonical_request(req)
    signature = auth.signature(auth.string_to_sign(req, canonical), req)
    assert headers["authorization"].endswith(f"Signature={signature}"), (canonical, headers)


def test_the_bounded_listing_lists_what_obstore_lists(s3):
    """The same entries through the tool's own pages and through obstore's listing: pages of 1000 (moto's), a
    sub-folder skipped, names that need escaping in XML and URLs."""
    import obstore

    from gtp_format.storage.location import parse_location

    names = [f"run/iter_1/f{i:05d}.distcp" for i in range(2100)] + ["run/iter_1/sub/x", "run/iter_1/sub/y/z",
                                                                     "run/iter_1/a&b <c> é+%.txt", "run/iter_10/n"]
    for n in names:
        s3.client.put_object(Bucket=s3.bucket, Key=n, Body=b"xy")
    root = parse_location(s3.url("run/iter_1"))
    ours, found = objects.list_names(root), objects.is_prefix(root, "sub")
    listed = obstore.list_with_delimiter(objects.store(root), "run/iter_1/")
    theirs = {**{str(m["path"])[len("run/iter_1/"):]: int(m["size"]) for m in listed["objects"]},
              **{p[len("run/iter_1/"):].rstrip("/"): None for p in listed["common_prefixes"]}}
    assert ours == theirs and len(ours) == 2102 and ours["sub"] is None and ours["a&b <c> é+%.txt"] == 2
    assert found and objects.is_prefix(root, "sub") and not objects.is_prefix(root, "none")


def trickled_page(out: Any, stop: threading.Event) -> None:
    """A page whose body comes a byte per receive."""
    out.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/xml\r\n\r\n")
    out.write(b'<?xml version="1.0"?><ListBucketResult><IsTruncated>false</IsTruncated>')
    out.flush()
    while not stop.wait(0.2):
        out.write(b" ")
        out.flush()


def trickled_headers(out: Any, stop: threading.Event) -> None:
    """The status line, then a header a byte per receive (``http.client`` would read 100 lines of 64 KiB)."""
    out.write(b"HTTP/1.1 200 OK\r\nX-Slow: ")
    out.flush()
    while not stop.wait(0.2):
        out.write(b"a")
        out.flush()


@pytest.mark.parametrize(("send", "words", "most"), [
    (trickled_page, "was still arriving after 1 s", 1),  # a page that comes, too slowly: refused, not retried
    (trickled_headers, "did not answer the listing (timed out)", 4)])  # as a silent store: retried, then one line
def test_a_listing_page_that_trickles_is_cut_off_at_the_timeout(env, monkeypatch, capsys, send, words, most):
    """A page (or its headers) sent a byte per receive, each receive within the socket's timeout, so that timeout
    alone never fires: refused once the request's timeout has passed, one line naming the endpoint."""
    stop = threading.Event()

    def answer(req: fake_endpoint.Request) -> None:
        with contextlib.suppress(OSError):
            send(req.handler.wfile, stop)

    with fake_endpoint.serve(answer) as ep:
        env(ep.url)
        monkeypatch.setenv("CKPT_S3_TIMEOUT_S", "1")
        t = time.monotonic()
        code = run(["inspect", f"s3://{BUCKET}/run/iter_0000001"])
        took = time.monotonic() - t
        stop.set()
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and words in lines[0], lines
    assert took < 20 and 1 <= len(ep.requests) <= most, (took, len(ep.requests))
