"""Hostile AWS profile files and settings (``AWS_SHARED_CREDENTIALS_FILE``, ``AWS_CONFIG_FILE``,
``AWS_PROFILE``, the endpoint and key variables), by class, through ``ckpt`` itself.

Every case: exit 2, one ``ckpt: error:`` line naming the file (and section and key) or the variable
and the fix, no traceback, the secret never printed, no request sent anywhere (the client is never
built: :func:`objects._store_for` is watched), and reads of the file bounded (a 1 GiB file, a
character device without end: the process's peak memory does not grow by what the file holds).
Temp files only; the fixture points both file variables away from the real home.
"""

from __future__ import annotations

import os
import resource
from pathlib import Path

import pytest
from test_faults import fake_server
from test_read import ckpt

from gtp_format.storage import objects, profiles

ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_PROFILE",
       "AWS_REGION", "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_SKIP_SIGNATURE",
       "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI",
       "AWS_EC2_METADATA_DISABLED")
SECRET = "s3cr3t-HOSTILE-9f2a"
URL = "s3://ckpt-test/run"
GOOD_CREDS = f"[default]\naws_access_key_id = AKGOOD\naws_secret_access_key = {SECRET}\n"


@pytest.fixture
def aws(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """(credentials path, config path, clients built); no AWS variable but the two file paths."""
    for k in ENV:
        monkeypatch.delenv(k, raising=False)
    creds, conf = tmp_path / "credentials", tmp_path / "config"
    monkeypatch.setenv(profiles.CREDENTIALS_ENV, str(creds))
    monkeypatch.setenv(profiles.CONFIG_ENV, str(conf))
    built: list[tuple] = []
    real = objects._store_for

    def watched(*args):
        built.append(args)
        return real(*args)

    monkeypatch.setattr(objects, "_store_for", watched)
    return creds, conf, built


def refused(capsys, built: list, *words: str, argv: tuple[str, ...] = ("inspect", URL)) -> str:
    code, out, err = ckpt(capsys, *argv)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("ckpt: error: "), (code, out, err)
    assert "Traceback" not in out + err and SECRET not in out + err, err
    for w in words:
        assert w in lines[0], (w, lines[0])
    assert not built, "a client was built (and could have sent a request) for settings that were refused"
    return lines[0]


# -- the files themselves: what sits at the path, and what it holds --------------------------------

def _fifo(p: Path) -> None:
    os.mkfifo(p)


def _huge(p: Path) -> None:
    with open(p, "wb") as f:
        f.truncate(1 << 30)  # 1 GiB (sparse): a whole read would take the process past 1 GiB


FILES = {
    "a directory": (lambda p: p.mkdir(), "is not a regular file"),
    "a FIFO": (_fifo, "is not a regular file"),
    "1 GiB": (_huge, "is over 1048576 bytes"),
    "/dev/zero": (lambda p: p.symlink_to("/dev/zero"), "is over 1048576 bytes"),
    "a symlink loop": (lambda p: p.symlink_to(p), "cannot be read"),
    "a path through a file": (None, "cannot be read"),
    "binary garbage": (lambda p: p.write_bytes(bytes(range(256)) * 16), "does not parse"),
    "not UTF-8": (lambda p: p.write_bytes(b"[default]\nregion = caf\xe9\n"), "does not parse"),
    "no section header": (lambda p: p.write_text("aws_access_key_id = AK\n"), "does not parse"),
    "a half header": (lambda p: p.write_text("[default\naws_access_key_id = AK\n"), "does not parse"),
    "duplicate sections": (lambda p: p.write_text(GOOD_CREDS + GOOD_CREDS), "already exists"),
    "duplicate keys": (lambda p: p.write_text(GOOD_CREDS + "aws_access_key_id = AKOTHER\n"), "already exists"),
}


@pytest.mark.parametrize("which", ["credentials", "config"])
@pytest.mark.parametrize("case", sorted(FILES))
def test_a_file_that_is_not_an_aws_file(aws, capsys, tmp_path, monkeypatch, which, case):
    creds, conf, built = aws
    path = creds if which == "credentials" else conf
    make, word = FILES[case]
    if make is None:  # ENOTDIR: the variable names a path below a regular file
        (tmp_path / "plain").write_text("x")
        path = tmp_path / "plain" / which
        monkeypatch.setenv(profiles.CREDENTIALS_ENV if which == "credentials" else profiles.CONFIG_ENV, str(path))
    else:
        make(path)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    line = refused(capsys, built, str(path), word, f"AWS {which} file")
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert grown_mb < 64, f"peak memory grew {grown_mb:.0f} MB reading {case}: {line}"


def test_a_missing_file_is_no_file_and_a_named_absent_profile_is_one_line(aws, capsys, monkeypatch):
    _, _, built = aws  # neither file exists
    refused(capsys, built, "no credentials in the environment or the AWS profile")
    monkeypatch.setenv("AWS_PROFILE", "nobody")
    refused(capsys, built, "AWS_PROFILE='nobody'", "add the profile")


@pytest.mark.parametrize("name", [" ", "nobody", "default]\n[x", "\x1b]0;pwned\x07", "../../etc/passwd"])
def test_aws_profile_naming_nothing(aws, capsys, monkeypatch, name):
    creds, _, built = aws
    creds.write_text(GOOD_CREDS)
    monkeypatch.setenv("AWS_PROFILE", name)
    line = refused(capsys, built, "AWS_PROFILE=")
    assert "\x1b" not in line and "\x07" not in line and "\n" not in line


# -- values: keys, secrets, region, endpoint -------------------------------------------------------

CREDENTIAL_VALUES = {
    "a continuation line": f"{SECRET}\n  X-Amz-Security-Token: forged",
    "a carriage return": f"{SECRET}\rX",
    "a NUL": f"{SECRET}\x00",
    "a space": f"{SECRET} x",
    "non-ASCII": f"{SECRET}\u00e9",
}


@pytest.mark.parametrize("field", ["aws_access_key_id", "aws_secret_access_key", "aws_session_token"])
@pytest.mark.parametrize("case", sorted(CREDENTIAL_VALUES))
def test_a_credential_with_a_line_break_or_control_character(aws, capsys, field, case):
    creds, _, built = aws
    values = {"aws_access_key_id": "AKGOOD", "aws_secret_access_key": "s3cret-other", "aws_session_token": "tok"}
    values[field] = CREDENTIAL_VALUES[case]
    lines = "".join(f"{k} = {v}\n" for k, v in values.items())
    creds.write_bytes(("[default]\n" + lines).encode("utf-8"))
    refused(capsys, built, str(creds), "[default]", field, "fix it there")


@pytest.mark.parametrize("var", ["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"])
def test_a_credential_variable_with_a_line_break(aws, capsys, monkeypatch, var):
    _, _, built = aws
    env = {"AWS_ACCESS_KEY_ID": "AKENV", "AWS_SECRET_ACCESS_KEY": "secret-env", "AWS_SESSION_TOKEN": "tok"}
    env[var] = SECRET + "\nX-Forged: 1"
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    refused(capsys, built, var)


ENDPOINTS = {
    "not a URL": ("not a url", "a space"),
    "file://": ("file:///etc/passwd", "file://"),
    "ftp://": ("ftp://127.0.0.1:21/", "ftp://"),
    "javascript:": ("javascript:alert(1)", "javascript"),
    "no scheme": ("127.0.0.1:9000", "not http:// or https://"),
    "no host": ("http://", "names no host"),
    "a bad port": ("http://127.0.0.1:notaport", "does not parse"),
    "a port out of range": ("http://127.0.0.1:99999", "does not parse"),
    "a password in it": (f"http://user:{SECRET}@127.0.0.1:9000", "user name or password"),
    "a query": ("http://127.0.0.1:9000/?x-id=1", "query"),
    "a continuation line": ("http://127.0.0.1:9000\n  http://169.254.169.254", "a control character"),
}


@pytest.mark.parametrize("where", ["config", "credentials", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"])
@pytest.mark.parametrize("case", sorted(ENDPOINTS))
def test_an_endpoint_that_is_not_an_http_url(aws, capsys, monkeypatch, where, case):
    creds, conf, built = aws
    value, word = ENDPOINTS[case]
    creds.write_text(GOOD_CREDS + (f"endpoint_url = {value}\n" if where == "credentials" else ""))
    if where == "config":
        conf.write_text(f"[default]\nendpoint_url = {value}\n")
    elif where.startswith("AWS_"):
        monkeypatch.setenv(where, value)
    source = {"config": f"{conf} [default] endpoint_url", "credentials": f"{creds} [default] endpoint_url"}
    refused(capsys, built, source.get(where, where), "is not an S3 endpoint URL", word)


@pytest.mark.parametrize("value", ["us-east-1\n  x", "us east 1", "eu-west-1\x1b[2K"])
def test_a_region_that_is_not_a_name(aws, capsys, value):
    creds, conf, built = aws
    creds.write_text(GOOD_CREDS)
    conf.write_text(f"[default]\nregion = {value}\n")
    line = refused(capsys, built, f"{conf} [default] region", "is not a region name")
    assert "\x1b" not in line


def test_an_inactive_profiles_endpoint_is_never_used(aws, capsys, monkeypatch):
    """The instance-metadata address in a profile nobody named: the active profile's endpoint (a silent
    local server) is the only one asked, and the other profile's bad values are not even read."""
    creds, conf, built = aws
    creds.write_text(GOOD_CREDS + "\n[other]\naws_access_key_id = AK\n  broken\naws_secret_access_key = x\n")
    with fake_server(None) as (endpoint, count):
        conf.write_text(f"[default]\nendpoint_url = {endpoint}\n\n[profile other]\nendpoint_url = "
                        "http://169.254.169.254\n")
        monkeypatch.setenv(objects.TIMEOUT_ENV, "1")
        code, _, err = ckpt(capsys, "inspect", URL)
        assert code == 2 and "did not answer" in err and SECRET not in err, err
        assert count and [b[1] for b in built] == [endpoint] * len(built)


def test_no_credentials_builds_no_client(aws, capsys):
    """With nothing configured (and AWS_EC2_METADATA_DISABLED unset) no client exists, so nothing can ask
    the instance-metadata address for credentials."""
    creds, conf, built = aws
    conf.write_text("[default]\nregion = us-east-1\n")
    refused(capsys, built, "no credentials in the environment or the AWS profile")
