"""``ckpt reshard`` and ``verify --data`` under torchrun with a bucket as source and as destination (moto's
local S3 server): each rank opens the bucket with its own client; the output is one process's."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
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
    import shutil

    src, staging = tmp_path / "src", tmp_path / "staging"
    shutil.copytree(SRC, src)
    staging.mkdir()
    before = _digests(src)
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
    entries are what each node checks its staged files against); ``export --to hf`` records no entries of its
    files, so across nodes it is refused in one line on every rank before anything is uploaded (one node, or a
    shared folder, runs it). No staging folder or rank is left."""
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
    runs = two_nodes("export", str(SRC), s3.url("hf"), "--to", "hf", CKPT_S3_STAGING=str(staging))
    assert all(r.returncode != 0 for r in runs), [r.stderr[-2000:] for r in runs]
    lines = _errors(runs)
    named = [x for x in lines if "records no entries" in x]
    assert named and len(lines) <= 4 and all(x in named or "nothing was committed" in x for x in lines), lines
    assert s3.keys("hf") == []
    assert list(staging.iterdir()) == []
    assert _ranks_left(s3.url("hf")) == []


def test_a_damaged_staged_file_on_another_node_is_refused_naming_file_and_rank(s3, tmp_path: Path) -> None:
    """2 nodes x 2 ranks, bucket DST: rank 3 (node 1) flips a byte of one of its staged files before its check
    (``CKPT_RANK_FAULT=3:damage``): its verdict is that file's one line naming rank 3, every rank exits non-zero,
    nothing is uploaded, both nodes' staging folders are removed, SRC untouched, no rank left."""
    import shutil

    src, staging = tmp_path / "src", tmp_path / "staging"
    shutil.copytree(SRC, src)
    staging.mkdir()
    before = _digests(src)
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
    created (``CKPT_RANK_FAULT=R:upload``). No commit object: the prefix is no checkpoint (``ckpt verify``
    refuses it); the surviving ranks removed every object they created, so what is left is at most the killed
    rank's own (which nothing can prove ours); the killed rank's staging folder is removed by the surviving rank
    of its node; SRC untouched; no rank left."""
    import shutil

    src, staging = tmp_path / "src", tmp_path / "staging"
    shutil.copytree(SRC, src)
    staging.mkdir()
    before = _digests(src)
    dst = s3.url("killed")
    runs = two_nodes("reshard", str(src), dst, *TARGET, CKPT_RANK_FAULT=fault, CKPT_S3_STAGING=str(staging))
    assert all(r.returncode != 0 for r in runs), [r.stderr[-2000:] for r in runs]
    keys = s3.keys("killed")
    assert not any(k.endswith("metadata.json") for k in keys), keys
    assert len(keys) <= 1 and all(k.rsplit("/", 1)[-1].startswith("__") for k in keys), keys
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
    import shutil

    src, staging = tmp_path / "src", tmp_path / "staging"
    shutil.copytree(SRC, src)
    staging.mkdir()
    before = _digests(src)
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
