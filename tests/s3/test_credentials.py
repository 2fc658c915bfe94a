"""Temporary keys from every source obstore would use, against moto as the bucket: STS web identity, the container
endpoints (relative and full URI with its authorization token), the instance metadata service (IMDSv2 and its
IMDSv1 fallback). Each credential service is a scripted endpoint on 127.0.0.1 (``fake_endpoint``).

Each case runs ``verify --data`` (a listing, then ranged reads) and checks that the listing (the tool's own,
:mod:`gtp_format.storage.listing`) and every obstore client were given the keys the service answered, that the
service was asked once for the whole command, and that nothing printed a secret.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import fake_endpoint
import pytest
from s3_server import run_ckpt as ckpt
from s3_server import upload
from test_read import FIXTURES

from gtp_format.storage import credentials, listing, objects

KEY, SECRET, TOKEN = "ASIATEMPORARYKEY", "tmp-SECRET-4f1c/+x", "FwoGZXIvYXdzEJr//TOKEN+="
STATIC = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN",
          "AWS_EC2_METADATA_DISABLED")


@pytest.fixture
def temporary(s3, monkeypatch, tmp_path):
    """The bucket holds a checkpoint; no static keys; the listings' clients and obstore's are watched.
    Yields (URL, listing clients, obstore client arguments)."""
    url = upload(s3, FIXTURES["dcp"], "runs/t")
    for k in STATIC:
        monkeypatch.delenv(k, raising=False)
    # never the real link-local services of wherever the tests run: a closed loopback port instead
    monkeypatch.setattr(credentials, "CONTAINER_HOST", "127.0.0.1:9")
    monkeypatch.setattr(credentials, "METADATA_ENDPOINT", "http://127.0.0.1:9")
    clients, stores = [], []
    real_client, real_store = objects.listing_client, objects._store_for

    def client(bucket, state=None):
        clients.append(c := real_client(bucket, state))
        return c

    def store(*args):
        stores.append(args)
        return real_store(*args)

    monkeypatch.setattr(objects, "listing_client", client)
    monkeypatch.setattr(objects, "_store_for", store)
    yield url, clients, stores


def signed_with_the_answer(capsys, url: str, clients: list, stores: list) -> None:
    code, out, err = ckpt(capsys, "verify", url, "--data")
    assert code == 0, (out, err)
    assert SECRET not in out + err and TOKEN not in out + err
    assert clients and all((c.key, c.secret, c.token) == (KEY, SECRET, TOKEN) for c in clients)
    assert stores and all(a[-3:] == (KEY, SECRET, TOKEN) for a in stores), "obstore got other keys"
    assert all(SECRET not in repr(c) and TOKEN not in repr(c) for c in clients)


@contextlib.contextmanager
def service(answer) -> Iterator[fake_endpoint.Endpoint]:
    with fake_endpoint.serve(answer) as ep:
        yield ep


def test_web_identity_keys_from_sts(temporary, capsys, monkeypatch, tmp_path: Path):
    url, clients, stores = temporary
    (tmp_path / "jwt").write_text("eyJhbGciOi.payload.sig\n")

    def sts(req):
        req.reply(200, fake_endpoint.sts_answer(KEY, SECRET, TOKEN, fake_endpoint.later()), "text/xml")

    with service(sts) as ep:
        monkeypatch.setenv("AWS_WEB_IDENTITY_TOKEN_FILE", str(tmp_path / "jwt"))
        monkeypatch.setenv("AWS_ROLE_ARN", "arn:aws:iam::123456789012:role/ckpt")
        monkeypatch.setenv("AWS_ENDPOINT_URL_STS", ep.url)
        signed_with_the_answer(capsys, url, clients, stores)
    assert ep.count() == 1, "one STS call for the whole command"
    from urllib.parse import parse_qs

    form = {k: v[0] for k, v in parse_qs(ep.requests[0].body.decode()).items()}
    assert ep.requests[0].method == "POST" and form["Action"] == "AssumeRoleWithWebIdentity"
    assert form["WebIdentityToken"] == "eyJhbGciOi.payload.sig" and form["RoleSessionName"] == "WebIdentitySession"
    assert form["RoleArn"] == "arn:aws:iam::123456789012:role/ckpt" and "WebIdentityToken" not in ep.requests[0].path


@pytest.mark.parametrize("how", ["full-uri+token-file", "full-uri+token", "relative-uri"])
def test_container_keys(temporary, capsys, monkeypatch, tmp_path: Path, how):
    url, clients, stores = temporary

    def container(req):
        req.reply(200, fake_endpoint.container_answer(KEY, SECRET, TOKEN, fake_endpoint.later()), "application/json")

    with service(container) as ep:
        if how == "relative-uri":
            monkeypatch.setattr(credentials, "CONTAINER_HOST", ep.url.removeprefix("http://"))
            monkeypatch.setenv("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "/v2/credentials/abc")
        else:
            monkeypatch.setenv("AWS_CONTAINER_CREDENTIALS_FULL_URI", ep.url + "/v1/credentials")
            if how == "full-uri+token-file":
                (tmp_path / "tok").write_text("pod-identity-token\n")
                monkeypatch.setenv("AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE", str(tmp_path / "tok"))
            else:
                monkeypatch.setenv("AWS_CONTAINER_AUTHORIZATION_TOKEN", "pod-identity-token")
        signed_with_the_answer(capsys, url, clients, stores)
    assert ep.count() == 1
    r = ep.requests[0]
    if how == "relative-uri":
        assert r.path == "/v2/credentials/abc" and "authorization" not in r.headers
    else:
        assert r.path == "/v1/credentials" and r.headers["authorization"] == "pod-identity-token"


@pytest.mark.parametrize("v1", [False, True], ids=["imdsv2", "imdsv1-fallback"])
def test_instance_metadata_keys(temporary, capsys, monkeypatch, v1):
    url, clients, stores = temporary

    def imds(req):
        if req.method == "PUT" and req.path == "/latest/api/token":
            if v1:
                req.reply(403)
            else:
                req.reply(200, b"IMDS-SESSION-TOKEN", "text/plain")
            return
        if not v1 and req.headers.get("x-aws-ec2-metadata-token") != "IMDS-SESSION-TOKEN":
            req.reply(401)
        elif req.path == "/latest/meta-data/iam/security-credentials/":
            req.reply(200, b"ckpt-role", "text/plain")
        elif req.path == "/latest/meta-data/iam/security-credentials/ckpt-role":
            req.reply(200, fake_endpoint.container_answer(KEY, SECRET, TOKEN, fake_endpoint.later()), "text/plain")
        else:
            req.reply(404)

    with service(imds) as ep:
        monkeypatch.setenv("AWS_METADATA_ENDPOINT", ep.url)
        if v1:
            monkeypatch.setenv("AWS_IMDSV1_FALLBACK", "true")
        signed_with_the_answer(capsys, url, clients, stores)
    assert [(r.method, r.path) for r in ep.requests] == [
        ("PUT", "/latest/api/token"), ("GET", "/latest/meta-data/iam/security-credentials/"),
        ("GET", "/latest/meta-data/iam/security-credentials/ckpt-role")]
    assert ep.requests[0].headers["x-aws-ec2-metadata-token-ttl-seconds"] == "600"


def test_the_first_source_wins_and_static_keys_ask_nothing(temporary, capsys, monkeypatch, tmp_path: Path):
    """object_store's order: the key pair before web identity before the container endpoint."""
    url, clients, _ = temporary
    asked = []
    with service(lambda req: (asked.append(req.path), req.reply(500))) as ep:
        (tmp_path / "jwt").write_text("t")
        monkeypatch.setenv("AWS_WEB_IDENTITY_TOKEN_FILE", str(tmp_path / "jwt"))
        monkeypatch.setenv("AWS_ROLE_ARN", "arn:aws:iam::1:role/r")
        monkeypatch.setenv("AWS_ENDPOINT_URL_STS", ep.url)
        monkeypatch.setenv("AWS_CONTAINER_CREDENTIALS_FULL_URI", ep.url + "/container")
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
        code, out, err = ckpt(capsys, "verify", url)
        assert code == 0 and not asked and clients[0].key == "testing", (out, err)
        monkeypatch.delenv("AWS_ACCESS_KEY_ID")
        code, _, err = ckpt(capsys, "verify", url)
    assert code == 2 and asked == ["/"] * len(asked) and len(asked) == 2, asked  # STS, tried twice (5xx)
    assert "AWS_WEB_IDENTITY_TOKEN_FILE" in err and "did not answer" in err, err


def test_keys_are_fetched_again_before_they_expire(monkeypatch):
    """Keys within 5 minutes of their expiry are fetched again (obstore's margin); fresh ones are kept."""
    left = [120.0, 3600.0]

    def container(req):
        req.reply(200, fake_endpoint.container_answer(KEY, SECRET, TOKEN, fake_endpoint.later(left[0])))

    for k in STATIC:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/dev/null")
    kept: dict = {}  # a session's
    with service(container) as ep:
        monkeypatch.setenv("AWS_CONTAINER_CREDENTIALS_FULL_URI", ep.url + "/c")
        first = credentials.resolve("b", kept)
        assert first.key == KEY and ep.count() == 1
        credentials.resolve("b", kept)
        assert ep.count() == 1, "2 minutes left of 2: kept until half of that is spent"
        monkeypatch.setattr(credentials.time, "time", lambda: first.expires - 30)
        left[0] = 3600.0
        again = credentials.resolve("b", kept)
        assert ep.count() == 2 and again.expires > first.expires
        credentials.resolve("b", kept)
        assert ep.count() == 2


def test_a_virtual_hosted_listing_is_signed_and_bounded(monkeypatch, capsys):
    """``AWS_VIRTUAL_HOSTED_STYLE_REQUEST``: the endpoint is the bucket's own, the listing asks ``/?list-type=2``
    (the bucket not in the path) through the bounded reader."""
    from s3_server import point_env

    def store(req):
        if fake_endpoint.is_listing(req):
            req.reply(200, b'<?xml version="1.0"?><ListBucketResult><IsTruncated>false</IsTruncated><Contents><Key>'
                           b"run/iter_0000001/.metadata</Key><Size>3</Size></Contents></ListBucketResult>")
        else:
            req.reply(404, fake_endpoint.MISSING)

    with service(store) as ep:
        point_env(monkeypatch, ep.url)
        monkeypatch.setenv("AWS_VIRTUAL_HOSTED_STYLE_REQUEST", "true")
        code, _, err = ckpt(capsys, "inspect", "s3://ckpt-test/run/iter_0000001")
    listings = [r for r in ep.requests if fake_endpoint.is_listing(r)]
    assert listings and all(r.path == "/" and r.q("prefix") == "run/iter_0000001/" for r in listings), ep.requests
    assert all(r.headers["authorization"].startswith("AWS4-HMAC-SHA256 Credential=testing/") for r in listings)
    assert code == 2 and err.count("\n") == 1, err  # the object itself is missing: one line, after the listing


def test_the_virtual_hosted_signature_is_botocores():
    from datetime import datetime, timezone

    from botocore.auth import S3SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    c = listing.Client("https://my-bucket.s3.eu-west-3.amazonaws.com", "eu-west-3", "AKIDEXAMPLE", "wJalr/K7MDENG",
                       TOKEN, 60.0, 3, 30.0, hosted=True)
    query = [("list-type", "2"), ("prefix", "run a+b/é~x/")]
    now = datetime(2026, 12, 6, 11, 0, 0, tzinfo=timezone.utc)
    url, headers = listing.request(c, "my-bucket", query, now)
    assert url.startswith("https://my-bucket.s3.eu-west-3.amazonaws.com/?list-type=2&"), url
    req = AWSRequest(method="GET", url=url, headers={"X-Amz-Date": headers["x-amz-date"],
                                                     "X-Amz-Content-SHA256": headers["x-amz-content-sha256"],
                                                     "X-Amz-Security-Token": TOKEN})
    auth = S3SigV4Auth(Credentials("AKIDEXAMPLE", "wJalr/K7MDENG", TOKEN), "s3", "eu-west-3")
    req.context["timestamp"] = headers["x-amz-date"]
    canonical = auth.canonical_request(req)
    assert headers["authorization"].endswith(f"Signature={auth.signature(auth.string_to_sign(req, canonical), req)}")


def test_obstores_aliases_reach_the_listing_too(monkeypatch):
    """obstore reads ``AWS_ENDPOINT`` and ``AWS_TOKEN`` from the environment; the listing it no longer sends must
    use them too, or it would go to AWS (or unsigned by the token) while obstore's reads go elsewhere."""
    for k in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/dev/null")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    monkeypatch.setenv("AWS_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("AWS_TOKEN", TOKEN)
    c = objects.listing_client("b")
    assert c.endpoint == "http://127.0.0.1:9" and c.token == TOKEN
