"""The keys S3 requests are signed with, from the sources obstore would use, in its order, each answer bounded.

Why here and not in obstore: the tool sends its own listings (:mod:`gtp_format.storage.listing`, to bound a
page), so it must hold the keys; and obstore reads a credential endpoint's whole answer, follows its
redirects and waits as long as its client does. The keys resolved here are handed to obstore too (as
explicit keys, :func:`gtp_format.storage.objects.store`), so every request of a command is signed with
the same keys and obstore never asks a credential endpoint itself.

The order is object_store's ``AmazonS3Builder::build`` (object_store 0.14, the version obstore 0.12
links), the first source configured wins:

1. ``AWS_SKIP_SIGNATURE`` true: nothing is signed (a public bucket);
2. an access key pair: ``AWS_ACCESS_KEY_ID`` + ``AWS_SECRET_ACCESS_KEY``, else the AWS profile's
   (:mod:`gtp_format.storage.profiles`; obstore is given those explicitly, so they come first there too);
3. web identity: ``AWS_WEB_IDENTITY_TOKEN_FILE`` + ``AWS_ROLE_ARN`` (``AWS_ROLE_SESSION_NAME``, default
   ``WebIdentitySession``): STS ``AssumeRoleWithWebIdentity`` at ``AWS_ENDPOINT_URL_STS``, default
   ``https://sts.REGION.amazonaws.com``; HTTPS only, as obstore (plain HTTP only to a loopback address,
   for a local imitation);
4. ``AWS_CONTAINER_CREDENTIALS_RELATIVE_URI`` (ECS): ``http://169.254.170.2`` + the path;
5. ``AWS_CONTAINER_CREDENTIALS_FULL_URI`` (EKS Pod Identity) with the ``Authorization`` header read from
   ``AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE`` (or given in ``AWS_CONTAINER_AUTHORIZATION_TOKEN``, as the AWS
   SDKs allow; obstore needs the file); as the SDKs, plain HTTP only to a loopback address or the
   container endpoints (169.254.170.2, 169.254.170.23, fd00:ec2::23), so the token goes nowhere else;
6. the EC2 instance metadata service, IMDSv2 (a token ``PUT``, the role's name, its keys;
   ``AWS_IMDSV1_FALLBACK`` true: without the token where the ``PUT`` is refused with 403) at
   ``AWS_METADATA_ENDPOINT``, default ``http://169.254.169.254``. Unlike obstore, only where asked for:
   ``AWS_METADATA_ENDPOINT`` set or ``AWS_EC2_METADATA_DISABLED=false``. Why: on a machine that is not an
   EC2 instance nothing answers that address (obstore waited for its whole retry budget) or another
   cloud's metadata service does; without a source the answer is one line naming what to set.

Every answer is bounded: at most :data:`ANSWER_BYTES` (a real one is 1-3 KB), read in pieces against a
deadline (:data:`METADATA_SECONDS` for the local services, :data:`STS_SECONDS` for STS) so that an
endpoint that trickles bytes cannot hold the command; XML without a document type and nested at most
:data:`MAX_DEPTH` deep; JSON parsed once bounded so (nesting refused past the parser's limit). A redirect is never
followed (it would send the token or the request wherever the answer points). Keys are printable ASCII
without spaces and of bounded length, an expiry is a timestamp with a zone; keys that expired are
refused. Every failure is one line naming the source (the variable or the endpoint) and the fix; no key,
secret, token or answer body is ever printed (an STS error shows its ``<Code>`` only).

Resolved keys are kept by the caller's session (``kept`` of :func:`resolve`, keyed by the whole configuration)
until :data:`REFRESH_SECONDS` before they expire, obstore's own refresh margin; then fetched again.
"""

from __future__ import annotations

import http.client
import ipaddress
import json
import os
import re
import stat
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any
from xml.etree.ElementTree import ParseError, XMLPullParser

from gtp_format.errors import FormatError
from gtp_format.storage import profiles
from gtp_format.storage.deadline import Deadline, watched_opener

ANSWER_BYTES = 64 << 10  # one credential answer; STS's is ~1.5 KB with a 1 KB session token
TOKEN_FILE_BYTES = 64 << 10  # a web identity or container token file: a JWT of ~1 KB
READ = 4 << 10
METADATA_SECONDS = 2.0  # a container or instance metadata request, all of it (botocore: 1-2 s)
STS_SECONDS = 30.0  # one STS request, all of it
ATTEMPTS = 2  # a transient failure (connection refused or reset, 5xx) is tried once more
MAX_DEPTH = 8  # AssumeRoleWithWebIdentityResponse > Result > Credentials > AccessKeyId is 4
REFRESH_SECONDS = 300.0  # keys closer than this to their expiry are fetched again (object_store's min TTL)
CONTAINER_HOST = "169.254.170.2"  # where AWS_CONTAINER_CREDENTIALS_RELATIVE_URI points
METADATA_ENDPOINT = "http://169.254.169.254"
_KEY = re.compile(r"[\x21-\x7e]{1,256}")  # an access key id or a secret
_TOKEN = re.compile(r"[\x21-\x7e]{1,16384}")  # a session token, an authorization token
_ROLE = re.compile(r"[\w+=,.@-]{1,128}")  # an IAM role name
_CONTAINER_HOSTS = ("169.254.170.2", "169.254.170.23", "fd00:ec2::23")
_TRUE, _FALSE = ("1", "true", "on", "yes", "y"), ("0", "false", "off", "no", "n")  # object_store's booleans


@dataclass(frozen=True)
class Credentials:
    """Keys to sign with (all None: unsigned); ``source`` says where they came from (never the keys);
    ``expires`` is the expiry in seconds since the epoch (None: never)."""

    key: str | None = field(default=None, repr=False)
    secret: str | None = field(default=None, repr=False)
    token: str | None = field(default=None, repr=False)
    source: str = ""
    expires: float | None = None
    fetched: float = 0.0  # when they were fetched (seconds since the epoch)

    def stale(self, now: float) -> bool:
        """Whether to fetch again: within :data:`REFRESH_SECONDS` of the expiry, or past half the keys'
        lifetime where that is shorter (keys of a 2-minute lifetime are not fetched at every request)."""
        if self.expires is None:
            return False
        return self.expires - now < min(REFRESH_SECONDS, (self.expires - self.fetched) / 2)


def flag(name: str) -> bool | None:
    """The boolean variable ``name`` as object_store reads it; None where unset or empty."""
    raw = os.environ.get(name, "").strip().lower()
    if not raw:
        return None
    if raw in _TRUE or raw in _FALSE:
        return raw in _TRUE
    raise FormatError(f"{name}={raw[:20]!r} is not a boolean; set it to true or false")


def metadata_asked() -> bool:
    """Whether the instance metadata service may be asked (see the module docstring, source 6)."""
    return bool(os.environ.get("AWS_METADATA_ENDPOINT")) or flag("AWS_EC2_METADATA_DISABLED") is False


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: object, **kwargs: object) -> None:
        return None


def _opener(proxies: bool) -> urllib.request.OpenerDirector:
    """STS through the environment's proxies; the link-local services never (a proxy cannot reach them)."""
    handlers: list[urllib.request.BaseHandler] = [_NoRedirect()]
    if not proxies:
        handlers.append(urllib.request.ProxyHandler({}))
    return watched_opener(*handlers)


def _split(url: str) -> urllib.parse.SplitResult | None:
    """``url`` split, or None where it does not parse (a bracket left open, a port that is no number)."""
    try:
        u = urllib.parse.urlsplit(url)
        u.port  # noqa: B018 - raises on a port that is not a number in range
    except ValueError:
        return None
    return u


def _shown(url: str) -> str:
    """``url`` without its query (where a token could be) and user part."""
    u = _split(url)
    if u is None:
        return "(a URL that does not parse)"
    host = u.hostname or ""
    host = f"[{host}]" if ":" in host else host
    return f"{u.scheme}://{host}{':' + str(u.port) if u.port else ''}{u.path}"


def _fetch(source: str, fix: str, method: str, url: str, headers: dict[str, str], seconds: float,
           proxies: bool = False, body: bytes | None = None) -> tuple[int, bytes]:
    """(status, body) of one request, the body at most :data:`ANSWER_BYTES`, all of it within ``seconds``;
    transient failures tried :data:`ATTEMPTS` times; a redirect, a refusal or a silence is one line."""
    where = f"{source} {_shown(url)}"
    deadline = time.monotonic() + seconds
    why = ""
    for _ in range(ATTEMPTS):
        left = deadline - time.monotonic()
        if left <= 0:
            break
        req = urllib.request.Request(url, data=body, headers=headers, method=method)
        watch = req.deadline = Deadline(left)  # type: ignore[attr-defined]  # its status line and headers
        try:
            with watch:
                resp = _opener(proxies).open(req, timeout=left)
            if watch.passed:  # headers cut short by the deadline can read as ended: the answer is not trusted
                resp.close()
                why = "timed out"
                break
            with resp:  # the body: read against the deadline by _read
                return resp.status, _read(resp, where, fix, deadline, seconds)
        except urllib.error.HTTPError as e:
            if 300 <= e.code < 400:
                raise FormatError(f"{where} answered with a redirect (HTTP {e.code}); credentials are never fetched "
                                  f"from where an answer points: {fix}") from None
            data = _read(e, where, fix, deadline, seconds) if e.fp is not None else b""
            if e.code < 500:
                return e.code, data
            why = f"HTTP {e.code}"
        except FormatError:
            raise
        except ValueError:  # a URL that is none (its text is not shown: a header's could be a token)
            raise FormatError(f"{where}: cannot send the request (the URL or a header is malformed); {fix}") from None
        except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
            if watch.passed:
                why = "timed out"
                break
            reason = getattr(e, "reason", e)
            why = " ".join(str(reason).split())[:160] or type(e).__name__
    raise FormatError(f"{where} did not answer with credentials within {seconds:.0f} s ({why or 'timed out'}); {fix}")


def _read(resp: object, where: str, fix: str, deadline: float, seconds: float) -> bytes:
    """The body of ``resp``, a piece at a time (``read1``: one receive each, so a trickle meets the
    deadline), at most :data:`ANSWER_BYTES`."""
    declared = resp.headers.get("Content-Length")  # type: ignore[attr-defined]
    if declared is not None and declared.strip().isdigit() and int(declared) > ANSWER_BYTES:
        raise FormatError(f"{where} answered with {int(declared):,} bytes, more than any credential answer "
                          f"({ANSWER_BYTES >> 10} KiB); {fix}")
    out = bytearray()
    while True:
        if time.monotonic() > deadline:
            raise FormatError(f"{where} was still sending its answer after {seconds:.0f} s; {fix}")
        try:
            piece = resp.read1(READ)  # type: ignore[attr-defined]
        except (OSError, ValueError, http.client.HTTPException) as e:
            raise FormatError(f"{where}: the answer was cut ({' '.join(str(e).split())[:120] or type(e).__name__}); "
                              f"{fix}") from None
        if not piece:
            if declared is not None and declared.strip().isdigit() and len(out) != int(declared):
                raise FormatError(f"{where}: the answer was cut ({len(out)} of its {int(declared)} bytes came); "
                                  f"{fix}")
            return bytes(out)
        out += piece
        if len(out) > ANSWER_BYTES:
            raise FormatError(f"{where} answered with over {ANSWER_BYTES >> 10} KiB, more than any credential "
                              f"answer; {fix}")


def _token_file(path: str, var: str, fix: str) -> str:
    """The token in the file ``path`` (named by ``var``): a regular file of at most :data:`TOKEN_FILE_BYTES`,
    printable ASCII once its surrounding white space is stripped."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        raise FormatError(f"{var}={path}: cannot be read ({e.strerror or e}); {fix}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise FormatError(f"{var}={path} is not a regular file; {fix}")
    with os.fdopen(fd, "rb") as f:
        raw = f.read(TOKEN_FILE_BYTES + 1)
    if len(raw) > TOKEN_FILE_BYTES:
        raise FormatError(f"{var}={path} is over {TOKEN_FILE_BYTES >> 10} KiB, not a token; {fix}")
    text = raw.decode("latin-1").strip()
    if not _TOKEN.fullmatch(text):
        raise FormatError(f"{var}={path} does not hold one token (printable ASCII without spaces); {fix}")
    return text


def _checked(where: str, fix: str, key: object, secret: object, token: object, expiration: object,
             now: float) -> Credentials:
    """Keys taken from an answer, each checked (never printed); an expiry in the past refused."""
    for name, value, pattern in (("the access key id", key, _KEY), ("the secret", secret, _KEY),
                                 ("the session token", token, _TOKEN)):
        if not (isinstance(value, str) and pattern.fullmatch(value)):
            raise FormatError(f"{where} answered without {name} (or with one that is not printable ASCII of "
                              f"bounded length); {fix}")
    if not isinstance(expiration, str) or len(expiration) > 40:
        raise FormatError(f"{where} answered without an expiry time; {fix}")
    try:
        at = datetime.fromisoformat(expiration.strip())
    except ValueError:
        at = None
    if at is None or at.tzinfo is None:
        raise FormatError(f"{where} answered with the expiry {expiration[:40]!r}, not a time with a zone; {fix}")
    expires = at.timestamp()
    if expires <= now:
        raise FormatError(f"{where} answered with keys that expired at {at.isoformat()} (now is "
                          f"{datetime.fromtimestamp(now, at.tzinfo).isoformat(timespec='seconds')}); check the "
                          f"endpoint and this machine's clock; {fix}")
    return Credentials(str(key), str(secret), str(token), where, expires, now)


def _xml_fields(where: str, fix: str, data: bytes, names: tuple[str, ...]) -> tuple[str, dict[str, str]]:
    """The root element's local name and the text of the elements named ``names``, from ``data`` (already
    bounded): no document type, nesting at most :data:`MAX_DEPTH`."""
    if b"<!DOCTYPE" in data or b"<!ENTITY" in data:
        raise FormatError(f"{where} answered with XML that declares a document type; {fix}")
    parser = XMLPullParser(events=("start", "end"))
    found: dict[str, str] = {}
    root, depth = "", 0
    try:
        parser.feed(data)
        parser.close()
        for event, el in parser.read_events():
            name = el.tag.rpartition("}")[2]
            if event == "start":
                depth += 1
                root = root or name
                if depth > MAX_DEPTH:
                    raise FormatError(f"{where} answered with XML nested over {MAX_DEPTH} deep; {fix}")
            else:
                depth -= 1
                if name in names:
                    found[name] = (el.text or "").strip()
    except ParseError as e:
        raise FormatError(f"{where} answered with XML that does not parse ({str(e)[:120]}); {fix}") from None
    return root, found


def _json_fields(where: str, fix: str, data: bytes) -> dict[str, object]:
    """The JSON object ``data`` (already at most :data:`ANSWER_BYTES`, so its parsed cost is bounded too: a few
    MB at most); what does not parse, nests too deep or is no object: one line, never the text."""
    try:
        obj = json.loads(data.decode("utf-8"), parse_constant=lambda c: None)
    except RecursionError:
        raise FormatError(f"{where} answered with JSON nested too deeply; {fix}") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, an integer over CPython's digit limit
        raise FormatError(f"{where} answered with JSON that does not parse ({type(e).__name__}); {fix}") from None
    if not isinstance(obj, dict):
        raise FormatError(f"{where} answered with JSON that is not an object; {fix}")
    return obj


def _web_identity(region: str, now: float) -> Credentials:
    env = os.environ
    fix = ("check AWS_WEB_IDENTITY_TOKEN_FILE, AWS_ROLE_ARN and AWS_ENDPOINT_URL_STS (or AWS_REGION), or export "
           "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY instead")
    token = _token_file(env["AWS_WEB_IDENTITY_TOKEN_FILE"], "AWS_WEB_IDENTITY_TOKEN_FILE", fix)
    endpoint = env.get("AWS_ENDPOINT_URL_STS") or f"https://sts.{region}.amazonaws.com"
    u = _split(endpoint)
    if u is None or u.scheme != "https" and not (u.scheme == "http" and _loopback(u.hostname)):
        raise FormatError(f"AWS_ENDPOINT_URL_STS={_shown(endpoint)!r} is not an https:// URL (the web identity "
                          "token is sent there; plain HTTP only to a loopback address); fix it")
    form = urllib.parse.urlencode([("Action", "AssumeRoleWithWebIdentity"), ("DurationSeconds", "3600"),
                                   ("RoleArn", env["AWS_ROLE_ARN"]),
                                   ("RoleSessionName", env.get("AWS_ROLE_SESSION_NAME") or "WebIdentitySession"),
                                   ("Version", "2011-06-15"), ("WebIdentityToken", token)]).encode()
    where = "web identity (AWS_WEB_IDENTITY_TOKEN_FILE, AWS_ROLE_ARN) at STS"
    code, data = _fetch(where, fix, "POST", endpoint, {"Content-Type": "application/x-www-form-urlencoded"},
                        STS_SECONDS, proxies=True, body=form)
    where = f"{where} {_shown(endpoint)}"
    names = ("Code", "AccessKeyId", "SecretAccessKey", "SessionToken", "Expiration")
    root, got = _xml_fields(where, fix, data, names)
    if code != 200:
        shown = got.get("Code", "")[:60]
        raise FormatError(f"{where} refused the role (HTTP {code}{' ' + shown if shown else ''}); {fix}")
    if root != "AssumeRoleWithWebIdentityResponse":
        raise FormatError(f"{where} answered with <{root[:40]}>, not an AssumeRoleWithWebIdentityResponse; {fix}")
    return _checked(where, fix, got.get("AccessKeyId"), got.get("SecretAccessKey"), got.get("SessionToken"),
                    got.get("Expiration"), now)


def _loopback(host: str | None) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host or "").is_loopback
    except ValueError:
        return False


def _container(now: float) -> Credentials:
    env = os.environ
    relative = env.get("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI")
    headers: dict[str, str] = {}
    if relative:
        var, url = "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", f"http://{CONTAINER_HOST}{relative}"
        fix = f"check {var} (the ECS task's credentials path)"
        u = _split(url)
        if not relative.startswith("/") or u is None or u.netloc != CONTAINER_HOST:
            raise FormatError(f"{var} is not a path starting with '/' (it would send the request to another host "
                              f"than {CONTAINER_HOST}); fix it")
    else:
        var, url = "AWS_CONTAINER_CREDENTIALS_FULL_URI", env["AWS_CONTAINER_CREDENTIALS_FULL_URI"]
        fix = f"check {var} and AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE"
        u = _split(url)
        host = u.hostname if u is not None else None
        if u is None or not host or u.scheme not in ("http", "https") or (
                u.scheme == "http" and not (_loopback(host) or host in _CONTAINER_HOSTS)):
            raise FormatError(f"{var} is not an https:// URL, nor http:// to a loopback address or the container "
                              f"credential addresses ({', '.join(_CONTAINER_HOSTS)}); fix it")
        token_file = env.get("AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE")
        token = _token_file(token_file, "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE", fix) if token_file else \
            env.get("AWS_CONTAINER_AUTHORIZATION_TOKEN")
        if token is not None:
            if not _TOKEN.fullmatch(token):
                raise FormatError("AWS_CONTAINER_AUTHORIZATION_TOKEN is not one token (printable ASCII without "
                                  "spaces); fix it")
            headers["Authorization"] = token
    where = f"the container credentials ({var}) at"
    code, data = _fetch(where, fix, "GET", url, headers, METADATA_SECONDS)
    return _keys_answer(f"{where} {_shown(url)}", "refused", fix, code, data, now)


def _instance(now: float) -> Credentials:
    endpoint = (os.environ.get("AWS_METADATA_ENDPOINT") or METADATA_ENDPOINT).rstrip("/")
    fix = "check AWS_METADATA_ENDPOINT, or give keys and set AWS_EC2_METADATA_DISABLED=true"
    where = "the instance metadata service at"
    u = _split(endpoint)
    if u is None or u.scheme not in ("http", "https") or not u.hostname:
        raise FormatError(f"AWS_METADATA_ENDPOINT={_shown(endpoint)!r} is not an http:// URL; fix it")
    code, token = _fetch(where, fix, "PUT", f"{endpoint}/latest/api/token",
                         {"X-aws-ec2-metadata-token-ttl-seconds": "600"}, METADATA_SECONDS)
    headers: dict[str, str] = {}
    if code == 200:
        text = token.decode("latin-1").strip()
        if not _TOKEN.fullmatch(text):
            raise FormatError(f"{where} {endpoint}: its session token is not printable ASCII; {fix}")
        headers["X-aws-ec2-metadata-token"] = text
    elif not (code == 403 and flag("AWS_IMDSV1_FALLBACK")):
        raise FormatError(f"{where} {endpoint} refused a session token (HTTP {code}); {fix}")
    path = f"{endpoint}/latest/meta-data/iam/security-credentials/"
    code, role = _fetch(where, fix, "GET", path, headers, METADATA_SECONDS)
    name = role.decode("latin-1").strip().split("\n")[0].strip()
    if code != 200 or not _ROLE.fullmatch(name):
        raise FormatError(f"{where} {endpoint} names no IAM role (HTTP {code}); attach a role to the instance or "
                          f"{fix}")
    code, data = _fetch(where, fix, "GET", path + name, headers, METADATA_SECONDS)
    return _keys_answer(f"{where} {endpoint} (role {name})", "refused the role's keys", fix, code, data, now)


def _keys_answer(where: str, refused: str, fix: str, code: int, data: bytes, now: float) -> Credentials:
    """The keys of a credential service's JSON answer (the container endpoints' and IMDS's share one form),
    checked; or one line: ``{where} {refused} (HTTP code)`` where it did not answer 200."""
    if code != 200:
        raise FormatError(f"{where} {refused} (HTTP {code}); {fix}")
    got = _json_fields(where, fix, data)
    return _checked(where, fix, got.get("AccessKeyId"), got.get("SecretAccessKey"), got.get("Token"),
                    got.get("Expiration"), now)


def _configuration() -> tuple[str, ...]:
    """Everything :func:`_fetched` reads from the environment, as its cache key."""
    names = ("AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_ROLE_ARN", "AWS_ROLE_SESSION_NAME", "AWS_ENDPOINT_URL_STS",
             "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI",
             "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE", "AWS_CONTAINER_AUTHORIZATION_TOKEN", "AWS_METADATA_ENDPOINT",
             "AWS_EC2_METADATA_DISABLED", "AWS_IMDSV1_FALLBACK")
    return tuple(os.environ.get(n) or "" for n in names) + (CONTAINER_HOST, METADATA_ENDPOINT)


def _fetched(configuration: tuple[str, ...], region: str) -> Credentials:
    """Keys from the first temporary source configured (the module docstring's sources 3-6), or an
    empty :class:`Credentials` where none is; kept until :meth:`Credentials.stale`."""
    env, now = os.environ, time.time()
    if env.get("AWS_WEB_IDENTITY_TOKEN_FILE") and env.get("AWS_ROLE_ARN"):
        return _web_identity(region, now)
    if env.get("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI") or env.get("AWS_CONTAINER_CREDENTIALS_FULL_URI"):
        return _container(now)
    if metadata_asked():
        return _instance(now)
    return Credentials()


def resolve(bucket: str, kept: dict[tuple[Any, ...], Credentials] | None = None) -> Credentials:
    """The keys of a request to ``bucket`` (the module docstring's order), or one line saying why none.
    ``kept``: the session's keys from temporary sources (:class:`gtp_format.storage.objects.BucketState`), used
    until they are stale and replaced then; None fetches them anew."""
    if flag("AWS_SKIP_SIGNATURE"):
        return Credentials(source="AWS_SKIP_SIGNATURE")
    found = profiles.settings()  # a named profile that is absent, or a file that does not parse: one line
    if found.access_key_id is not None and found.secret_access_key is not None:
        source = f"profile {found.profile!r}" if found.profile else "AWS_ACCESS_KEY_ID"
        return Credentials(found.access_key_id, found.secret_access_key, found.session_token, source)
    key = (_configuration(), found.region or "us-east-1")
    got = kept.get(key) if kept is not None else None
    if got is None or got.stale(time.time()):  # close to their expiry: fetched again, as obstore refreshes them
        got = _fetched(*key)
        if kept is not None:
            kept[key] = got
    if got.key is not None:
        return got
    if found.no_keys_why is not None:
        raise FormatError(f"s3://{bucket}: {found.no_keys_why}")
    half = ""
    if os.environ.get("AWS_WEB_IDENTITY_TOKEN_FILE") and not os.environ.get("AWS_ROLE_ARN"):
        half = " (AWS_WEB_IDENTITY_TOKEN_FILE is set without AWS_ROLE_ARN)"
    raise FormatError(f"s3://{bucket}: no credentials in the environment or the AWS profile{half}; set "
                      "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and AWS_ENDPOINT_URL for a local or private "
                      f"store), or AWS_PROFILE naming a profile of {profiles.credentials_file()}, or "
                      "AWS_SKIP_SIGNATURE=true for a public bucket (on EC2: AWS_EC2_METADATA_DISABLED=false for the "
                      "instance's role)")
