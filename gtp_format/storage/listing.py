"""One page of a bucket listing (S3 ``ListObjectsV2``), fetched and parsed within a byte budget.

Why not obstore's own listing: it reads a page's whole body and parses it at once, so one page an
endpoint makes huge costs what the endpoint chooses (a 60 MB page took 700 MB). A real page of 1000
keys is about 250 KB of XML (1024-byte keys, the longest S3 allows, make about 1.2 MB), so a page is
refused past :data:`PAGE_BYTES`, before it is read: the body is read in pieces and fed to a streaming
parser, and a declared ``Content-Length`` over the budget is refused without reading anything.

The request is signed here (AWS Signature Version 4, the header form: the same canonical request
botocore builds, checked against it in tests/s3/test_hostile_listing.py), with the credentials and
the endpoint :mod:`gtp_format.storage.credentials` and :mod:`gtp_format.storage.profiles` resolved,
path-style (``ENDPOINT/BUCKET?...``) or virtual-hosted-style (``AWS_VIRTUAL_HOSTED_STYLE_REQUEST``:
the endpoint names the bucket, ``ENDPOINT/?...``) as obstore sends it. A page is
XML without a document type: a ``<!DOCTYPE`` (the only way to declare entities) is refused, so no
entity is ever expanded.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import http.client
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from datetime import datetime, timezone
from urllib.parse import quote, urlsplit
from xml.etree.ElementTree import ParseError, XMLPullParser

from gtp_format.errors import FormatError
from gtp_format.storage.deadline import Deadline, watched_opener

PAGE_BYTES = 4 << 20  # one listing page's XML; a real page of 1000 keys is under 1.2 MB
READ = 64 << 10  # body bytes read and parsed at a time
MAX_DEPTH = 8  # ListBucketResult > Contents > Owner > ID is the deepest S3 nests
MAX_SIZE_DIGITS = 20  # an object size is at most 5 TiB: 13 digits
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()


@dataclass(frozen=True)
class Client:
    """Where and how a listing request is sent: ``key`` None sends it unsigned (a public bucket); ``hosted``:
    virtual-hosted-style, ``endpoint`` is the bucket's own."""

    endpoint: str  # http(s)://host[:port][/path], no trailing slash
    region: str
    key: str | None
    secret: str | None = field(repr=False)
    token: str | None = field(repr=False)
    timeout: float
    retries: int
    retry_seconds: float
    hosted: bool = False


def _enc(s: str) -> str:
    return quote(s, safe="-_.~")


def _sign(c: Client, url: str, host: str, query: list[tuple[str, str]], now: datetime) -> dict[str, str]:
    """The headers of a ``GET`` of ``url``, signed with SigV4 (payload: empty)."""
    stamp = now.strftime("%Y%m%dT%H%M%SZ")
    headers = {"host": host, "x-amz-content-sha256": EMPTY_SHA256, "x-amz-date": stamp}
    if c.token:
        headers["x-amz-security-token"] = c.token
    if c.key is None or c.secret is None:
        return headers
    path = urlsplit(url).path or "/"
    canonical_query = "&".join(f"{_enc(k)}={_enc(v)}" for k, v in sorted(query))
    names = sorted(headers)
    canonical = "\n".join(["GET", quote(path, safe="/-_.~"), canonical_query,
                           "".join(f"{n}:{headers[n].strip()}\n" for n in names), ";".join(names), EMPTY_SHA256])
    scope = f"{stamp[:8]}/{c.region}/s3/aws4_request"
    to_sign = "\n".join(["AWS4-HMAC-SHA256", stamp, scope, hashlib.sha256(canonical.encode()).hexdigest()])
    k = ("AWS4" + c.secret).encode()
    for part in (stamp[:8], c.region, "s3", "aws4_request"):
        k = hmac.new(k, part.encode(), hashlib.sha256).digest()
    signature = hmac.new(k, to_sign.encode(), hashlib.sha256).hexdigest()
    headers["authorization"] = (f"AWS4-HMAC-SHA256 Credential={c.key}/{scope}, SignedHeaders={';'.join(names)}, "
                                f"Signature={signature}")
    return headers


def request(c: Client, bucket: str, query: list[tuple[str, str]], now: datetime | None = None
            ) -> tuple[str, dict[str, str]]:
    """The URL and signed headers of a listing request of ``bucket`` with ``query``."""
    base = urlsplit(c.endpoint)
    url = f"{c.endpoint}/" if c.hosted else f"{c.endpoint}/{quote(bucket, safe='-_.~')}"
    qs = "&".join(f"{_enc(k)}={_enc(v)}" for k, v in query)
    return f"{url}?{qs}", _sign(c, url, base.netloc, query, now or datetime.now(timezone.utc))


def _too_big(where: str, c: Client) -> FormatError:
    return FormatError(f"{where}: a listing page from {c.endpoint} is over {PAGE_BYTES >> 20} MiB (a real S3 page of "
                       "1000 keys is under 1.2 MB); check AWS_ENDPOINT_URL (an endpoint that does not answer like S3) "
                       "and the URL")


def _bad(where: str, c: Client, why: str) -> FormatError:
    return FormatError(f"{where}: the listing from {c.endpoint} is not an S3 ListObjectsV2 answer ({why}); check "
                       "AWS_ENDPOINT_URL and the URL")


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """A redirect is the store's error answer (S3's 301 for another region), never followed: following one
    would send the signed request to wherever the answer points."""

    def redirect_request(self, *args: object, **kwargs: object) -> None:
        return None


_OPENER = watched_opener(_NoRedirect)  # the environment's proxies, as obstore's client honours them


def _local(tag: str) -> str:
    return tag.rpartition("}")[2]


def _late(where: str, c: Client, what: str = "a listing page") -> FormatError:
    return FormatError(f"{where}: {what} from {c.endpoint} was still arriving after {c.timeout:.0f} s (a real "
                       "page is a few hundred KB); check AWS_ENDPOINT_URL and the network, or raise the timeout "
                       "(CKPT_S3_TIMEOUT_S)")


def _parse(where: str, c: Client, body: object, deadline: float) -> tuple[list[tuple[str, int]], str | None]:
    """The (key, size) entries and the continuation token (None: the last page) of a response ``body``,
    read a receive at a time (``read1``, at most :data:`READ` bytes), at most :data:`PAGE_BYTES` in all and
    until ``deadline``: a page an endpoint trickles a byte per receive is cut off there, where the socket's
    timeout bounds only each receive."""
    parser = XMLPullParser(events=("start", "end"))
    entries: list[tuple[str, int]] = []
    fields: dict[str, str] = {}
    truncated, token, total, tail, depth, root = False, None, 0, b"", 0, None
    while True:
        if time.monotonic() > deadline:
            raise _late(where, c)
        piece = body.read1(READ)  # type: ignore[attr-defined]
        if not piece:
            break
        total += len(piece)
        if total > PAGE_BYTES:
            raise _too_big(where, c)
        if b"<!DOCTYPE" in tail + piece or b"<!ENTITY" in tail + piece:
            raise _bad(where, c, "it declares a document type")
        tail = (tail + piece)[-16:]  # a declaration cut over pieces of any size
        try:
            parser.feed(piece)
            events = list(parser.read_events())
        except ParseError as e:
            raise _bad(where, c, f"XML: {e}") from None
        for event, el in events:
            if event == "start":
                depth += 1
                if depth > MAX_DEPTH:
                    raise _bad(where, c, f"elements nested over {MAX_DEPTH} deep")
                root = el if root is None else root
                if _local(el.tag) == "Contents":
                    fields.clear()  # an entry's fields are its own
                continue
            depth -= 1
            if depth == 1 and root is not None:
                root.clear()  # a finished entry: nothing of it is kept in the tree
            name = _local(el.tag)
            if name in ("Key", "Size"):
                fields[name] = el.text or ""
            elif name == "Contents":
                if "Key" not in fields or "Size" not in fields:
                    raise _bad(where, c, "an entry without Key or Size")
                size = fields["Size"].strip()
                if not (size.isascii() and size.isdigit() and len(size) <= MAX_SIZE_DIGITS):
                    raise _bad(where, c, f"size {size[:40]!r}")
                entries.append((fields["Key"], int(size)))
                fields.clear()
            elif name == "IsTruncated":
                truncated = (el.text or "").strip() == "true"
            elif name == "NextContinuationToken":
                token = el.text or ""
    try:
        parser.close()
    except ParseError as e:
        raise _bad(where, c, f"XML: {e}") from None
    if truncated and not token:
        raise _bad(where, c, "truncated without a continuation token")
    return entries, token if truncated else None


def _error_body(e: urllib.error.HTTPError, deadline: float) -> bytes:
    """The first 4 KiB of an error answer (its ``<Code>`` is near the start), read until ``deadline``."""
    out = b""
    with contextlib.suppress(OSError, ValueError, AttributeError, http.client.HTTPException):
        while len(out) < 4096 and time.monotonic() < deadline:
            piece = e.fp.read1(4096 - len(out))  # type: ignore[union-attr]
            if not piece:
                break
            out += piece
    return out


def _error(where: str, c: Client, code: int, body: bytes) -> FormatError:
    text = body.decode("utf-8", "replace")
    start = text.find("<Code>")
    what = text[start + 6:text.find("</Code>", start)][:80] if start >= 0 else ""
    shown = f"HTTP {code}" + (f" {what}" if what else "")
    if code in (401, 403):
        return FormatError(f"{where}: the store refused the credentials ({shown}); check AWS_ACCESS_KEY_ID, "
                           "AWS_SECRET_ACCESS_KEY and AWS_ENDPOINT_URL")
    if what == "NoSuchBucket":
        return FormatError(f"{where}: the bucket does not exist; check the URL and AWS_ENDPOINT_URL")
    return FormatError(f"{where}: the store failed to list ({shown}); check AWS_ENDPOINT_URL and the URL")


def page(c: Client, bucket: str, prefix: str, start_after: str | None, token: str | None, where: str,
         timeout_env: str) -> tuple[list[tuple[str, int]], str | None]:
    """One ``ListObjectsV2`` page of ``bucket`` below ``prefix``: its (key, size) entries and the continuation
    token of the next page (None: the last). Transient failures (5xx, a connection refused or dropped, a
    timeout) are retried ``c.retries`` times with backoff; anything else is one line naming ``where``."""
    query = [("list-type", "2")]
    if prefix:
        query.append(("prefix", prefix))
    if token is not None:
        query.append(("continuation-token", token))
    elif start_after is not None:
        query.append(("start-after", start_after))
    deadline = time.monotonic() + c.retry_seconds
    for attempt in range(c.retries + 1):
        url, headers = request(c, bucket, query)
        req = urllib.request.Request(url, headers={k: v for k, v in headers.items() if k != "host"}, method="GET")
        req.add_header("Host", headers["host"])
        why = ""
        watch = req.deadline = Deadline(c.timeout)  # type: ignore[attr-defined]  # its status line and headers
        try:
            with watch:
                resp = _OPENER.open(req, timeout=c.timeout)
            if watch.passed:  # headers cut short by the deadline can read as ended: the answer is not trusted
                resp.close()
                raise TimeoutError("timed out")
            with resp:  # the page: read against its own deadline by _parse
                declared = resp.headers.get("Content-Length")
                if declared is not None and declared.strip().isdigit() and int(declared) > PAGE_BYTES:
                    raise _too_big(where, c)
                return _parse(where, c, resp, time.monotonic() + c.timeout)
        except urllib.error.HTTPError as e:
            body = _error_body(e, time.monotonic() + c.timeout) if e.fp is not None else b""
            if e.code < 500:
                raise _error(where, c, e.code, body) from None
            why = f"HTTP {e.code}"
        except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
            reason = getattr(e, "reason", e)
            why = "timed out" if watch.passed else " ".join(str(reason).split())[:200] or type(e).__name__
        if attempt == c.retries or time.monotonic() > deadline:
            break
        time.sleep(min(0.1 * 2 ** attempt, 4.0))
    raise FormatError(f"{where}: the store did not answer the listing ({why}) after {c.retries} retries; check "
                      f"AWS_ENDPOINT_URL and the network, or raise {timeout_env}")
