"""``ckpt reshard`` and ``verify --data`` under torchrun with a bucket as source and as destination (moto's
local S3 server): each rank opens the bucket with its own client; the output is one process's."""

from __future__ import annotations

import hashlib
import json
import os
import queue
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import s3_server

REPO = Path(__file__).resolve().parents[2]
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
SRC = REPO / "fixtures" / "gtp" / "fold_cp2_g2_dp2"
TARGET = ["--cp", "1", "--dp", "2", "--gtp-remat", "1", "--no-fold-cp", "--workers", "2", "--layout", "safetensors"]

pytestmark = pytest.mark.skipif(not Path(TORCHRUN).exists(), reason="torchrun is not installed")


def _run(cmd: list[str], **extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "CKPT_DIST_TIMEOUT": "60", **extra}
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def one(*args: str) -> subprocess.CompletedProcess:
    return _run([sys.executable, "-m", "ckpt_tool.cli", *args])


def ranked(*args: str, **env: str) -> subprocess.CompletedProcess:
    return _run([TORCHRUN, "--standalone", "--nproc-per-node", "2", "-m", "ckpt_tool.cli", *args], **env)


def two_nodes(*args: str, **extra: str) -> list[subprocess.CompletedProcess]:
    """2 simulated nodes x 2 ranks: two torchrun agents meeting through c10d rendezvous on 127.0.0.1 (each agent
    is a node: torchrun gives its ranks ``GROUP_RANK`` 0 or 1, though both share this host's name)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [TORCHRUN, "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"ckpt{port}", "--max-restarts", "0",
           "-m", "ckpt_tool.cli", *args]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "CKPT_DIST_TIMEOUT": "60", **extra}
    procs = [subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]  # before returncode: it is set by the wait
    return [subprocess.CompletedProcess(cmd, p.returncode, *o) for p, o in zip(procs, outs)]


def _digests(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _copied(tmp_path: Path, source: Path) -> tuple[Path, Path, dict[str, str]]:
    """A copy of ``source`` as SRC, an empty staging folder, and SRC's digests (to prove it untouched after)."""
    import shutil

    src, staging = tmp_path / "src", tmp_path / "staging"
    shutil.copytree(source, src)
    staging.mkdir()
    return src, staging, _digests(src)


def _ranks_left(marker: str) -> list[int]:
    """Processes still running whose command line holds ``marker`` (this test's DST)."""
    left = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if marker in (d / "cmdline").read_bytes().decode(errors="replace"):
                    left.append(int(d.name))
            except OSError:
                pass
    return left


def _without_run_ids(doc: object) -> object:
    """A JSON document less its ``run_id`` fields and the manifest's checksum of the attestation holding one
    (a source with no lineage gets a new run id per conversion)."""
    if isinstance(doc, dict):
        return {k: _without_run_ids(v) for k, v in doc.items() if k not in ("run_id", "gtp_attestation.json")}
    if isinstance(doc, list):
        return [_without_run_ids(v) for v in doc]
    return doc


def test_bucket_source_and_destination_on_two_ranks(s3, tmp_path: Path) -> None:
    src = s3_server.upload(s3, SRC, "src")
    want = one("reshard", src, str(tmp_path / "one"), *TARGET)
    assert want.returncode == 0, want.stderr
    got = ranked("reshard", src, str(tmp_path / "many"), *TARGET)  # bucket SRC, folder DST
    assert got.returncode == 0, got.stderr[-3000:]
    for p in sorted((tmp_path / "one").rglob("*")):
        if not p.is_file():
            continue
        theirs = tmp_path / "many" / p.relative_to(tmp_path / "one")
        if p.name in ("gtp_attestation.json", "gtp_manifest.json"):  # a new run id per conversion of a source
            assert _without_run_ids(json.loads(p.read_bytes())) == _without_run_ids(json.loads(theirs.read_bytes()))
        else:  # the safetensors layout has nothing random: byte for byte
            assert p.read_bytes() == theirs.read_bytes(), p
    up = ranked("reshard", src, s3.url("dst"), *TARGET)  # bucket SRC and DST, one host
    assert up.returncode == 0, up.stderr[-3000:]
    d = one("diff", "--bitwise", str(tmp_path / "one"), s3.url("dst"))
    assert d.returncode == 0 and "0 differ" in d.stdout, d.stdout + d.stderr
    v1 = one("verify", "--data", s3.url("dst"), "--format", "json")
    v2 = ranked("verify", "--data", s3.url("dst"), "--format", "json")
    assert v1.returncode == v2.returncode == 0 and json.loads(v1.stdout) == json.loads(v2.stdout), v2.stderr[-2000:]


def test_export_split_over_two_ranks_from_and_to_a_bucket(s3, tmp_path: Path) -> None:
    """``export --to hf`` on 2 ranks, bucket SRC and DST (one host): each rank writes its share of the files into
    rank 0's staging, rank 0 uploads and commits; every object is one process's local file, byte for byte."""
    src = s3_server.upload(s3, SRC, "src")
    args = ("--to", "hf", "--optimizer", "--max-shard-size", "100KB")
    want = one("export", str(SRC), str(tmp_path / "one"), *args)
    assert want.returncode == 0, want.stderr
    got = ranked("export", src, s3.url("hf"), *args)
    assert got.returncode == 0 and got.stdout.count("wrote ") == 1, got.stderr[-3000:]
    files = sorted(p.name for p in (tmp_path / "one").iterdir())
    assert len([f for f in files if f.endswith(".safetensors")]) >= 2
    assert s3.keys("hf/") == [f"hf/{f}" for f in files]
    for f in files:
        body = s3.client.get_object(Bucket=s3.bucket, Key=f"hf/{f}")["Body"].read()
        if f == "gtp_attestation.json":  # names its own source (the bucket's, here)
            a, b = json.loads(body), json.loads((tmp_path / "one" / f).read_bytes())
            assert {k: v for k, v in a.items() if k != "source"} == {k: v for k, v in b.items() if k != "source"}
        else:
            assert body == (tmp_path / "one" / f).read_bytes(), f


def _errors(runs: list[subprocess.CompletedProcess]) -> list[str]:
    return [x for r in runs for x in r.stderr.splitlines() if x.startswith("ckpt: error:")]


def test_bucket_destination_across_two_nodes_equals_one_process(s3, tmp_path: Path) -> None:
    """2 simulated nodes x 2 ranks (c10d rendezvous), bucket DST: each node stages its files in a folder of its
    own (the two agents share this host's staging setting, as two machines would have one each), checks and
    uploads them; rank 0 gates the whole from the verdicts and commits. The bucket holds one process's output,
    bit for bit; no staging folder is left; SRC untouched; no rank left running."""
    src, staging, before = _copied(tmp_path, SRC)
    for layout in ("safetensors", "torch_dist"):
        target = [*TARGET[:-1], layout]
        want = one("reshard", str(src), str(tmp_path / f"one_{layout}"), *target)
        assert want.returncode == 0, want.stderr
        dst = s3.url(f"across_{layout}")
        runs = two_nodes("reshard", str(src), dst, *target, CKPT_S3_STAGING=str(staging))
        assert all(r.returncode == 0 for r in runs), [r.stderr[-3000:] for r in runs]
        assert sum(r.stdout.count("wrote ") for r in runs) == 1, [r.stdout for r in runs]
        d = one("diff", "--bitwise", str(tmp_path / f"one_{layout}"), dst)
        assert d.returncode == 0 and "0 differ" in d.stdout, d.stdout + d.stderr
        v = one("verify", "--data", dst)
        assert v.returncode == 0, v.stdout + v.stderr
        names = sorted(str(p.relative_to(tmp_path / f"one_{layout}")) for p in (tmp_path / f"one_{layout}").rglob("*")
                       if p.is_file())
        assert s3.keys(f"across_{layout}/") == [f"across_{layout}/{n}" for n in names]
        if layout == "safetensors":  # nothing random in this layout: every object is one process's file
            for n in names:
                if n.rsplit("/", 1)[-1] in ("gtp_attestation.json", "gtp_manifest.json"):
                    continue  # a new run id per conversion of a source
                body = s3.client.get_object(Bucket=s3.bucket, Key=f"across_{layout}/{n}")["Body"].read()
                assert body == (tmp_path / f"one_{layout}" / n).read_bytes(), n
    assert list(staging.iterdir()) == []
    assert _digests(src) == before
    assert _ranks_left(str(src)) == []


def test_exports_to_a_bucket_across_two_nodes(s3, tmp_path: Path) -> None:
    """2 nodes x 2 ranks: ``export --to fully_reshardable`` to a bucket is one process's output (its files'
    entries are what each node checks its staged files against). No staging folder or rank is left."""
    staging = tmp_path / "staging"
    staging.mkdir()
    args = ("--to", "fully_reshardable", "--workers", "2")
    want = one("export", str(SRC), str(tmp_path / "one"), *args)
    assert want.returncode == 0, want.stderr
    runs = two_nodes("export", str(SRC), s3.url("fr"), *args, CKPT_S3_STAGING=str(staging))
    assert all(r.returncode == 0 for r in runs), [r.stderr[-3000:] for r in runs]
    d = one("diff", "--bitwise", str(tmp_path / "one"), s3.url("fr"))
    assert d.returncode == 0 and "0 differ" in d.stdout, d.stdout + d.stderr
    names = sorted(str(p.relative_to(tmp_path / "one")) for p in (tmp_path / "one").rglob("*") if p.is_file())
    assert s3.keys("fr/") == [f"fr/{n}" for n in names]
    assert list(staging.iterdir()) == []
    assert _ranks_left(s3.url("fr")) == []


HF_ARGS = ("--to", "hf", "--optimizer", "--max-shard-size", "100KB")


def _attestation_less_run(raw: bytes) -> object:
    return _without_run_ids({k: v for k, v in json.loads(raw).items() if k != "source"})


def test_export_to_hf_across_two_nodes_is_one_process_output(s3, tmp_path: Path) -> None:
    """2 nodes x 2 ranks, ``export --to hf --optimizer``, to a folder every node shares and to a bucket: each
    rank writes its share of the weights files (their entries, size and CRC-32C, computed as they are written);
    to a bucket each node stages its own, each rank reads its share of its node's staged files in full against
    their entries and rank 0 checks that the verdicts cover exactly the planned weights files, then every node
    uploads its own and rank 0 commits (config.json last). Every file and object is one process's, byte for
    byte (the attestation less its run id and source); no staging folder, no rank left; SRC untouched."""
    src, staging, before = _copied(tmp_path, SRC)
    want = one("export", str(src), str(tmp_path / "one"), *HF_ARGS)
    assert want.returncode == 0, want.stderr
    files = sorted(p.name for p in (tmp_path / "one").iterdir())
    assert len([f for f in files if f.endswith(".safetensors")]) >= 4  # a share for every rank

    def same(name: str, body: bytes) -> None:
        theirs = (tmp_path / "one" / name).read_bytes()
        if name == "gtp_attestation.json":
            assert _attestation_less_run(body) == _attestation_less_run(theirs), name
        else:
            assert body == theirs, name

    runs = two_nodes("export", str(src), str(tmp_path / "many"), *HF_ARGS)  # a folder every node shares
    assert all(r.returncode == 0 for r in runs), [r.stderr[-3000:] for r in runs]
    assert sorted(p.name for p in (tmp_path / "many").iterdir()) == files
    for f in files:
        same(f, (tmp_path / "many" / f).read_bytes())
    runs = two_nodes("export", str(src), s3.url("hf"), *HF_ARGS, CKPT_S3_STAGING=str(staging))
    assert all(r.returncode == 0 for r in runs), [r.stderr[-3000:] for r in runs]
    assert sum(r.stdout.count("wrote ") for r in runs) == 1, [r.stdout for r in runs]
    assert s3.keys("hf/") == [f"hf/{f}" for f in files]
    for f in files:
        same(f, s3.client.get_object(Bucket=s3.bucket, Key=f"hf/{f}")["Body"].read())
    # --names megatron: one weights file, which is then the commit object (rank 0 writes, checks and uploads it last)
    want = one("export", str(src), str(tmp_path / "one_megatron"), "--to", "hf", "--names", "megatron")
    assert want.returncode == 0, want.stderr
    runs = two_nodes("export", str(src), s3.url("hfm"), "--to", "hf", "--names", "megatron",
                     CKPT_S3_STAGING=str(staging))
    assert all(r.returncode == 0 for r in runs), [r.stderr[-3000:] for r in runs]
    mine = sorted(p.name for p in (tmp_path / "one_megatron").iterdir())
    assert s3.keys("hfm/") == [f"hfm/{f}" for f in mine] and "model.safetensors" in mine, s3.keys("hfm/")
    body = s3.client.get_object(Bucket=s3.bucket, Key="hfm/model.safetensors")["Body"].read()
    assert body == (tmp_path / "one_megatron" / "model.safetensors").read_bytes()
    assert list(staging.iterdir()) == []
    assert _digests(src) == before
    assert _ranks_left(str(src)) == []


MEGATRON = REPO / "fixtures" / "megatron" / "cp2_dp2_dp_reshardable"
MEGATRON_TARGET = ("--tp", "1", "--cp", "1", "--dp", "4", "--workers", "2")  # 4 rank files: some on each node


def test_megatron_core_reshard_to_a_bucket_across_two_nodes(s3, tmp_path: Path) -> None:
    """2 nodes x 2 ranks, a genuine megatron-core ``dp_reshardable`` checkpoint resharded into a bucket: no
    manifest lists its rank files, so each is given its entry (size, CRC-32C) from the bytes as they are written,
    and each node checks its staged files against those entries before the upload. The bucket holds one process's
    output (``diff --bitwise``: every tensor's bits) and passes ``verify --data``; then a rank file damaged on node 1
    before its check (``CKPT_RANK_FAULT=3:damage``) is one line naming it and rank 3, nothing uploaded. No staging
    folder or rank left; SRC untouched."""
    src, staging, before = _copied(tmp_path, MEGATRON)
    want = one("reshard", str(src), str(tmp_path / "one"), *MEGATRON_TARGET)
    assert want.returncode == 0, want.stderr
    runs = two_nodes("reshard", str(src), s3.url("mc"), *MEGATRON_TARGET, CKPT_S3_STAGING=str(staging))
    assert all(r.returncode == 0 for r in runs), [r.stderr[-3000:] for r in runs]
    assert sum(r.stdout.count("wrote ") for r in runs) == 1, [r.stdout for r in runs]
    d = one("diff", "--bitwise", str(tmp_path / "one"), s3.url("mc"))
    assert d.returncode == 0 and "0 differ" in d.stdout, d.stdout + d.stderr
    names = sorted(str(p.relative_to(tmp_path / "one")) for p in (tmp_path / "one").rglob("*") if p.is_file())
    assert s3.keys("mc/") == [f"mc/{n}" for n in names]
    ranks_files = [n for n in names if n.rsplit("/", 1)[-1].startswith("__") and not n.endswith("__0_1.distcp")]
    assert len(ranks_files) == 4
    for n in ranks_files:  # each as long as one process's (its zip records' serialization id is random)
        head = s3.client.head_object(Bucket=s3.bucket, Key=f"mc/{n}")
        assert head["ContentLength"] == (tmp_path / "one" / n).stat().st_size, n
    v = one("verify", "--data", s3.url("mc"))
    assert v.returncode == 0, v.stdout + v.stderr
    runs = two_nodes("reshard", str(src), s3.url("mcbad"), *MEGATRON_TARGET, CKPT_RANK_FAULT="3:damage",
                     CKPT_S3_STAGING=str(staging))
    assert all(r.returncode != 0 for r in runs), [r.stderr[-2000:] for r in runs]
    lines = _errors(runs)
    named = [x for x in lines if "rank 3" in x and "staged file __" in x and "crc32c is" in x]
    assert named and len(lines) <= 4, "\n".join(r.stderr[-2000:] for r in runs)
    assert all(x in named or "nothing was committed" in x for x in lines), lines
    assert s3.keys("mcbad") == []
    assert list(staging.iterdir()) == []
    assert _digests(src) == before
    assert _ranks_left(str(src)) == []


def test_a_damaged_staged_hf_file_on_another_node_is_refused_naming_file_and_rank(s3, tmp_path: Path) -> None:
    """2 nodes x 2 ranks, ``export --to hf`` to a bucket: rank 3 flips a byte of one of its node's staged weights
    files before its check (``CKPT_RANK_FAULT=3:damage``): one line naming the file and rank 3, nothing
    uploaded, no staging folder or rank left."""
    staging = tmp_path / "staging"
    staging.mkdir()
    runs = two_nodes("export", str(SRC), s3.url("hfbad"), *HF_ARGS, CKPT_RANK_FAULT="3:damage",
                     CKPT_S3_STAGING=str(staging))
    assert all(r.returncode != 0 for r in runs), [r.stderr[-2000:] for r in runs]
    lines = _errors(runs)
    named = [x for x in lines if "rank 3" in x and "staged file " in x and ".safetensors" in x and "crc32c is" in x]
    assert named and len(lines) <= 4, "\n".join(r.stderr[-2000:] for r in runs)
    assert all(x in named or "nothing was committed" in x for x in lines), lines
    assert s3.keys("hfbad") == []
    assert list(staging.iterdir()) == []
    assert _ranks_left(s3.url("hfbad")) == []


def test_a_damaged_staged_file_on_another_node_is_refused_naming_file_and_rank(s3, tmp_path: Path) -> None:
    """2 nodes x 2 ranks, bucket DST: rank 3 (node 1) flips a byte of one of its staged files before its check
    (``CKPT_RANK_FAULT=3:damage``): its verdict is that file's one line naming rank 3, every rank exits non-zero,
    nothing is uploaded, both nodes' staging folders are removed, SRC untouched, no rank left."""
    src, staging, before = _copied(tmp_path, SRC)
    dst = s3.url("damaged2")
    runs = two_nodes("reshard", str(src), dst, *TARGET, CKPT_RANK_FAULT="3:damage", CKPT_S3_STAGING=str(staging))
    assert all(r.returncode != 0 for r in runs), [r.stderr[-2000:] for r in runs]
    lines = _errors(runs)
    named = [x for x in lines if "rank 3" in x and "staged file __" in x and "crc32c is" in x]
    assert named and len(lines) <= 4, "\n".join(r.stderr[-2000:] for r in runs)
    assert all(x in named or "nothing was committed" in x for x in lines), lines
    assert s3.keys("damaged2") == []
    assert list(staging.iterdir()) == []
    assert _digests(src) == before
    assert _ranks_left(str(src)) == []


def test_a_rank_claiming_a_file_that_is_not_its_own_is_not_trusted(s3, tmp_path: Path) -> None:
    """2 nodes x 2 ranks, bucket DST: rank 3's verdict also names a staged file of its node that is rank 2's to
    check (``CKPT_RANK_FAULT=3:claim``). Rank 0 refuses the verdicts, in one line naming rank 3 and the file,
    before anything is uploaded: the bucket holds nothing, no staging folder is left, no rank is left."""
    staging = tmp_path / "staging"
    staging.mkdir()
    dst = s3.url("claim")
    runs = two_nodes("reshard", str(SRC), dst, *TARGET, CKPT_RANK_FAULT="3:claim", CKPT_S3_STAGING=str(staging))
    assert all(r.returncode != 0 for r in runs), [r.stderr[-2000:] for r in runs]
    lines = _errors(runs)
    named = [x for x in lines if "rank 3 reported a verdict for __" in x and "which is not its to check" in x]
    assert named and len(lines) <= 4, "\n".join(r.stderr[-2000:] for r in runs)
    assert all(x in named or "nothing was committed" in x for x in lines), lines
    assert s3.keys("claim") == []
    assert list(staging.iterdir()) == []
    assert _ranks_left(dst) == []


@pytest.mark.parametrize("fault", ["2:upload", "0:upload"])
def test_a_rank_killed_mid_upload_leaves_no_checkpoint(s3, tmp_path: Path, fault: str) -> None:
    """2 nodes x 2 ranks, bucket DST: rank 2 (node 1's staging maker), or rank 0, is killed with its first object
    created (``CKPT_RANK_FAULT=R:upload``). Nothing is left in the bucket: the surviving ranks removed every object
    they created, and a surviving node's first rank the killed rank's own (each object carries the job's token, which
    proves it the job's); the killed rank's staging folder is removed by the surviving rank of its node; SRC
    untouched; no rank left (another writer's objects stay: tests/s3/test_sweep.py)."""
    src, staging, before = _copied(tmp_path, SRC)
    dst = s3.url("killed")
    runs = two_nodes("reshard", str(src), dst, *TARGET, CKPT_RANK_FAULT=fault, CKPT_S3_STAGING=str(staging))
    assert all(r.returncode != 0 for r in runs), [r.stderr[-2000:] for r in runs]
    keys = s3.keys("killed")
    assert keys == [], keys
    v = one("verify", dst)
    assert v.returncode != 0, v.stdout
    assert list(staging.iterdir()) == []
    assert _digests(src) == before
    assert _ranks_left(str(src)) == []


def test_a_staged_file_damaged_before_its_check_is_refused_naming_file_and_rank(s3, tmp_path: Path) -> None:
    """A bucket DST on 2 ranks: each rank reads its share of the staged files in full against the entries they
    were written with, before rank 0 uploads them (the writer's gate reads only sizes and headers). Rank 1 flips
    a byte of one of its staged files first (``CKPT_RANK_FAULT=1:damage``): every rank's one line names that
    file and rank 1; nothing is uploaded, the staging folder is left empty, SRC untouched, no rank left."""
    src, staging, before = _copied(tmp_path, SRC)
    dst = s3.url("damaged")
    got = ranked("reshard", str(src), dst, *TARGET, CKPT_RANK_FAULT="1:damage", CKPT_S3_STAGING=str(staging))
    assert got.returncode != 0, got.stderr[-3000:]
    lines = [x for x in got.stderr.splitlines() if x.startswith("ckpt: error:")]
    named = [x for x in lines if "rank 1" in x and "staged file __" in x and "crc32c is" in x]
    assert named and len(lines) <= 2, got.stderr[-3000:]
    assert all(x in named or "nothing was committed" in x for x in lines), lines  # see the test above
    assert "Traceback" not in got.stderr.split("ckpt: error:")[-1].split("\n")[0]
    assert s3.keys("damaged") == []
    assert list(staging.iterdir()) == []
    assert _digests(src) == before
    assert _ranks_left(dst) == []


# A rank of the job as torchrun starts it, announcing every point the random kill may follow: each data file a
# rank starts writing into its node's staging ("copy R I"), each object a rank starts uploading ("put R REL":
# the data files, then rank 0's side files and last the commit object), each first sleeping GTP_TEST_SLOW s.
# Each line is one write(2) of under PIPE_BUF bytes, so lines of ranks sharing the agent's pipe never mix.
RANK_WRAPPER = """
import os, sys, time
rank, slow = os.environ.get("RANK", "?"), float(os.environ.get("GTP_TEST_SLOW", "0"))
def say(line):  # one write: the agents' ranks share a pipe (a print may write its newline apart)
    os.write(1, (line + "\\n").encode())
say(f"pid {rank} {os.getpid()}")
from gtp_format.storage import upload as up
from ckpt_tool.copying import engine
real_put, real_files = up.Upload._put, engine.run_files
def put(self, local, rel, create=False):
    say(f"put {rank} {rel}")
    time.sleep(slow)
    real_put(self, local, rel, create)
def run_files(one, n, workers, advance):
    def announced(i, tick):
        say(f"copy {rank} {i}")
        time.sleep(slow)
        return one(i, tick)
    return real_files(announced, n, workers, advance)
up.Upload._put, engine.run_files = put, run_files
from ckpt_tool.cli import run
sys.exit(run(sys.argv[1:]))
"""


def _two_nodes_killed(script: Path, args: list[str], events: int, rank: int, delay: float,
                      **extra: str) -> tuple[list[subprocess.CompletedProcess], str]:
    """:func:`two_nodes` running ``script``, with ``rank`` killed (SIGKILL) ``delay`` s after the ``events``-th
    announced point of the whole job (counted over both agents' ranks); what the kill followed."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [TORCHRUN, "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"ckpt{port}", "--max-restarts", "0",
           str(script), *args]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "CKPT_DIST_TIMEOUT": "60", **extra}
    procs = [subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    lines: queue.Queue[str | None] = queue.Queue()
    outs: list[list[str]] = [[], [], [], []]

    def drain(stream, out: list[str], announce: bool) -> None:
        for line in stream:
            out.append(line)
            if announce:
                lines.put(line)
        if announce:
            lines.put(None)

    readers = [threading.Thread(target=drain, args=(s, outs[2 * i + j], j == 0), daemon=True)
               for i, p in enumerate(procs) for j, s in enumerate((p.stdout, p.stderr))]
    for t in readers:
        t.start()
    pids: dict[int, int] = {}
    seen, ended, what = 0, 0, "the job ended first"
    deadline = time.monotonic() + 240
    while ended < 2 and time.monotonic() < deadline:
        try:
            line = lines.get(timeout=1)
        except queue.Empty:
            continue
        if line is None:
            ended += 1
            continue
        word, r, rest = (line.split(maxsplit=2) + ["", "", ""])[:3]
        if word == "pid":
            pids[int(r)] = int(rest)
        elif word in ("copy", "put"):
            seen += 1
            if seen == events:
                time.sleep(delay)
                what = f"rank {rank} killed {delay:.2f} s after event {seen} ({line.strip()})"
                if rank in pids:
                    try:
                        os.kill(pids[rank], signal.SIGKILL)
                    except ProcessLookupError:
                        what += ", already gone"
    for p in procs:
        p.wait(timeout=300)
    for t in readers:
        t.join(timeout=30)
    runs = [subprocess.CompletedProcess(cmd, p.returncode, "".join(outs[2 * i]), "".join(outs[2 * i + 1]))
            for i, p in enumerate(procs)]
    return runs, what


@pytest.fixture(scope="module")
def one_process_output(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One process's output of the killed runs' reshard: what a complete bucket output holds."""
    out = tmp_path_factory.mktemp("one") / "dst"
    want = one("reshard", str(SRC), str(out), *TARGET)
    assert want.returncode == 0, want.stderr
    return out


@pytest.mark.parametrize("seed", range(int(os.environ.get("CKPT_KILL_SEEDS", "6"))))
def test_a_rank_killed_at_a_random_point_across_two_nodes(s3, tmp_path: Path, one_process_output: Path,
                                                          seed: int) -> None:
    """2 nodes x 2 ranks, bucket DST: a rank drawn from ``seed`` killed (SIGKILL) a drawn delay after the k-th
    point of the job (k drawn over every data file's write into staging and every object's upload, the commit's
    side files and commit object last), as the one-process upload test draws its points; seeds 1 and 4 fall in
    the commit (rank 0's side files and commit object; seed 1 kills rank 0 there). DST is absent (no commit
    object: ``ckpt verify`` refuses the prefix; what is left is data objects, only where the kill came after every
    rank's upload (a kill during it leaves nothing: upload.sweep), and side objects only where rank 0 died in its
    commit) or complete (one process's objects, ``verify --data`` passes); SRC untouched; no rank
    left; the staging holds at most proven dead writers' folders, and the next writer there removes them and
    succeeds. ``CKPT_KILL_SEEDS=N`` runs N seeds (12 passed)."""
    from gtp_format import work

    rnd = random.Random(seed)
    src, staging, before = _copied(tmp_path, SRC)
    names = sorted(str(p.relative_to(one_process_output)) for p in one_process_output.rglob("*") if p.is_file())
    copies = sum(1 for n in names if n.endswith(".safetensors"))
    # the commit's objects are rank 0's puts after the data files: the last len(names) - copies events
    commit_from = 2 * copies + 1
    total = copies + len(names)
    in_commit = seed % 3 == 1  # seeds 1 and 4 (of the default 6) fall in the commit, 1 on rank 0
    events = rnd.randint(commit_from, total) if in_commit else rnd.randint(1, commit_from - 1)
    victim = 0 if in_commit and seed % 2 == 1 else rnd.randrange(4)
    delay = rnd.uniform(0.0, 0.4)
    script = tmp_path / "rank.py"
    script.write_text(RANK_WRAPPER)
    dst = s3.url("killed")
    runs, what = _two_nodes_killed(script, ["reshard", str(src), dst, *TARGET], events, victim, delay,
                                   CKPT_S3_STAGING=str(staging), GTP_TEST_SLOW="0.2")
    what = f"seed {seed}: {what} (of {total})"
    assert " killed " in what, (what, [r.stderr[-2000:] for r in runs])
    keys = s3.keys("killed/")
    if any(k.endswith("/metadata.json") for k in keys):  # complete: every object, and its data verified
        assert keys == [f"killed/{n}" for n in names], (what, keys)
        v = one("verify", "--data", dst)
        assert v.returncode == 0, (what, v.stdout + v.stderr)
        d = one("diff", "--bitwise", str(one_process_output), dst)
        assert d.returncode == 0 and "0 differ" in d.stdout, (what, d.stdout + d.stderr)
    else:  # absent: without its commit object no reader takes the prefix for a checkpoint
        assert any(r.returncode != 0 for r in runs), what
        if victim != 0 or events < commit_from:  # only rank 0 puts side files, during its commit
            assert all(k.rsplit("/", 1)[-1].startswith("__") for k in keys), (what, keys)
        if keys:
            v = one("verify", s3.url("killed/iter_0000002"))
            assert v.returncode == 2 and ("unfinished upload" in v.stderr or "not a checkpoint" in v.stderr), \
                (what, v.stdout + v.stderr)
    lines = _errors(runs)
    assert all("Traceback" not in x for x in lines), (what, lines)
    assert _digests(src) == before, what
    assert _ranks_left(str(src)) == [], what
    left = work.leftovers(staging)
    assert all(w.state == "dead" and work.proven(w) for w in left), (what, left)
    again = _run([sys.executable, "-m", "ckpt_tool.cli", "reshard", str(src), s3.url("again"), *TARGET],
                 CKPT_S3_STAGING=str(staging))
    assert again.returncode == 0, (what, again.stderr)
    assert list(staging.iterdir()) == [], (what, list(staging.iterdir()))
    assert _digests(src) == before, what


@pytest.mark.parametrize("seed", range(3))
def test_a_rank_killed_at_a_random_point_of_an_hf_export_across_two_nodes(s3, tmp_path: Path, seed: int) -> None:
    """As :func:`test_a_rank_killed_at_a_random_point_across_two_nodes`, for ``export --to hf --optimizer`` to a
    bucket from 2 nodes x 2 ranks (seed 1 kills rank 0 in its commit: the side files, ``config.json`` last).
    The prefix holds one process's every object (``config.json`` there) or no ``config.json``, with what is left
    data objects only unless rank 0 died in its commit; SRC untouched; no rank left; the staging's leftovers are
    proven dead writers' folders, which the next writer there removes."""
    from gtp_format import work

    rnd = random.Random(seed)
    src, staging, before = _copied(tmp_path, SRC)
    want = one("export", str(src), str(tmp_path / "one"), *HF_ARGS)
    assert want.returncode == 0, want.stderr
    files = sorted(p.name for p in (tmp_path / "one").iterdir())
    copies = sum(1 for f in files if f.endswith(".safetensors"))
    commit_from, total = 2 * copies + 1, copies + len(files)
    in_commit = seed == 1
    events = rnd.randint(commit_from, total) if in_commit else rnd.randint(1, commit_from - 1)
    victim = 0 if in_commit else rnd.randrange(4)
    delay = rnd.uniform(0.0, 0.4)
    script = tmp_path / "rank.py"
    script.write_text(RANK_WRAPPER)
    runs, what = _two_nodes_killed(script, ["export", str(src), s3.url("hfk"), *HF_ARGS], events, victim, delay,
                                   CKPT_S3_STAGING=str(staging), GTP_TEST_SLOW="0.2")
    what = f"seed {seed}: {what} (of {total})"
    assert " killed " in what, (what, [r.stderr[-2000:] for r in runs])
    keys = s3.keys("hfk/")
    if "hfk/config.json" in keys:  # complete: one process's every object
        assert keys == [f"hfk/{f}" for f in files], (what, keys)
        for f in files:
            body = s3.client.get_object(Bucket=s3.bucket, Key=f"hfk/{f}")["Body"].read()
            if f == "gtp_attestation.json":
                assert _attestation_less_run(body) == _attestation_less_run((tmp_path / "one" / f).read_bytes())
            else:
                assert body == (tmp_path / "one" / f).read_bytes(), (what, f)
    else:
        assert any(r.returncode != 0 for r in runs), what
        if victim != 0 or events < commit_from:
            assert all(k.endswith(".safetensors") for k in keys), (what, keys)
    assert all("Traceback" not in x for x in _errors(runs)), what
    assert _digests(src) == before, what
    assert _ranks_left(str(src)) == [], what
    assert all(w.state == "dead" and work.proven(w) for w in work.leftovers(staging)), what
    again = _run([sys.executable, "-m", "ckpt_tool.cli", "export", str(src), s3.url("again"), *HF_ARGS],
                 CKPT_S3_STAGING=str(staging))
    assert again.returncode == 0, (what, again.stderr)
    assert list(staging.iterdir()) == [], (what, list(staging.iterdir()))
