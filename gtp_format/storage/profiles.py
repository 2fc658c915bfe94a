"""The S3 client's settings: the AWS environment, then a profile of the shared credentials and config files.

Where a setting comes from, first source that has it (the AWS CLI's order, from its user guide,
"Configuring settings for the AWS CLI", section "Configuration and credentials precedence":
environment variables, then the credentials file, then the config file; checked for this module):

* access key, secret and session token: ``AWS_ACCESS_KEY_ID`` + ``AWS_SECRET_ACCESS_KEY`` (+
  ``AWS_SESSION_TOKEN``, or obstore's ``AWS_TOKEN``, or ``AWS_SECURITY_TOKEN``) as a pair, else the
  profile's ``aws_access_key_id`` +
  ``aws_secret_access_key`` (+ ``aws_session_token``), the credentials file's section before the
  config file's; a pair is never mixed from two sources;
* region: ``AWS_REGION``, ``AWS_DEFAULT_REGION``, then the profile's ``region``;
* endpoint: ``AWS_ENDPOINT_URL_S3``, ``AWS_ENDPOINT_URL``, ``AWS_ENDPOINT`` (obstore reads it too), then
  the profile's ``endpoint_url``.

The profile is ``AWS_PROFILE`` (default ``default``). The credentials file
(``AWS_SHARED_CREDENTIALS_FILE``, default ``~/.aws/credentials``) names it ``[NAME]``; the config
file (``AWS_CONFIG_FILE``, default ``~/.aws/config``) ``[profile NAME]`` (``[default]`` for the
default one). Both are parsed with :mod:`configparser`, without interpolation (a secret may hold a
``%``), each read only up to :data:`MAX_FILE` bytes. A profile named by ``AWS_PROFILE`` that neither
file holds, and a file that does not parse, are one line naming the file and the profile: the AWS
CLI refuses both too, and taking them silently would send requests with other credentials than the
user named. Roles (``role_arn``), SSO and ``credential_process`` are not run: a profile with only
those is said to have no keys, by name.

Every value taken is checked where it came from (:func:`_checked`), and a bad one is one line naming
its source (the variable, or the file, section and key) and never the secret itself: keys, secrets
and tokens are printable ASCII without spaces (an indented line after a key in these files continues
its value, and a stray indent handed ``SECRET\\nX-Header: ...`` to the client to sign and send); a
region is a plain name; an endpoint is an ``http://`` or ``https://`` URL with a host and nothing else
(``file://``, ``ftp://``, text that is no URL, or a URL with a user and password in it were handed to
the client as they were).

Why this module reads the files and not obstore: obstore's S3 client takes its settings from the
environment only; the files are how most users keep their keys and a private store's endpoint.
"""

from __future__ import annotations

import configparser
import functools
import os
import re
import stat
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

from gtp_format.errors import FormatError

MAX_FILE = 1 << 20  # an AWS config or credentials file is a few KiB; a bigger one is not one
CREDENTIALS_ENV, CONFIG_ENV, PROFILE_ENV = "AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE", "AWS_PROFILE"
_NOT_RUN = ("role_arn", "credential_process", "sso_session", "sso_start_url", "web_identity_token_file")
_TOKEN = re.compile(r"[\x21-\x7e]+")  # an access key id, secret or session token: printable ASCII, no space
_REGION = re.compile(r"[A-Za-z0-9_.-]{1,64}")


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
    """The file's identity for the cache; None only when there is no such file (a symlink loop or a
    path through a regular file is read, so that :func:`_parse` names the error, not skipped)."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    except OSError:
        return (str(path), -1, -1)
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


def _endpoint_problem(value: str) -> str | None:
    """Why ``value`` is not an S3 endpoint URL (``http(s)://HOST[:PORT][/PATH]``), or None."""
    if not _TOKEN.fullmatch(value):
        return "it has a space, a control character or a non-ASCII character"
    try:
        url = urllib.parse.urlsplit(value)
        url.port  # noqa: B018 - raises on a port that is not a number in range
    except ValueError as e:
        return f"it does not parse as a URL ({e})"
    if url.scheme.lower() not in ("http", "https"):
        return f"its scheme is {url.scheme + '://' if url.scheme else 'missing'}, not http:// or https://"
    if not url.hostname:
        return "it names no host"
    if url.username is not None or url.password is not None:
        return "it holds a user name or password (give keys as aws_access_key_id and aws_secret_access_key)"
    if url.query or url.fragment:
        return "it has a query or fragment"
    return None


def _checked(kind: str, value: str, where: str) -> str:
    """``value`` of a setting (``kind``: credential, region or endpoint) from ``where``, or one line."""
    fix = "fix it there"
    if kind == "credential":
        if not _TOKEN.fullmatch(value):  # never printed: it may be a secret
            raise FormatError(f"{where} has a space, a line break, a control character or a non-ASCII character "
                              "(an indented line below a key in an AWS file continues its value); keys, secrets and "
                              f"tokens never do: {fix}")
        return value
    if kind == "region":
        if not _REGION.fullmatch(value):
            raise FormatError(f"{where} = {value[:80]!r} is not a region name (letters, digits, '-', '_', '.'); {fix}")
        return value
    why = _endpoint_problem(value)
    if why is not None:
        shown = "(not shown)" if "password" in why else repr(value[:120])
        raise FormatError(f"{where} = {shown} is not an S3 endpoint URL: {why}; write http://HOST:PORT or "
                          f"https://HOST, and {fix}")
    return value


def _first(kind: str, candidates: list[tuple[str, str | None]]) -> str | None:
    """The first non-empty value of ``(where, value)`` candidates, checked (:func:`_checked`)."""
    for where, value in candidates:
        if value:
            return _checked(kind, value, where)
    return None


def settings() -> Settings:
    """The client's settings from the environment and the profile (see the module docstring)."""
    env = os.environ
    name = env.get(PROFILE_ENV) or "default"
    cpath, fpath = credentials_file(), config_file()
    creds, conf = _profile(name, bool(env.get(PROFILE_ENV)), _stamp(cpath), _stamp(fpath), str(cpath), str(fpath))
    sections = ((f"{cpath} [{name}]", creds), (f"{fpath} [{'profile ' * (name != 'default')}{name}]", conf))
    region = _first("region", [("AWS_REGION", env.get("AWS_REGION")),
                               ("AWS_DEFAULT_REGION", env.get("AWS_DEFAULT_REGION")),
                               *((f"{at} region", s.get("region")) for at, s in sections)])
    endpoint = _first("endpoint", [("AWS_ENDPOINT_URL_S3", env.get("AWS_ENDPOINT_URL_S3")),
                                   ("AWS_ENDPOINT_URL", env.get("AWS_ENDPOINT_URL")),
                                   ("AWS_ENDPOINT", env.get("AWS_ENDPOINT")),  # obstore's alias
                                   *((f"{at} endpoint_url", s.get("endpoint_url")) for at, s in sections)])
    common = {"region": region, "endpoint": endpoint}
    if env.get("AWS_ACCESS_KEY_ID") and env.get("AWS_SECRET_ACCESS_KEY"):
        token = next(((k, env[k]) for k in ("AWS_SESSION_TOKEN", "AWS_TOKEN", "AWS_SECURITY_TOKEN") if env.get(k)),
                     ("AWS_SESSION_TOKEN", None))  # AWS_TOKEN: obstore's alias
        return Settings(_checked("credential", env["AWS_ACCESS_KEY_ID"], "AWS_ACCESS_KEY_ID"),
                        _checked("credential", env["AWS_SECRET_ACCESS_KEY"], "AWS_SECRET_ACCESS_KEY"),
                        _first("credential", [token]), **common)
    for at, section in sections:
        if section.get("aws_access_key_id") and section.get("aws_secret_access_key"):
            return Settings(_checked("credential", section["aws_access_key_id"], f"{at} aws_access_key_id"),
                            _checked("credential", section["aws_secret_access_key"], f"{at} aws_secret_access_key"),
                            _first("credential", [(f"{at} aws_session_token", section.get("aws_session_token"))]),
                            profile=name, **common)
    why = None
    roles = sorted(k for s in (creds, conf) for k in s if k in _NOT_RUN)
    if roles:
        why = (f"profile {name!r} has {', '.join(roles)} but no aws_access_key_id and aws_secret_access_key "
               f"({cpath}, {fpath}); roles, SSO and credential_process are not run: export the keys instead")
    return Settings(**common, no_keys_why=why)
