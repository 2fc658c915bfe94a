"""The S3 client's settings: the AWS environment, then a profile of the shared credentials and config files.

Where a setting comes from, first source that has it (the AWS CLI's order, from its user guide,
"Configuring settings for the AWS CLI", section "Configuration and credentials precedence":
environment variables, then the credentials file, then the config file; checked for this module):

* access key, secret and session token: ``AWS_ACCESS_KEY_ID`` + ``AWS_SECRET_ACCESS_KEY`` (+
  ``AWS_SESSION_TOKEN``) as a pair, else the profile's ``aws_access_key_id`` +
  ``aws_secret_access_key`` (+ ``aws_session_token``), the credentials file's section before the
  config file's; a pair is never mixed from two sources;
* region: ``AWS_REGION``, ``AWS_DEFAULT_REGION``, then the profile's ``region``;
* endpoint: ``AWS_ENDPOINT_URL_S3``, ``AWS_ENDPOINT_URL``, then the profile's ``endpoint_url``.

The profile is ``AWS_PROFILE`` (default ``default``). The credentials file
(``AWS_SHARED_CREDENTIALS_FILE``, default ``~/.aws/credentials``) names it ``[NAME]``; the config
file (``AWS_CONFIG_FILE``, default ``~/.aws/config``) ``[profile NAME]`` (``[default]`` for the
default one). Both are parsed with :mod:`configparser`, without interpolation (a secret may hold a
``%``), each read only up to :data:`MAX_FILE` bytes. A profile named by ``AWS_PROFILE`` that neither
file holds, and a file that does not parse, are one line naming the file and the profile: the AWS
CLI refuses both too, and taking them silently would send requests with other credentials than the
user named. Roles (``role_arn``), SSO and ``credential_process`` are not run: a profile with only
those is said to have no keys, by name.

Why this module reads the files and not obstore: obstore's S3 client takes its settings from the
environment only; the files are how most users keep their keys and a private store's endpoint.
"""

from __future__ import annotations

import configparser
import functools
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from gtp_format.errors import FormatError

MAX_FILE = 1 << 20  # an AWS config or credentials file is a few KiB; a bigger one is not one
CREDENTIALS_ENV, CONFIG_ENV, PROFILE_ENV = "AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE", "AWS_PROFILE"
_NOT_RUN = ("role_arn", "credential_process", "sso_session", "sso_start_url", "web_identity_token_file")


@dataclass(frozen=True)
class Settings:
    """What the S3 client is given; None: not set anywhere (obstore's own defaults apply)."""

    access_key_id: str | None = None
    secret_access_key: str | None = None
    session_token: str | None = None
    region: str | None = None
    endpoint: str | None = None
    profile: str | None = None  # the profile the keys came from, if they did
    no_keys_why: str | None = None  # a profile with roles/SSO only: why its keys are not used


def credentials_file() -> Path:
    return Path(os.environ.get(CREDENTIALS_ENV) or Path.home() / ".aws" / "credentials")


def config_file() -> Path:
    return Path(os.environ.get(CONFIG_ENV) or Path.home() / ".aws" / "config")


def _stamp(path: Path) -> tuple[str, int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return (str(path), st.st_mtime_ns, st.st_size)


def _parse(path: Path, what: str, env: str, profile: str) -> configparser.ConfigParser | None:
    """The file's sections, or None if there is no such file; a file that does not parse: one line."""
    fix = f"fix it, or point {env} at another file"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO named so must not hang the client
    except FileNotFoundError:
        return None
    except OSError as e:
        raise FormatError(f"{path} (the AWS {what} file, profile {profile!r}): cannot be read "
                          f"({e.strerror or e}); {fix}") from None
    mode = os.fstat(fd).st_mode
    if not (stat.S_ISREG(mode) or stat.S_ISCHR(mode)):  # a file, or /dev/null (no file)
        os.close(fd)
        raise FormatError(f"{path} (the AWS {what} file, profile {profile!r}) is not a regular file; {fix}")
    with os.fdopen(fd, "rb") as f:
        try:
            raw = f.read(MAX_FILE + 1)
        except OSError as e:
            raise FormatError(f"{path} (the AWS {what} file, profile {profile!r}): cannot be read "
                              f"({e.strerror or e}); {fix}") from None
    if len(raw) > MAX_FILE:
        raise FormatError(f"{path} (the AWS {what} file, profile {profile!r}) is over {MAX_FILE} bytes: not an "
                          f"AWS {what} file; {fix}")
    # "default" is a profile here, not configparser's section of defaults for every other one
    parser = configparser.ConfigParser(interpolation=None, default_section="\x00none", strict=True)
    try:
        parser.read_string(raw.decode("utf-8"), str(path))
    except (configparser.Error, UnicodeDecodeError) as e:
        first = " ".join(str(e).split())[:200]
        raise FormatError(f"{path} (the AWS {what} file, profile {profile!r}) does not parse: {first}; {fix}") from None
    return parser


def _section(parser: configparser.ConfigParser | None, name: str) -> dict[str, str] | None:
    if parser is None or not parser.has_section(name):
        return None
    return {k.lower(): v.strip() for k, v in parser.items(name)}


@functools.lru_cache(maxsize=8)
def _profile(name: str, named: bool, creds: tuple[str, int, int] | None, conf: tuple[str, int, int] | None,
             creds_path: str, conf_path: str) -> tuple[dict[str, str], dict[str, str]]:
    """(credentials-file section, config-file section) of ``name``; cached by the files' stamps."""
    a = _section(_parse(Path(creds_path), "credentials", CREDENTIALS_ENV, name), name) if creds else None
    conf_parser = _parse(Path(conf_path), "config", CONFIG_ENV, name) if conf else None
    b = _section(conf_parser, f"profile {name}")
    if b is None and name == "default":
        b = _section(conf_parser, "default")
    if named and a is None and b is None:
        raise FormatError(f"{PROFILE_ENV}={name!r}: no [{name}] in {creds_path} (the AWS credentials file) and no "
                          f"[profile {name}] in {conf_path} (the AWS config file); fix {PROFILE_ENV} or add the "
                          "profile")
    return a or {}, b or {}


def settings() -> Settings:
    """The client's settings from the environment and the profile (see the module docstring)."""
    env = os.environ
    name = env.get(PROFILE_ENV) or "default"
    cpath, fpath = credentials_file(), config_file()
    creds, conf = _profile(name, bool(env.get(PROFILE_ENV)), _stamp(cpath), _stamp(fpath), str(cpath), str(fpath))
    region = env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or creds.get("region") or conf.get("region")
    endpoint = (env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL") or creds.get("endpoint_url")
                or conf.get("endpoint_url"))
    common = {"region": region or None, "endpoint": endpoint or None}
    if env.get("AWS_ACCESS_KEY_ID") and env.get("AWS_SECRET_ACCESS_KEY"):
        return Settings(env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"],
                        env.get("AWS_SESSION_TOKEN") or env.get("AWS_SECURITY_TOKEN") or None, **common)
    for section in (creds, conf):
        if section.get("aws_access_key_id") and section.get("aws_secret_access_key"):
            return Settings(section["aws_access_key_id"], section["aws_secret_access_key"],
                            section.get("aws_session_token") or None, profile=name, **common)
    why = None
    roles = sorted(k for s in (creds, conf) for k in s if k in _NOT_RUN)
    if roles:
        why = (f"profile {name!r} has {', '.join(roles)} but no aws_access_key_id and aws_secret_access_key "
               f"({cpath}, {fpath}); roles, SSO and credential_process are not run: export the keys instead")
    return Settings(**common, no_keys_why=why)
