"""Faults of a bucket upload, on the commands that write to one (``import --from hf``, ``export --to hf``,
``--to fully_reshardable``, ``--to torch``): the writer killed (SIGKILL) at random points of its
upload, the server dying or hanging mid-upload, a second writer on the same prefix.

After each: the destination is absent or complete (a prefix without its commit object is refused by
``verify`` as an unfinished upload, and ``--to torch``'s one object is there whole or not at all);
what the commit object names passes ``verify --data``; the source is untouched; the writer's local
staging holds only a killed writer's proven work folder, which the next writer removes. A server that
dies or stops answering ends the command within a bounded time with one line (exit 2).

The commands run in fresh interpreters whose every object upload announces itself on stdout ("put N
REL") and first sleeps ``GTP_TEST_SLOW`` seconds, so that the test acts mid-upload.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import s3_server
from cli_helpers import snapshot
from test_read import FIXTURES, ckpt
from test_server_process import _server_pids

from gtp_format import work
from gtp_format.names import LATEST_FILE
from gtp_format.storage import objects
from gtp_format.storage import upload as up

REPO = Path(__file__).resolve().parents[2]
SRC = FIXTURES["dcp"]
UPLOAD_CKPT = """
import os, sys, time
from gtp_format.storage import upload as up
real, n = up.Upload._put, [0]
def put(self, local, rel, create=False):
    n[0] += 1
    print(f"put {n[0]} {rel or '<object>'}", flush=True)
    time.sleep(float(os.environ.get("GTP_TEST_SLOW", "0")))
    real(self, local, rel, create)
up.Upload._put = put
from ckpt_tool.cli import run
sys.exit(run(sys.argv[1:]))
"""
# the object each output's upload puts last (its commit object); --to torch is one object
COMMIT = {"import": "iter_0000000/metadata.json", "hf": "config.json",
          "fully_reshardable": "iter_0000002/metadata.json", "torch": ""}
KINDS = sorted(COMMIT)
pytestmark = pytest.mark.slow  # each case runs ckpt in fresh interpreters: 3 to 8 s


def _argv(kind: str, dst: str, hf_src: Path) -> list[str]:
    if kind == "import":
        return ["import", str(hf_src), dst, "--from", "hf", "--dp", "2"]
    return ["export", str(SRC), dst, "--to", kind]


def _dst(s3, kind: str, prefix: str) -> str:
    return s3.url(prefix + ("/model.pt" if kind == "torch" else ""))


def _start(argv: list[str], staging: Path, slow: float, **env: str) -> subprocess.Popen[str]:
    e = {**os.environ, "PYTHONPATH": str(REPO), "GTP_TEST_SLOW": str(slow), "CKPT_S3_STAGING": str(staging), **env}
    return subprocess.Popen([sys.executable, "-c", UPLOAD_CKPT, *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=e)


def _puts(p: subprocess.Popen[str], n: int) -> int:
    """Read the child's stdout until its ``n``-th put starts (or it ends); the puts seen."""
    assert p.stdout is not None
    seen = 0
    for line in p.stdout:
        if line.startswith("put "):
            seen += 1
            if seen >= n:
                break
    return seen


def _staging(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The local staging of every writer of the test (the children's and the in-process ones)."""
    staging = tmp_path / "staging"
    staging.mkdir()
    monkeypatch.setenv("CKPT_S3_STAGING", str(staging))
    (staging / "theirs.txt").write_text("keep")  # a user's file beside the work folders
    return staging


def _absent_or_complete(s3, capsys, kind: str, prefix: str, local: Path | None = None, killed: bool = False) -> bool:
    """Whether the destination is complete (True) or absent to every reader (False); never a mix. ``killed``:
    the writer may have died after the commit object and before the run's latest marker, which the upload puts
    after it (step 5): the iteration is then complete and the run folder names no latest iteration."""
    keys = s3.keys(prefix + "/")
    if kind == "torch":
        if not keys:
            return False
        # the file, then its attestation beside it (a kill between the two leaves the complete file alone)
        assert keys in ([f"{prefix}/model.pt"], [f"{prefix}/model.pt", f"{prefix}/model.pt.gtp_attestation.json"]), keys
        body = s3.client.get_object(Bucket=s3.bucket, Key=keys[0])["Body"].read()
        assert local is not None and body == local.read_bytes(), "the one object is whole"
        return True
    commit = f"{prefix}/{COMMIT[kind]}"
    if commit not in keys:
        if keys:
            code, _, err = ckpt(capsys, "verify", s3.url(prefix + ("/" + COMMIT[kind].split("/")[0]
                                                                   if "/" in COMMIT[kind] else "")))
            assert code == 2 and ("unfinished upload" in err or "not a checkpoint" in err or "no " in err), err
        return False
    marker = f"{prefix}/{LATEST_FILE}"
    unmarked = killed and "/" in COMMIT[kind] and marker not in keys
    if kind != "hf":
        where = commit.rsplit("/", 1)[0] if unmarked else prefix
        code, out, err = ckpt(capsys, "verify", s3.url(where), "--data")
        assert code == 0, (out, err)
    if local is not None:  # every object of the complete output is there
        want = sorted(str(p.relative_to(local)) for p in local.rglob("*") if p.is_file())
        if unmarked:
            want.remove(LATEST_FILE)
        assert sorted(k[len(prefix) + 1:] for k in keys) == want
    return True


@pytest.fixture(scope="module")
def local_outputs(tmp_path_factory: pytest.TempPathFactory, hf_src: Path) -> dict[str, Path]:
    """Each command's output written to a folder: what a complete bucket output must hold."""
    from ckpt_tool.cli import run

    root = tmp_path_factory.mktemp("local")
    out = {}
    for kind in KINDS:
        dst = root / kind / ("model.pt" if kind == "torch" else "out")
        dst.parent.mkdir()
        assert run(_argv(kind, str(dst), hf_src)) == 0, kind
        out[kind] = dst
    return out


@pytest.mark.parametrize("seed", range(8))
def test_a_writer_killed_at_a_random_point_of_its_upload(s3, capsys, tmp_path, hf_src, local_outputs, monkeypatch,
                                                        seed: int) -> None:
    """SIGKILL once the k-th object's upload is under way (k and the delay drawn from ``seed``)."""
    rnd = random.Random(seed)
    kind = KINDS[seed % len(KINDS)]
    staging = _staging(tmp_path, monkeypatch)
    src = hf_src if kind == "import" else SRC
    before = snapshot(src)
    n_objects = 1 if kind == "torch" else sum(1 for p in local_outputs[kind].rglob("*") if p.is_file())
    k = rnd.randint(1, n_objects)
    delay = rnd.uniform(0.0, 0.4)
    p = _start(_argv(kind, _dst(s3, kind, "run/out"), hf_src), staging, slow=0.2)
    seen = _puts(p, k)
    time.sleep(delay)
    p.send_signal(signal.SIGKILL)
    p.wait(60)
    # the puts the child announced before it died: its clock ran on while this test slept or was
    # descheduled, so later puts (the commit object's among them) may have started after the k-th
    assert p.stdout is not None
    started = seen + sum(1 for line in p.stdout.read().splitlines() if line.startswith("put "))
    what = f"seed {seed}: {kind}, killed {delay:.2f} s after put {seen} started, {started} of {n_objects} started"
    complete = _absent_or_complete(s3, capsys, kind, "run/out", local_outputs[kind], killed=True)
    # complete: the commit object's put had started (the last put, or the one before a nested output's marker)
    assert not complete or p.returncode == 0 or started >= n_objects - ("/" in COMMIT[kind]), what
    assert snapshot(src) == before, what
    left = work.leftovers(staging)
    assert all(w.state == "dead" and work.proven(w) for w in left), (what, left)
    # the next writer (another prefix, the same staging) removes the killed one's work folder and succeeds
    code, _, err = ckpt(capsys, *_argv(kind, _dst(s3, kind, "again/out"), hf_src))
    assert code == 0, (what, err)
    assert work.leftovers(staging) == [] and (staging / "theirs.txt").read_text() == "keep", what
    assert _absent_or_complete(s3, capsys, kind, "again/out", local_outputs[kind]), what
    # the killed writer's prefix: a second try is refused when objects are left there, else it completes
    left_there = s3.keys("run/out/")
    code, _, err = ckpt(capsys, *_argv(kind, _dst(s3, kind, "run/out"), hf_src))
    if complete or left_there:
        assert code == 2 and err.count("\n") == 1 and "objects already exist" in err, (what, err)
    else:
        assert code == 0 and _absent_or_complete(s3, capsys, kind, "run/out", local_outputs[kind]), (what, err)
    assert snapshot(src) == before, what


@pytest.mark.parametrize("kind", KINDS)
def test_a_second_writer_on_the_same_prefix(s3, capsys, tmp_path, hf_src, local_outputs, monkeypatch,
                                            kind: str) -> None:
    """Two writers started together on one prefix: one complete winner (exit 0) and a refusal in one line
    (exit 2), or two refusals; never a mix of their objects under a commit object."""
    staging = _staging(tmp_path, monkeypatch)
    dst = _dst(s3, kind, "both/out")
    a = _start(_argv(kind, dst, hf_src), staging, slow=0.1)
    b = _start(_argv(kind, dst, hf_src), staging, slow=0.1)
    results = []
    for p in (a, b):
        out, err = p.communicate(timeout=300)
        results.append((p.returncode, err.strip()))
    codes = sorted(c for c, _ in results)
    assert codes in ([0, 2], [2, 2]), results
    for c, err in results:
        if c == 2:
            assert err.count("\n") == 0 and ("objects already exist" in err or "appeared" in err), err
    complete = _absent_or_complete(s3, capsys, kind, "both/out", local_outputs[kind])
    assert complete == (codes == [0, 2]), (results, s3.keys("both/"))
    assert work.leftovers(staging) == [] and (staging / "theirs.txt").read_text() == "keep"


@contextlib.contextmanager
def _proxy(upstream: str) -> Iterator[tuple[str, threading.Event]]:
    """A TCP proxy to ``upstream``; once the yielded event is set it stops answering: bytes in flight are
    no longer relayed and new connections are accepted and held silent (a server that hangs)."""
    host, port = upstream.rsplit("/", 1)[-1].split(":")
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(64)
    lsock.settimeout(0.2)
    hang, stop = threading.Event(), threading.Event()
    socks: list[socket.socket] = []

    def relay(a: socket.socket, b: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while not stop.is_set():
                data = a.recv(65536)
                if not data:
                    break
                while hang.is_set() and not stop.is_set():
                    time.sleep(0.05)
                b.sendall(data)
        with contextlib.suppress(OSError):
            b.shutdown(socket.SHUT_WR)

    def serve() -> None:
        while not stop.is_set():
            try:
                c, _ = lsock.accept()
            except OSError:
                continue
            socks.append(c)
            if hang.is_set():
                continue  # held, never answered
            u = socket.create_connection((host, int(port)))
            socks.append(u)
            for x, y in ((c, u), (u, c)):
                threading.Thread(target=relay, args=(x, y), daemon=True).start()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{lsock.getsockname()[1]}", hang
    finally:
        stop.set()
        t.join(5)
        for s in socks:
            s.close()
        lsock.close()


def _one_line_within(p: subprocess.Popen[str], bound: float) -> tuple[int, str]:
    t = time.monotonic()
    out, err = p.communicate(timeout=bound + 60)
    took = time.monotonic() - t
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ckpt: error: "), err[-3000:]
    assert took < bound, (took, lines[0])
    return p.returncode, lines[0]


@pytest.mark.parametrize("kind", KINDS)
def test_a_server_that_hangs_mid_upload(s3, capsys, tmp_path, hf_src, monkeypatch, kind: str) -> None:
    """The store stops answering after the first object's upload started: one line naming the timeout
    setting, exit 2, within the retry budget; no commit object; the source and staging as they were."""
    staging = _staging(tmp_path, monkeypatch)
    src = hf_src if kind == "import" else SRC
    before = snapshot(src)
    with _proxy(s3.endpoint) as (endpoint, hang):
        p = _start(_argv(kind, _dst(s3, kind, "hung/out"), hf_src), staging, slow=0.3,
                   AWS_ENDPOINT_URL=endpoint, **{objects.TIMEOUT_ENV: "1"})
        assert _puts(p, 1) == 1
        hang.set()
        code, line = _one_line_within(p, 90)
    assert code == 2 and "did not answer" in line and objects.TIMEOUT_ENV in line, line
    keys = s3.keys("hung/")
    assert not any(k.endswith(COMMIT[kind] or "model.pt") for k in keys), keys
    assert snapshot(src) == before
    assert work.leftovers(staging) == [] and sorted(os.listdir(staging)) == ["theirs.txt"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_server_that_dies_mid_upload(tmp_path, hf_src, monkeypatch, kind: str) -> None:
    """moto's server process killed (SIGKILL) while the upload runs: one line, exit 2, bounded; nothing of
    the source or the staging folder's other files touched, the work folder removed."""
    staging = _staging(tmp_path, monkeypatch)
    src = hf_src if kind == "import" else SRC
    before = snapshot(src)
    with s3_server.moto_process() as endpoint:
        s3_server.point_at(monkeypatch, endpoint, "ckpt-test")
        monkeypatch.setenv(objects.TIMEOUT_ENV, "1")
        dst = "s3://ckpt-test/dead/out" + ("/model.pt" if kind == "torch" else "")
        p = _start(_argv(kind, dst, hf_src), staging, slow=0.3)
        assert _puts(p, 1) == 1
        (pid,) = _server_pids(endpoint.rsplit(":", 1)[1])
        os.kill(pid, signal.SIGKILL)
        code, line = _one_line_within(p, 90)
    assert code == 2 and "s3://ckpt-test/dead/out" in line, line
    assert snapshot(src) == before
    assert work.leftovers(staging) == [] and sorted(os.listdir(staging)) == ["theirs.txt"]


def test_a_sigterm_just_after_an_object_is_created_still_lets_undo_remove_it(s3, tmp_path, monkeypatch) -> None:
    """SIGTERM handled (as ``Terminated``) the moment an object's put returns, before the upload notes it as
    created: the object is noted first, so the writer's clean-up (``undo``) removes it. A survivor that
    torchrun's SIGTERM reached in that moment left its object in the bucket."""
    from gtp_format.storage.location import parse_location
    from gtp_format.work import Terminated, sigterm_raises

    local = tmp_path / "__0_0.distcp"
    local.write_bytes(b"x" * 1000)
    u = up.Upload(parse_location(s3.url("term/iter_0000001")))
    real = objects.forget_listings

    def then_sigterm(target: object) -> None:  # runs right after the put returns
        real(target)
        os.kill(os.getpid(), signal.SIGTERM)

    with sigterm_raises(replace=True), pytest.raises(Terminated):
        monkeypatch.setattr(objects, "forget_listings", then_sigterm)
        try:
            u.put_files(tmp_path, [local.name])
        finally:
            monkeypatch.setattr(objects, "forget_listings", real)
    assert s3.keys("term/") == ["term/iter_0000001/__0_0.distcp"] and u.created, "created and noted"
    u.undo()
    assert s3.keys("term/") == []
