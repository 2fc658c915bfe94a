"""Credentials, region and endpoint from AWS profiles (``~/.aws/credentials``, ``~/.aws/config``),
the environment winning as in the AWS CLI; temp files only (the fixture points both variables away
from the real home)."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_read import FIXTURES, ckpt, upload

from gtp_format.errors import FormatError
from gtp_format.storage import objects, profiles

ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_PROFILE",
       "AWS_REGION", "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_SKIP_SIGNATURE",
       "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI")


@pytest.fixture
def files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Write the credentials and config files (text), pointed at by their variables; no AWS variable else."""
    for k in ENV:
        monkeypatch.delenv(k, raising=False)
    creds, conf = tmp_path / "credentials", tmp_path / "config"
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(creds))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(conf))

    def write(credentials: str | None = None, config: str | None = None) -> tuple[Path, Path]:
        if credentials is not None:
            creds.write_text(credentials)
        if config is not None:
            conf.write_text(config)
        return creds, conf

    return write


CREDS = """[default]
aws_access_key_id = AKDEFAULT
aws_secret_access_key = secret-default

[dev]
aws_access_key_id = AKDEV
aws_secret_access_key = se%cret/dev
aws_session_token = token-dev
"""
CONFIG = """[default]
region = eu-west-1

[profile dev]
region = us-west-2
endpoint_url = http://127.0.0.1:9
aws_access_key_id = AKFROMCONFIG
aws_secret_access_key = from-config

[profile cfgonly]
aws_access_key_id = AKCFG
aws_secret_access_key = secret-cfg
region = ap-south-1

[profile role]
role_arn = arn:aws:iam::123456789012:role/x
source_profile = default
"""


def test_a_named_profile_from_both_files(files, monkeypatch):
    files(CREDS, CONFIG)
    monkeypatch.setenv("AWS_PROFILE", "dev")
    s = profiles.settings()
    # keys from the credentials file (before the config file's), "%" kept (no interpolation)
    assert (s.access_key_id, s.secret_access_key, s.session_token) == ("AKDEV", "se%cret/dev", "token-dev")
    assert (s.region, s.endpoint, s.profile) == ("us-west-2", "http://127.0.0.1:9", "dev")


def test_the_default_profile_and_config_only_profiles(files, monkeypatch):
    files(CREDS, CONFIG)
    s = profiles.settings()
    assert (s.access_key_id, s.secret_access_key, s.region, s.endpoint) == ("AKDEFAULT", "secret-default",
                                                                            "eu-west-1", None)
    monkeypatch.setenv("AWS_PROFILE", "cfgonly")
    s = profiles.settings()
    assert (s.access_key_id, s.secret_access_key, s.region) == ("AKCFG", "secret-cfg", "ap-south-1")


def test_the_environment_wins(files, monkeypatch):
    files(CREDS, CONFIG)
    monkeypatch.setenv("AWS_PROFILE", "dev")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKENV")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret-env")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "sa-east-1")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:7")
    s = profiles.settings()
    # the pair from the environment, and never the profile's token beside it
    assert (s.access_key_id, s.secret_access_key, s.session_token, s.profile) == ("AKENV", "secret-env", None, None)
    assert (s.region, s.endpoint) == ("sa-east-1", "http://127.0.0.1:7")
    monkeypatch.setenv("AWS_REGION", "ca-central-1")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:8")
    s = profiles.settings()
    assert (s.region, s.endpoint) == ("ca-central-1", "http://127.0.0.1:8")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")  # half a pair in the environment: the profile's whole pair
    assert profiles.settings().access_key_id == "AKDEV"


def test_an_absent_profile_is_one_line_naming_both_files(files, monkeypatch):
    creds, conf = files(CREDS, CONFIG)
    monkeypatch.setenv("AWS_PROFILE", "nosuch")
    with pytest.raises(FormatError) as e:
        profiles.settings()
    msg = e.value.message
    assert "AWS_PROFILE='nosuch'" in msg and str(creds) in msg and str(conf) in msg and "\n" not in msg
    with pytest.raises(FormatError, match="nosuch"):
        objects.credentials_problem("bucket")


@pytest.mark.parametrize("which", ["credentials", "config"])
def test_a_file_that_does_not_parse_is_one_line_naming_it(files, monkeypatch, which):
    bad = "aws_access_key_id = no section header\n"
    creds, conf = files(bad if which == "credentials" else CREDS, bad if which == "config" else CONFIG)
    monkeypatch.setenv("AWS_PROFILE", "dev")
    with pytest.raises(FormatError) as e:
        profiles.settings()
    msg = e.value.message
    assert str(creds if which == "credentials" else conf) in msg and "'dev'" in msg and "does not parse" in msg
    assert "\n" not in msg


@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_a_config_path_that_is_no_file_is_one_line(files, tmp_path, monkeypatch, kind):
    """A directory or a FIFO where the config file should be: one line, never a hang on the FIFO."""
    import os

    odd = tmp_path / "odd"
    odd.mkdir() if kind == "directory" else os.mkfifo(odd)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(odd))
    with pytest.raises(FormatError) as e:
        profiles.settings()
    assert str(odd) in e.value.message and "'default'" in e.value.message and "\n" not in e.value.message


def test_no_files_and_no_profile_is_no_credentials(files):
    s = profiles.settings()
    assert s == profiles.Settings()
    assert "no credentials in the environment or the AWS profile" in objects.credentials_problem("bucket")


def test_a_role_profile_says_what_is_not_run(files, monkeypatch):
    files(CREDS, CONFIG)
    monkeypatch.setenv("AWS_PROFILE", "role")
    problem = objects.credentials_problem("bucket")
    assert "profile 'role' has role_arn" in problem and "not run" in problem


def test_a_bucket_read_with_keys_and_endpoint_from_a_profile(s3, capsys, files, monkeypatch):
    """Against moto: nothing in the environment but AWS_PROFILE; keys, region and endpoint_url come from
    the files, and every command reads the bucket through them."""
    url = upload(s3, FIXTURES["dcp"], "runs/p")  # boto3's client was made with the fixture's environment
    files("[ci]\naws_access_key_id = testing\naws_secret_access_key = testing\n",
          f"[profile ci]\nregion = us-east-1\nendpoint_url = {s3.endpoint}\n")
    monkeypatch.setenv("AWS_PROFILE", "ci")
    code, out, err = ckpt(capsys, "verify", url, "--data")
    assert code == 0, (out, err)
    code, _, err = ckpt(capsys, "reshard", url, s3.url("runs/q"), "--dp", "1")
    assert code == 0, err
    assert any(k.endswith("metadata.json") for k in s3.keys("runs/q/"))
    monkeypatch.setenv("AWS_PROFILE", "absent")
    code, _, err = ckpt(capsys, "verify", url)
    assert code == 2 and err.count("\n") == 1 and "AWS_PROFILE='absent'" in err, err
