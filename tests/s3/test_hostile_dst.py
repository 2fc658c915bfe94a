"""Hostile ``s3://`` destinations for every ``ckpt`` command that writes (on moto's S3 server, 127.0.0.1).

By class, for ``reshard``, ``export`` (hf, fully_reshardable, torch), ``import --from hf`` and
``migrate-aliased``: a DST URL that is malformed (no bucket, ``..``/``.``/``//`` components, one
slash, another scheme, a control character); a prefix that already holds a checkpoint, or a
sibling prefix that only starts with the same letters; a bucket that does not exist; an endpoint
that refuses connections or never answers; a second writer that starts on the same prefix while
this one uploads; a store that fails half-way and then refuses the deletes too. Each run: exit 2,
one ``ckpt: error:`` line naming the URL and the fix, no traceback, nothing created in the
working directory or the staging folder (a URL is never turned into a local folder's name),
nothing at DST that a reader takes for a checkpoint, and no object this command did not create
touched.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import s3_server
from test_faults import fake_server
from test_read import FIXTURES, ckpt, upload
from test_write_commands import argv as write_argv

from gtp_format.storage import objects
from gtp_format.storage import upload as up

SRC = FIXTURES["dcp"]
COMMANDS = ["reshard", "export-hf", "export-fully_reshardable", "export-torch", "import", "migrate"]


def argv(cmd: str, dst: str, hf_src: Path) -> list[str]:
    """The command line of ``cmd`` into ``dst`` (for ``export-torch`` the object itself, ``.../model.pt``)."""
    if cmd == "reshard":
        return ["reshard", str(SRC), dst, "--dp", "1"]
    if cmd == "export-torch":
        return ["export", str(SRC), dst, "--to", "torch"]
    return write_argv(cmd, dst, hf_src)


@pytest.fixture
def quiet_dirs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """An empty working directory and an empty staging folder, both checked after the command."""
    cwd, staging = tmp_path / "cwd", tmp_path / "staging"
    cwd.mkdir()
    staging.mkdir()
    monkeypatch.chdir(cwd)
    monkeypatch.setenv(up.STAGING_ENV, str(staging))
    return cwd, staging


def refused(capsys: pytest.CaptureFixture[str], args: list[str], *words: str) -> str:
    code, out, err = ckpt(capsys, *args)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("ckpt: error: "), (args, code, out, err)
    assert "Traceback" not in out + err, err
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]


def nothing_local(dirs: tuple[Path, Path]) -> None:
    for d in dirs:
        assert list(d.iterdir()) == [], f"left {sorted(p.name for p in d.iterdir())} in {d}"


BAD_URLS = {
    "no bucket": ("s3://", "not a bucket name"),
    "empty bucket, a prefix": ("s3:///runs/out", "two slashes"),
    "dotdot": ("s3://ckpt-test/runs/../out", "'..'"),
    "dot": ("s3://ckpt-test/runs/./out", "'.'"),
    "double slash": ("s3://ckpt-test/runs//out", "''"),
    "one slash": ("s3:/ckpt-test/out", "two slashes"),
    "four slashes": ("s3:////ckpt-test/out", "two slashes"),
    "upper-case bucket": ("s3://CKPT-TEST/out", "not a bucket name"),
    "bucket with dotdot": ("s3://ckpt..test/out", "not a bucket name"),
    "control character": ("s3://ckpt-test/out\x1b[2K", "component"),
    "backslash": ("s3://ckpt-test/a\\..\\b", "component"),
    "another scheme": ("gs://ckpt-test/out", "gs:// is not supported"),
    "file url": ("file:///tmp/out", "file:// URLs are not taken"),
    "http url": ("http://169.254.169.254/latest", "http:// is not supported"),
}


@pytest.mark.parametrize("cmd", COMMANDS)
@pytest.mark.parametrize("case", sorted(BAD_URLS))
def test_a_malformed_dst_url_is_one_line_and_no_local_folder(s3, capsys, quiet_dirs, hf_src, cmd, case):
    url, word = BAD_URLS[case]
    dst = url + ("/model.pt" if cmd == "export-torch" and url.startswith("s3://ckpt-test/") else "")
    refused(capsys, argv(cmd, dst, hf_src), word)
    nothing_local(quiet_dirs)
    assert s3.keys() == []


@pytest.mark.parametrize("cmd", COMMANDS)
def test_a_prefix_holding_a_checkpoint_is_refused_and_kept(s3, capsys, quiet_dirs, hf_src, cmd):
    upload(s3, SRC, "runs/out")
    if cmd == "export-torch":
        s3.client.put_object(Bucket=s3.bucket, Key="runs/out/model.pt", Body=b"theirs")
    before = {k: s3.client.get_object(Bucket=s3.bucket, Key=k)["Body"].read() for k in s3.keys()}
    dst = s3.url("runs/out") + ("/model.pt" if cmd == "export-torch" else "")
    refused(capsys, argv(cmd, dst, hf_src), "already exist", "nothing there was replaced or deleted")
    assert {k: s3.client.get_object(Bucket=s3.bucket, Key=k)["Body"].read() for k in s3.keys()} == before
    nothing_local(quiet_dirs)


@pytest.mark.parametrize("cmd", ["reshard", "export-hf", "import"])
def test_a_sibling_prefix_is_neither_taken_for_dst_nor_touched(s3, capsys, quiet_dirs, hf_src, cmd):
    """``runs/out`` is free while ``runs/out2/`` and an object named ``runs/out-notes`` exist: the no-replace
    check looks below ``runs/out/`` only, and the sibling objects stay as they were."""
    upload(s3, SRC, "runs/out2")
    s3.client.put_object(Bucket=s3.bucket, Key="runs/out-notes", Body=b"mine")
    before = {k: s3.client.get_object(Bucket=s3.bucket, Key=k)["Body"].read() for k in s3.keys()}
    code, out, err = ckpt(capsys, *argv(cmd, s3.url("runs/out"), hf_src))
    assert code == 0, (out, err)
    assert {k: s3.client.get_object(Bucket=s3.bucket, Key=k)["Body"].read() for k in before} == before
    assert any(k.startswith("runs/out/") for k in s3.keys())
    nothing_local(quiet_dirs)


@pytest.mark.parametrize("cmd", COMMANDS)
def test_a_bucket_that_does_not_exist(s3, capsys, quiet_dirs, hf_src, cmd):
    dst = "s3://no-such-bucket-here/out" + ("/model.pt" if cmd == "export-torch" else "")
    refused(capsys, argv(cmd, dst, hf_src), "s3://no-such-bucket-here", "bucket does not exist")
    nothing_local(quiet_dirs)
    assert [b["Name"] for b in s3.client.list_buckets()["Buckets"]] == [s3.bucket]


@pytest.mark.parametrize("cmd", ["reshard", "export-torch", "import"])
@pytest.mark.parametrize("server", ["refuses connections", "never answers"])
def test_an_endpoint_that_refuses_or_hangs_is_bounded(capsys, quiet_dirs, monkeypatch, hf_src, cmd, server):
    def point_at(endpoint: str) -> None:
        for k in s3_server.UNSET:
            monkeypatch.delenv(k, raising=False)
        for k, v in s3_server.environment(endpoint).items():
            monkeypatch.setenv(k, v)
        monkeypatch.setenv(objects.TIMEOUT_ENV, "1")

    dst = "s3://ckpt-test/out" + ("/model.pt" if cmd == "export-torch" else "")
    t = time.monotonic()
    if server == "refuses connections":
        point_at(f"http://127.0.0.1:{s3_server.free_port()}")
        line = refused(capsys, argv(cmd, dst, hf_src), "s3://ckpt-test/out")
    else:
        with fake_server(None) as (endpoint, count):
            point_at(endpoint)
            line = refused(capsys, argv(cmd, dst, hf_src), "s3://ckpt-test/out", "did not answer", objects.TIMEOUT_ENV)
        assert count, "it never asked the server"
    assert time.monotonic() - t < 60, line  # 1 s per try, 3 retries with backoff inside the 30 s retry budget
    nothing_local(quiet_dirs)


@pytest.mark.parametrize("cmd", COMMANDS)
def test_a_second_writer_on_the_same_prefix_keeps_its_objects(s3, capsys, quiet_dirs, hf_src, monkeypatch, cmd):
    """Another writer puts an object under DST after the no-replace check and before this upload reaches
    that name: this upload must not overwrite it (and then delete it as its own); it stops, removes only
    the objects it created, and the other writer's object stays byte for byte."""
    real = up.Upload._put
    theirs: dict[str, bytes] = {}

    def racing(self, local, rel, create=False):
        if not theirs:
            key = self.target.key(rel)
            theirs[key] = b"the other writer's " + rel.encode()
            s3.client.put_object(Bucket=s3.bucket, Key=key, Body=theirs[key])
        real(self, local, rel, create)

    monkeypatch.setattr(up.Upload, "_put", racing)
    dst = s3.url("race/out") + ("/model.pt" if cmd == "export-torch" else "")
    refused(capsys, argv(cmd, dst, hf_src), "already exist")
    assert s3.keys("race/") == sorted(theirs)
    for k, body in theirs.items():
        assert s3.client.get_object(Bucket=s3.bucket, Key=k)["Body"].read() == body
    nothing_local(quiet_dirs)


@pytest.mark.parametrize("cmd", [c for c in COMMANDS if c != "export-torch"])
def test_a_store_that_fails_half_way_and_refuses_deletes(s3, capsys, quiet_dirs, hf_src, monkeypatch, cmd):
    """The store fails the second object and then every delete: one line; what is left is data without a
    commit object or latest marker, and no reader takes the prefix for a checkpoint."""
    import obstore

    real, calls = up.Upload._put, []

    def failing(self, local, rel, create=False):
        calls.append(rel)
        if len(calls) == 2:
            raise up.objects.describe_error(ConnectionResetError("connection reset by peer"), str(self.target / rel))
        real(self, local, rel, create)

    def no_delete(*a, **k):
        raise OSError("the store refused the delete")

    monkeypatch.setattr(up.Upload, "_put", failing)
    monkeypatch.setattr(obstore, "delete", no_delete)
    refused(capsys, argv(cmd, s3.url("cut/out"), hf_src), "s3://ckpt-test/cut/out")
    monkeypatch.undo()
    left = s3.keys("cut/")
    assert left == [f"cut/out/{calls[0]}"], left  # the one object that went up, kept by the failed delete
    assert not any(k.endswith(("/metadata.json", "/latest_checkpointed_iteration.txt", "/config.json")) for k in left)
    for target in ("cut/out", f"cut/out/{calls[0].split('/')[0]}"):
        code, _, err = ckpt(capsys, "verify", s3.url(target))
        assert code == 2 and err.count("\n") == 1, err
    nothing_local(quiet_dirs)



# -- the launcher: --save / --load / --async-save into a bucket, refused before any rank starts --------

LAUNCH = ["--nproc-per-node", "1", "--steps", "1", "--device", "cpu"]
LAUNCHER_CASES = {
    "no bucket": (["--save", "s3://"], {}, "--save", "not a bucket name"),
    "dotdot": (["--save", "s3://ckpt-test/run/../x", "--async-save"], {}, "--save", "'..'"),
    "one slash": (["--load", "s3:/ckpt-test/run"], {}, "--load", "two slashes"),
    "another scheme": (["--save", "gs://ckpt-test/run", "--async-save"], {}, "--save", "gs:// is not supported"),
    "file url": (["--save", "file:///tmp/run"], {}, "--save", "file:// URLs are not taken"),
    "absent profile": (["--save", "s3://ckpt-test/run", "--async-save"], {"AWS_PROFILE": "nobody"},
                       "--save s3://ckpt-test/run", "AWS_PROFILE='nobody'"),
    "file endpoint": (["--save", "s3://ckpt-test/run", "--async-save"], {"AWS_ENDPOINT_URL": "file:///etc/passwd"},
                      "AWS_ENDPOINT_URL", "not an S3 endpoint URL"),
    "secret with a newline": (["--load", "s3://ckpt-test/run"], {"AWS_SECRET_ACCESS_KEY": "x\nX-Forged: 1"},
                              "AWS_SECRET_ACCESS_KEY", "line break"),
    "a timeout of infinity": (["--save", "s3://ckpt-test/run", "--async-save"], {objects.TIMEOUT_ENV: "inf"},
                              objects.TIMEOUT_ENV, "set it to e.g. 60"),
    "a staging folder that is missing": (["--save", "s3://ckpt-test/run", "--async-save"],
                                         {up.STAGING_ENV: "/nonexistent/staging"}, up.STAGING_ENV, "does not exist"),
}


@pytest.mark.parametrize("case", sorted(LAUNCHER_CASES))
def test_the_launcher_refuses_a_hostile_bucket_location_before_any_rank(s3, capsys, quiet_dirs, monkeypatch, case):
    """``python -m gtp_runtime.train`` with a bad bucket URL or bad AWS settings: one ``error:`` line naming
    the flag or the setting, exit 2, in the launcher (no rank, nothing saved, no local folder named after
    the URL). In-process: the refusal comes before any process starts."""
    from gtp_runtime import train

    flags, env, *words = LAUNCHER_CASES[case]
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(train, "spawn", lambda *a, **k: pytest.fail("ranks were started"))
    t = time.monotonic()
    code = train.main([*LAUNCH, *flags])
    out = capsys.readouterr()
    lines = out.err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (code, out)
    assert "Traceback" not in out.err + out.out and "X-Forged" not in out.err, out.err
    for w in words:
        assert w in lines[0], (w, lines[0])
    assert time.monotonic() - t < 30
    nothing_local(quiet_dirs)
    assert s3.keys() == []


@pytest.mark.parametrize("value", ["inf", "1e400", "1e12", "0", "-1", "nan", "soon", "9" * 5000,
                                   "\u0666\u0660", "\uff16\uff10"])  # 60 in Arabic-Indic and fullwidth digits
def test_a_hostile_timeout_setting_is_one_line(s3, capsys, quiet_dirs, hf_src, monkeypatch, value):
    monkeypatch.setenv(objects.TIMEOUT_ENV, value)
    refused(capsys, argv("export-hf", s3.url("t/out"), hf_src), objects.TIMEOUT_ENV, "set it to e.g. 60")
    nothing_local(quiet_dirs)
    assert s3.keys() == []


def _staging_file(tmp: Path) -> Path:
    (tmp / "a-file").write_text("mine")
    return tmp / "a-file"


STAGINGS = {
    "missing": (lambda tmp: tmp / "no" / "such", "no/such"),
    "a regular file": (_staging_file, "a-file"),
    "below a regular file": (lambda tmp: _staging_file(tmp) / "below", "a-file/below"),
}


@pytest.mark.parametrize("cmd", ["reshard", "export-hf", "export-torch", "import"])
@pytest.mark.parametrize("case", sorted(STAGINGS))
def test_a_staging_folder_that_is_not_a_folder(s3, capsys, tmp_path, hf_src, monkeypatch, cmd, case):
    """``CKPT_S3_STAGING`` naming no folder: one line naming it, nothing uploaded, nothing created there."""
    make, shown = STAGINGS[case]
    before = sorted(p.name for p in tmp_path.iterdir())
    staging = make(tmp_path)
    monkeypatch.setenv(up.STAGING_ENV, str(staging))
    dst = s3.url("st/out") + ("/model.pt" if cmd == "export-torch" else "")
    refused(capsys, argv(cmd, dst, hf_src), shown)
    assert s3.keys() == []
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted({*before, *(["a-file"] if "file" in case else [])})
    if "file" in case:
        assert (tmp_path / "a-file").read_text() == "mine"
