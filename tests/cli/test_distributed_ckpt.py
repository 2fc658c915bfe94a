"""``ckpt`` under torchrun: the ranks share a reshard, an import and a ``verify --data`` over gloo
(real process groups, started by torchrun as a user starts them), and the output is one process's.

* the output equals one process's (same ``--workers``): the safetensors layout byte for byte, file for
  file (it has nothing random); torch_dist file for file once each blob's ``serialization_id`` (40
  random digits torch.save writes, so two one-process runs differ there too) and that record's CRC are
  blanked, and ``ckpt diff --bitwise``; 2, 3 and 4 local ranks, and 2 nodes x 2 ranks through torchrun's
  c10d rendezvous on 127.0.0.1;
* ``export --to hf|fully_reshardable`` splits its files too (2 and 3 ranks; torch's one file: rank 0);
* ``verify --data`` prints the same report (the same problems, in the same order) on 3 ranks;
* a genuine megatron-core checkpoint (fixtures/megatron) reshards under torchrun to what one process writes;
* a rank killed (SIGKILL, ``CKPT_RANK_FAULT``) during the copy, before the commit, or just after rank 0's
  rename, or at a random moment: DST absent or whole, SRC untouched, no work folder and no process left,
  and the surviving ranks' one line names the killed one.

The machine has 2 shared cores: each torchrun start costs several seconds, so the matrix is small.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
SRC = REPO / "fixtures" / "gtp" / "fold_cp2_g2_dp2"
MEGATRON = REPO / "fixtures" / "megatron" / "cp2_dp2_dp_reshardable"
TARGET = ["--cp", "1", "--dp", "2", "--gtp-remat", "1", "--no-fold-cp", "--workers", "2"]
TIMEOUT = 300

pytestmark = pytest.mark.skipif(not Path(TORCHRUN).exists(), reason="torchrun is not installed")


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    env["CKPT_DIST_TIMEOUT"] = "60"
    env.pop("CKPT_RANK_FAULT", None)
    return {**env, **extra}


def one(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ckpt_tool.cli", *args], cwd=REPO, env=_env(), capture_output=True,
                          text=True, timeout=TIMEOUT)


def ranked(nproc: int, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([TORCHRUN, "--standalone", "--nproc-per-node", str(nproc), "-m", "ckpt_tool.cli", *args],
                          cwd=REPO, env=_env(**env), capture_output=True, text=True, timeout=TIMEOUT)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_nodes(*args: str) -> list[subprocess.CompletedProcess]:
    """2 simulated nodes x 2 ranks: two torchrun agents meeting through c10d rendezvous on 127.0.0.1."""
    port = _free_port()
    cmd = [TORCHRUN, "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"ckpt{port}", "--max-restarts", "0",
           "-m", "ckpt_tool.cli", *args]
    procs = [subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=TIMEOUT)
        out.append(subprocess.CompletedProcess(cmd, p.returncode, stdout, stderr))
    return out


def _blank_ids(raw: bytes) -> bytes:
    """A .distcp with every blob's serialization_id (and that zip record's CRC-32) zeroed."""
    out = bytearray(raw)
    for sig, name_len_at, name_at, crc_at in ((b"PK\x03\x04", 26, 30, 14), (b"PK\x01\x02", 28, 46, 16)):
        for m in re.finditer(re.escape(sig), raw):
            p = m.start()
            (n,) = struct.unpack_from("<H", raw, p + name_len_at)
            if raw[p + name_at:p + name_at + n].endswith(b"serialization_id"):
                out[p + crc_at:p + crc_at + 4] = b"\0\0\0\0"
    # the id, and the CRC-32 of the data descriptor after it (torch.save streams: flag 0x08)
    out = re.sub(rb"\d{40}PK\x07\x08....", b"0" * 40 + b"PK\x07\x08" + b"\0" * 4, bytes(out), flags=re.DOTALL)
    return re.sub(rb"\d{40}(?=PK\x03\x04|PK\x01\x02)", b"0" * 40, out)


def _chunks_without_hashes(path: Path) -> object:
    doc = json.loads(path.read_text())
    for c in doc["chunks"]:
        c.pop("xxh3_128", None)
    return doc


def _without_run_ids(doc: object, drop: tuple[str, ...] = ("run_id", "gtp_attestation.json")) -> object:
    """A JSON document less its ``run_id`` fields (and the manifest's checksum of the attestation that holds
    one): a source with no lineage gets a new run id per conversion."""
    if isinstance(doc, dict):
        return {k: _without_run_ids(v, drop) for k, v in doc.items() if k not in drop}
    if isinstance(doc, list):
        return [_without_run_ids(v, drop) for v in doc]
    return doc


def assert_same_output(a: Path, b: Path, exact: bool) -> None:
    """The two outputs, file for file (``exact``: byte for byte; else torch_dist's random ids blanked)."""
    fa = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    fb = sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    assert fa == fb
    for rel in fa:
        x, y = (a / rel).read_bytes(), (b / rel).read_bytes()
        # torch_dist's random serialization ids are inside the chunk records, so inside the root hashes
        per_run = ("run_id", "gtp_attestation.json") + (() if exact else ("root_hash", "lineage"))
        if rel.name == "gtp_attestation.json" or (exact and rel.name == "gtp_manifest.json"):
            assert _without_run_ids(json.loads(x), per_run) == _without_run_ids(json.loads(y), per_run), rel
        elif exact or rel.suffix not in (".distcp", ".json") or rel.name == "metadata.json":
            assert x == y, rel
        elif rel.suffix == ".distcp":
            assert len(x) == len(y) and _blank_ids(x) == _blank_ids(y), rel
        elif rel.name == "gtp_chunks.json":
            assert _chunks_without_hashes(a / rel) == _chunks_without_hashes(b / rel)
        else:  # the manifest: its CRC-32C of each file covers the ids
            ma, mb = json.loads(x), json.loads(y)
            assert ma.keys() == mb.keys() and {k: v["size"] for k, v in ma["files"].items()} == \
                {k: v["size"] for k, v in mb["files"].items()}
            assert _without_run_ids({k: v for k, v in ma.items() if k != "files"}, per_run) == \
                _without_run_ids({k: v for k, v in mb.items() if k != "files"}, per_run)
    d = one("diff", "--bitwise", str(a), str(b))
    assert d.returncode == 0 and "0 differ" in d.stdout, d.stdout + d.stderr


def _tree_digest(root: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        h.update(str(p.relative_to(root)).encode())
        if p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


@pytest.mark.parametrize(("nproc", "layout"), [(2, "safetensors"), (3, "torch_dist"), (4, "safetensors")])
def test_reshard_on_ranks_is_one_process_output(tmp_path: Path, nproc: int, layout: str) -> None:
    want = one("reshard", str(SRC), str(tmp_path / "one"), *TARGET, "--layout", layout)
    assert want.returncode == 0, want.stderr
    got = ranked(nproc, "reshard", str(SRC), str(tmp_path / "many"), *TARGET, "--layout", layout)
    assert got.returncode == 0, got.stderr[-3000:]
    assert got.stdout.count("wrote ") == 1  # rank 0 alone reports
    assert_same_output(tmp_path / "one", tmp_path / "many", exact=layout == "safetensors")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["many", "one"]  # no work folder left


def test_two_nodes_through_c10d_rendezvous(tmp_path: Path) -> None:
    want = one("reshard", str(SRC), str(tmp_path / "one"), *TARGET, "--workers", "4")
    assert want.returncode == 0, want.stderr
    runs = two_nodes("reshard", str(SRC), str(tmp_path / "many"), *TARGET, "--workers", "4")
    assert [r.returncode for r in runs] == [0, 0], runs[0].stderr[-2000:] + runs[1].stderr[-2000:]
    assert sum(r.stdout.count("wrote ") for r in runs) == 1
    assert_same_output(tmp_path / "one", tmp_path / "many", exact=False)


def test_verify_data_same_report_on_three_ranks(tmp_path: Path) -> None:
    import shutil

    from damage import flip, flip_inside_a_chunk

    bad = tmp_path / "bad"
    shutil.copytree(SRC, bad)
    flip_inside_a_chunk(bad / "iter_0000002", lambda name: name.startswith("__1_"))
    data = sorted((bad / "iter_0000002").glob("__3_*"))[0]
    flip(data, data.stat().st_size // 2)
    want = one("verify", "--data", str(bad), "--format", "json")
    got = ranked(3, "verify", "--data", str(bad), "--format", "json")
    assert want.returncode == got.returncode == 1, got.stderr[-2000:]
    w, g = json.loads(want.stdout), json.loads(got.stdout)
    assert len(w["problems"]) >= 2 and w == g
    assert one("verify", "--data", str(SRC), "--format", "json").stdout == \
        ranked(2, "verify", "--data", str(SRC), "--format", "json").stdout


def test_megatron_core_checkpoint_under_torchrun(tmp_path: Path) -> None:
    args = ("--tp", "1", "--cp", "1", "--dp", "2", "--workers", "2")
    want = one("reshard", str(MEGATRON), str(tmp_path / "one"), *args)
    assert want.returncode == 0, want.stderr
    got = ranked(2, "reshard", str(MEGATRON), str(tmp_path / "many"), *args)
    assert got.returncode == 0, got.stderr[-3000:]
    assert_same_output(tmp_path / "one", tmp_path / "many", exact=False)
    v1 = one("verify", "--data", str(MEGATRON), "--format", "json")
    v2 = ranked(2, "verify", "--data", str(MEGATRON), "--format", "json")
    assert v1.returncode == v2.returncode == 0 and v1.stdout == v2.stdout


def _processes_naming(text: str) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if text.encode() in (d / "cmdline").read_bytes():
                    out.append(int(d.name))
            except OSError:
                pass
    return out


def _check_after_kill(tmp_path: Path, dst: Path, res: subprocess.CompletedProcess, before: str) -> bool:
    """DST absent or whole, SRC untouched, no work folder, no process; True when DST was committed."""
    deadline = time.monotonic() + 20
    while _processes_naming(str(dst)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _processes_naming(str(dst)) == []
    assert _tree_digest(SRC) == before
    # rank 0 removes the work folder, on torchrun's SIGTERM too (from a thread, at once: copying/ranked.py); a
    # killed rank 0's is removed by the surviving rank of its host
    left = [p.name for p in dst.parent.iterdir() if p.name.startswith(".")]
    assert left == [], left
    if dst.exists():
        v = one("verify", "--data", str(dst))
        assert v.returncode == 0, v.stdout + v.stderr
        return True
    return False


# 1:commit: every rank's files were confirmed durable by the exchange before it, so rank 0 commits alone
# 0:created: rank 0 killed between making its work folder and telling rank 1 where: rank 1 finds it by rank 0's pid
@pytest.mark.parametrize(("fault", "committed"), [("0:created", False), ("1:copy", False), ("0:commit", False),
                                                   ("1:commit", True), ("0:renamed", True)])
def test_rank_killed_means_no_commit(tmp_path: Path, fault: str, committed: bool) -> None:
    before = _tree_digest(SRC)
    dst = tmp_path / "out" / "dst"
    dst.parent.mkdir()
    res = ranked(2, "reshard", str(SRC), str(dst), *TARGET, CKPT_RANK_FAULT=fault)
    assert res.returncode != 0
    killed = fault.split(":")[0]
    lines = [x for x in res.stderr.splitlines() if x.startswith("ckpt: error:")]
    assert lines and all(f"rank {killed} (pid" in x for x in lines), res.stderr[-3000:]
    assert _check_after_kill(tmp_path, dst, res, before) == committed


def test_rank_killed_at_a_random_moment(tmp_path: Path) -> None:
    before = _tree_digest(SRC)
    rng = random.Random(os.environ.get("CKPT_TEST_SEED", "44"))
    dst = tmp_path / "out" / "dst"
    dst.parent.mkdir()
    cmd = [TORCHRUN, "--standalone", "--nproc-per-node", "2", "-m", "ckpt_tool.cli", "reshard", str(SRC), str(dst),
           *TARGET]
    p = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ranks: list[int] = []
    deadline = time.monotonic() + 120
    while len(ranks) < 2 and p.poll() is None and time.monotonic() < deadline:  # the ranks have started
        ranks = [q for q in _processes_naming(str(dst)) if q != p.pid]
        time.sleep(0.05)
    time.sleep(rng.uniform(0, 3))
    victim = rng.choice(ranks) if ranks else None
    if victim is not None:
        try:
            os.kill(victim, signal.SIGKILL)
        except ProcessLookupError:
            pass
    _, stderr = p.communicate(timeout=TIMEOUT)
    res = subprocess.CompletedProcess(cmd, p.returncode, "", stderr)
    _check_after_kill(tmp_path, dst, res, before)


EXPORTS = {  # (source, --to and its options, ranks, byte for byte)
    "hf-optimizer-2": (SRC, ("--to", "hf", "--optimizer", "--max-shard-size", "100KB"), 2, True),
    "hf-megatron-names-3": (SRC, ("--to", "hf", "--names", "megatron", "--max-shard-size", "20KB"), 3, True),
    "fully_reshardable-3": (SRC, ("--to", "fully_reshardable", "--workers", "2"), 3, False),
    "fully_reshardable-megatron-core-2": (MEGATRON, ("--to", "fully_reshardable", "--workers", "2"), 2, False),
}


@pytest.mark.parametrize("case", sorted(EXPORTS))
def test_export_splits_its_files_over_the_ranks(tmp_path: Path, case: str) -> None:
    """``export --to hf|fully_reshardable`` under torchrun: each rank writes its share of the files (by bytes),
    rank 0 the index, config and metadata, and commits; the output is one process's (hf: byte for byte;
    torch_dist: less its random serialization ids)."""
    src, args, nproc, exact = EXPORTS[case]
    want = one("export", str(src), str(tmp_path / "one"), *args)
    assert want.returncode == 0, want.stderr
    got = ranked(nproc, "export", str(src), str(tmp_path / "many"), *args)
    assert got.returncode == 0 and got.stdout.count("wrote ") == 1, got.stderr[-3000:]
    assert len([p for p in (tmp_path / "one").rglob("*") if p.suffix in (".safetensors", ".distcp")]) >= nproc
    if case.startswith("hf"):
        assert_same_output(tmp_path / "one", tmp_path / "many", exact=True)  # no checkpoint: diff has nothing
    else:
        assert_same_output(tmp_path / "one", tmp_path / "many", exact=exact)


def test_export_on_ranks_a_killed_rank_means_no_commit(tmp_path: Path) -> None:
    """Rank 1 killed after writing its share of an hf export's files: it did write some (the fault point is in
    the split copy), nothing is committed, no work folder stays, and rank 0 names rank 1. ``--to torch``
    writes its one file on rank 0 alone, equal to one process's."""
    before = _tree_digest(SRC)
    dst = tmp_path / "hf"
    res = ranked(2, "export", str(SRC), str(dst), "--to", "hf", "--optimizer", "--max-shard-size", "100KB",
                 CKPT_RANK_FAULT="1:copy")
    assert res.returncode != 0 and "rank 1" in res.stderr, res.stderr[-3000:]
    assert not _check_after_kill(tmp_path, dst, res, before)
    assert one("export", str(SRC), str(tmp_path / "one.pt"), "--to", "torch").returncode == 0
    got = ranked(2, "export", str(SRC), str(tmp_path / "many.pt"), "--to", "torch")
    assert got.returncode == 0 and got.stdout.count("wrote ") == 1, got.stderr[-3000:]
    assert (tmp_path / "one.pt").read_bytes() == (tmp_path / "many.pt").read_bytes()


def test_import_under_torchrun(tmp_path: Path) -> None:
    """import splits its files (safetensors layout: byte for byte)."""
    hf = tmp_path / "hf"
    assert one("export", str(SRC), str(hf), "--to", "hf", "--optimizer").returncode == 0
    args = ("--from", "hf", "--cp", "2", "--fold-cp", "--dp", "1", "--layout", "safetensors", "--workers", "2")
    want = one("import", str(hf), str(tmp_path / "one"), *args)
    assert want.returncode == 0, want.stderr
    got = ranked(2, "import", str(hf), str(tmp_path / "many"), *args)
    assert got.returncode == 0, got.stderr[-3000:]
    assert_same_output(tmp_path / "one", tmp_path / "many", exact=True)


@pytest.mark.parametrize("command", [("reshard", *TARGET), ("export", "--to", "hf", "--optimizer",
                                                                 "--max-shard-size", "100KB")],
                         ids=["reshard", "export-hf"])
def test_a_damaged_source_found_by_one_rank_fails_every_rank(tmp_path: Path, command: tuple[str, ...]) -> None:
    import shutil

    from damage import flip

    bad = tmp_path / "src"
    shutil.copytree(SRC, bad)
    data = sorted((bad / "iter_0000002").glob("__*_0.distcp"))[-1]
    flip(data, data.stat().st_size // 3)
    want = one(command[0], str(bad), str(tmp_path / "one"), *command[1:])
    got = ranked(2, command[0], str(bad), str(tmp_path / "many"), *command[1:])
    assert want.returncode == got.returncode == 1, got.stderr[-3000:]
    lines = [x for x in got.stderr.splitlines() if x.startswith("ckpt: error:")]
    assert len(lines) == 2 and all("damaged" in x and re.search(r"rank [01]", x) for x in lines), lines
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # no DST, no work folder
