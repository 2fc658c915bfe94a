"""The hostile corpus served from a bucket: one corpus, two storages.

Every case of :mod:`make_corpus` (crafted metadata, pickles, manifests, markers, safetensors headers) and of
:mod:`copies_corpus` (damaged payloads and layouts a copy must refuse) is uploaded once to moto's S3 server
(one server for this module) under ``h/<case>/run/``, with its ``outside/`` secrets beside it under
``h/<case>/outside/``. Each case's commands (the ones that read what it corrupts: ``inspect``/``verify`` for
metadata cases, ``verify --data``/``show``/``diff`` for payload cases, and for the copy cases ``reshard``,
``export --to hf`` and ``--to torch`` into a local DST) run in-process on the local folder and on the bucket,
and the bucket's run must give:

* the same exit code as the local folder, and for ``verify`` the same :class:`Problem` codes (its JSON);
* one ``ckpt: error:`` line on stderr, no traceback, and the same line as the local folder's once the
  location is written as the URL (which names the same object and the same fix);
* no request for a key outside the case's ``run/`` prefix (every request's key recorded, by wrapping obstore);
* nothing at DST.

Cases a bucket cannot hold are not uploaded: a symlink, a FIFO, a sparse file (an object stores every byte
of its size), an empty folder; :data:`BUCKETLESS` names them, and the fixture checks that it names exactly those.

Why in-process, not forked children as :mod:`test_hostile` does: that test also measures peak memory and the
audit hook per input; here the question is whether a bucket gives the same answer, and starting an
interpreter per input cost the suite minutes (the first attempt, every case by every command in
subprocesses, took over 16 minutes). The module's time is in the report of the issue it came with.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import stat
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import s3_server

HOSTILE = Path(__file__).resolve().parents[1] / "hostile"
sys.path.insert(0, str(HOSTILE))

from copies_corpus import SPECS as COPY_SPECS  # noqa: E402
from copies_corpus import build_copies  # noqa: E402
from make_corpus import SECRET, build_corpus, case_specs  # noqa: E402

BUCKET = "hostile"
# parts of case names whose input has no object-store form (checked against the built files by the fixture)
BUCKETLESS = ("symlink", "fifo", "holes", "sparse", "directory")  # "directory": an empty folder for a data file
# what the copy cases run from the bucket (of copies_corpus's five): reshard (its own read-ahead plan,
# BoxReader.prefetch_chunks), and the two exports with a plan of their own (--to hf's streamed copy, --to torch's
# row slices); fully_reshardable and hf --optimizer read through the same prefetch as --to hf (all five run on
# every case locally, tests/hostile/test_hostile_copies.py)
COPY_COMMANDS = ("reshard", "export --to hf", "export --to torch")
OBSTORE_CALLS = ("get_range", "get_ranges", "get", "head", "list", "list_with_delimiter", "put", "delete")



def _bucketless(name: str) -> bool:
    return any(word in name for word in BUCKETLESS)


def _unrepresentable(run: Path) -> bool:
    """Whether the folder holds something an object store cannot: a link, a special file, holes, or an empty
    folder (a prefix exists only while an object is below it: tests/s3/test_read.py has a non-empty one)."""
    for dirpath, dirnames, filenames in os.walk(run):
        if not dirnames and not filenames:
            return True
        for name in dirnames + filenames:
            st = os.lstat(Path(dirpath) / name)
            if stat.S_ISLNK(st.st_mode) or not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
                return True
            if stat.S_ISREG(st.st_mode) and st.st_size > 4096 and st.st_blocks * 512 < st.st_size // 2:
                return True
    return False


class Requests:
    """Every key the bucket backend asks obstore about, per thread-safe list (wrapping obstore's functions)."""

    def __init__(self, mp: pytest.MonkeyPatch) -> None:
        import obstore

        self.lock, self.keys = threading.Lock(), []
        for name in OBSTORE_CALLS:
            real = getattr(obstore, name, None)
            if real is not None:
                mp.setattr(obstore, name, self._wrap(name, real))

    def _wrap(self, name: str, real: Any) -> Any:
        def spy(store: Any, key: Any = None, *a: Any, **k: Any) -> Any:
            with self.lock:
                self.keys.append((name, str(key if key is not None else k.get("prefix", ""))))
            return real(store, key, *a, **k) if key is not None else real(store, *a, **k)
        return spy

    def take(self) -> list[tuple[str, str]]:
        with self.lock:
            out, self.keys = self.keys, []
        return out


def _run(argv: list[str]) -> dict[str, Any]:
    from ckpt_tool.cli import run

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = run(argv)
    return {"exit": code, "stdout": out.getvalue(), "stderr": err.getvalue(), "argv": argv}


def _problem_codes(r: dict[str, Any]) -> list[str] | None:
    """``verify --format json``'s problem codes (sorted), when the command printed that document."""
    try:
        doc = json.loads(r["stdout"])
    except ValueError:
        return None
    problems = doc.get("problems") if isinstance(doc, dict) else None
    return sorted(str(p.get("code")) for p in problems) if isinstance(problems, list) else None


def _jobs(cases: list[Any], copies: list[Any]) -> list[tuple[str, int, list[str]]]:
    """(case, index, argv) of every command: the case's own, ``verify`` with ``--format json`` (its problem
    codes; the same one line on stderr), and the copies' COPY_COMMANDS."""
    out = []
    for c in cases:
        argvs = [[*a[:1], "--format", "json", *a[1:]] if a[0] == "verify" and "--format" not in a else list(a)
                 for a in c.commands]
        out += [(c.name, i, a) for i, a in enumerate(argvs)]
    for c in copies:  # reshard, then export --to hf, hf --optimizer, fully_reshardable, torch (copies_corpus)
        picked = [a for a in c.commands if a[0] == "reshard" or a[-2:] in (["--to", "hf"], ["--to", "torch"])]
        assert len(picked) == len(COPY_COMMANDS)
        out += [(c.name, i, a) for i, a in enumerate(picked)]
    return out


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("hostile-bucket")
    dst_root = tmp_path_factory.mktemp("hostile-bucket-dst")
    cases = build_corpus(root / "c", canary=root / "CANARY")
    copies = build_copies(root / "k", dst_root)
    every = cases + copies
    held = {c.name for c in every if not _unrepresentable(Path(c.dir) / "run")}
    assert held == {c.name for c in every if not _bucketless(c.name)}, \
        "BUCKETLESS must name exactly the cases a bucket cannot hold"
    cases = [c for c in cases if c.name in held]
    copies = [c for c in copies if c.name in held]
    with pytest.MonkeyPatch.context() as mp, s3_server.moto_server() as endpoint:
        client = s3_server.point_at(mp, endpoint, BUCKET)
        uploads = [(p, f"h/{c.name}/{p.relative_to(c.dir)}") for c in cases + copies
                   for p in sorted(Path(c.dir).rglob("*")) if p.is_file() and not p.is_symlink()]
        with ThreadPoolExecutor(8) as pool:  # boto3, independent of the code under test
            list(pool.map(lambda pk: client.upload_file(str(pk[0]), BUCKET, pk[1]), uploads))
        requests = Requests(mp)
        results: dict[str, Any] = {}
        dirs = {c.name: c.dir for c in cases + copies}
        for name, i, argv in _jobs(cases, copies):
            run_dir = str(Path(dirs[name]) / "run")
            url = f"s3://{BUCKET}/h/{name}/run"
            local = _run(argv)
            requests.take()
            remote = _run([a.replace(run_dir, url) for a in argv])
            remote["keys"] = requests.take()
            results[f"{name}-{i}"] = (local, remote, run_dir, url)
        yield {"results": results, "copies": {c.name: c for c in copies}, "canary": (root / "CANARY").exists()}


CASE_IDS = [name for name, _, _ in case_specs() if not _bucketless(name)]
COPY_IDS = [name for name, _, _, _ in COPY_SPECS if not _bucketless(name)]


def _check(served: dict[str, Any], job: str) -> None:
    local, remote, run_dir, url = served["results"][job]
    why = f"{remote['argv']}\nlocal exit {local['exit']}: {local['stderr']}\nbucket exit {remote['exit']}: " \
          f"{remote['stderr']}\nstdout: {remote['stdout'][-1500:]}"
    assert remote["exit"] == local["exit"] and remote["exit"] in (1, 2), why
    lines = [ln for ln in remote["stderr"].splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("ckpt: error: "), why
    assert "Traceback" not in remote["stderr"] + remote["stdout"] and SECRET not in remote["stderr"], why
    assert lines[0] == local["stderr"].strip().replace(run_dir, url), why  # the same object, the same fix
    assert _problem_codes(remote) == _problem_codes(local), why
    prefix = f"h/{job.rsplit('-', 1)[0]}/run"
    outside = [k for _, k in remote["keys"] if not (k == prefix or k.startswith(prefix + "/"))]
    assert not outside, f"requests outside {prefix}: {outside[:5]}\n{why}"
    assert not served["canary"], "a crafted pickle ran code: the canary file exists"


@pytest.mark.parametrize("name", CASE_IDS)
def test_a_crafted_checkpoint_in_a_bucket_is_refused_as_in_a_folder(served: dict[str, Any], name: str) -> None:
    jobs = [j for j in served["results"] if j.rsplit("-", 1)[0] == name]
    assert jobs
    for job in jobs:
        _check(served, job)


@pytest.mark.parametrize("name", COPY_IDS)
def test_a_damaged_source_in_a_bucket_is_not_copied(served: dict[str, Any], name: str) -> None:
    jobs = [j for j in served["results"] if j.rsplit("-", 1)[0] == name]
    assert len(jobs) == len(COPY_COMMANDS)
    for job in jobs:
        _check(served, job)
    dst = Path(served["copies"][name].notes["dst"])
    assert list(dst.iterdir()) == [], f"left {sorted(p.name for p in dst.iterdir())} at DST"
