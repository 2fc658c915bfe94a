"""torchrun's environment as input: garbage in RANK/WORLD_SIZE or CKPT_DIST_TIMEOUT, a job of one rank, and
the split's arithmetic (gtp_format/ranks.py). No torchrun is started here: these fail, or run as one
process, before any process group exists."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gtp_format.errors import FormatError
from gtp_format.ranks import assign, node_of, under_torchrun

REPO = Path(__file__).resolve().parents[2]
SRC = REPO / "fixtures" / "gtp" / "fold_cp2_g2_dp2"


def _ckpt(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    e["PYTHONPATH"] = str(REPO)
    return subprocess.run([sys.executable, "-m", "ckpt_tool.cli", *args], cwd=REPO, env={**e, **env},
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(("env", "words"), [
    ({"RANK": "x", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, "RANK/WORLD_SIZE: not whole numbers"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "CKPT_DIST_TIMEOUT": "soon"}, "CKPT_DIST_TIMEOUT='soon'"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "GROUP_RANK": "-1"}, "GROUP_RANK='-1': not a node index"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "GROUP_RANK": "9" * 40}, "not a node index"),
])
def test_bad_torchrun_environment_is_one_line(tmp_path: Path, env: dict[str, str], words: str) -> None:
    p = _ckpt(env, "reshard", str(SRC), str(tmp_path / "dst"), "--dp", "1")
    assert p.returncode == 2 and words in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and not (tmp_path / "dst").exists()


def test_a_job_of_one_rank_runs_as_one_process(tmp_path: Path) -> None:
    p = _ckpt({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}, "verify", "--data", str(SRC))
    assert p.returncode == 0, p.stderr
    assert "torch" not in p.stderr


def test_torchrun_is_told_by_its_environment() -> None:
    assert not under_torchrun({})
    assert not under_torchrun({"RANK": "0", "WORLD_SIZE": "2"})  # a user's variables, not a launcher's
    assert under_torchrun({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"})
    assert under_torchrun({"RANK": "1", "WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "x"})


def test_a_node_is_torchruns_agent_not_the_host_name() -> None:
    # two agents on one machine (simulated nodes) are two nodes: a node-local staging folder is not shared
    assert node_of({"GROUP_RANK": "0"}, host="a") != node_of({"GROUP_RANK": "1"}, host="a")
    assert node_of({"GROUP_RANK": "007"}, host="a") == "node 7"
    assert node_of({}, host="a") == "host a" != node_of({}, host="b")  # no GROUP_RANK: the host name decides
    for bad in ("", " 1", "1.0", "x", "1" * 10):
        with pytest.raises(FormatError, match="GROUP_RANK"):
            node_of({"GROUP_RANK": bad})


def test_split_balances_bytes_largest_first() -> None:
    # one large file and many small ones: counts would give rank 0 the large one and half the small ones
    sizes = [900, 100, 100, 100, 100, 100, 100, 100, 100, 100]
    owner = assign(sizes, 2)
    loads = [sum(s for s, r in zip(sizes, owner) if r == k) for k in range(2)]
    assert loads == [900, 900] and owner[0] == 0
    assert assign(sizes, 2) == owner  # deterministic: every rank computes the same
    assert assign([5, 5, 5], 4) == [0, 1, 2] and assign([], 3) == []
    assert sorted(set(assign([1] * 12, 3))) == [0, 1, 2] and all(assign([1] * 12, 3).count(r) == 4 for r in range(3))


def test_sigterm_removal_with_entries_still_appearing(tmp_path: Path) -> None:
    """Rank 0's removal on SIGTERM (copying/ranked.py) while other ranks may still add files to its work folder:
    the folder goes, or, while entries keep appearing, stays with its token (a proven dead writer's, which the
    next writer removes), never as an unproven half-removed folder."""
    import threading
    import time

    from ckpt_tool.copying.ranked import remove_owned_work
    from gtp_format import work

    quiet = work.new_work(tmp_path / "dst", "tmp")
    (quiet / "a.distcp").write_bytes(b"x" * 100)
    remove_owned_work(quiet)
    assert not quiet.exists()

    busy = work.new_work(tmp_path / "dst2", "tmp")
    stop = threading.Event()

    def keep_writing() -> None:
        n = 0
        while not stop.is_set():
            try:
                (busy / f"late{n}.distcp").write_bytes(b"y")
            except OSError:
                pass
            n += 1
            time.sleep(0.001)

    t = threading.Thread(target=keep_writing)
    t.start()
    try:
        remove_owned_work(busy, tries=3)
    finally:
        stop.set()
        t.join()
    found = {w.path: w for w in work.leftovers(tmp_path)}
    assert all(work.proven(w) for w in found.values()), found  # the folder with its token, or its proof beside it
    assert (busy in found) == busy.exists() and len(found) <= 2, found


def test_a_staged_file_is_read_in_full_against_its_entry(tmp_path: Path) -> None:
    """``check_written``, the ranks' check of a bucket output's staged files: a byte changed, a file cut short,
    a sparse file of its size, a file gone and a link out of the folder are each one line naming the file."""
    from gtp_format.check.gate import check_written
    from gtp_format.writer.checkpoint import file_entry

    body = os.urandom(1 << 20)
    (tmp_path / "out").mkdir()
    f = tmp_path / "out" / "__0_0.safetensors"
    f.write_bytes(body)
    entries = {f.name: file_entry(f)}
    assert check_written(tmp_path / "out", entries) is None
    f.write_bytes(body[:100] + bytes([body[100] ^ 1]) + body[101:])
    assert check_written(tmp_path / "out", entries).startswith(f"{f.name}: crc32c is ")
    f.write_bytes(body[:-1])
    short = check_written(tmp_path / "out", entries)
    assert short == f"{f.name} is {len(body) - 1} bytes but was written as {len(body)}"
    f.unlink()
    with open(f, "wb") as w:
        w.truncate(len(body) * 64)  # holes: nothing to read in full
    assert f.name in check_written(tmp_path / "out", {f.name: file_entry(f)})
    f.unlink()
    assert f.name in check_written(tmp_path / "out", entries)
    (tmp_path / "outside").write_bytes(body)
    f.symlink_to(tmp_path / "outside")
    assert f.name in check_written(tmp_path / "out", entries)


def test_each_rank_sizes_its_threads_from_its_share_of_the_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranks of one host with the same affinity share its cores (4 ranks on 4 cores: 1 thread each, not 4); ranks
    bound to cores of their own, or on another host (even of the same node index), keep theirs; never 0."""
    from gtp_format import ranks

    def group(rank: int, peers: list[ranks.Peer]) -> ranks.Group:
        return ranks.Group(rank, len(peers), peers)

    four = (0, 1, 2, 3)
    shared = [ranks.Peer(r, "h", 100 + r, "node 0" if r < 2 else "node 1", four) for r in range(4)]
    monkeypatch.setattr(ranks, "_current", group(2, shared))
    assert ranks.sharing(ranks._current) == 4 and ranks.cores_per_rank(4) == 1 and ranks.cores_per_rank(16) == 4
    assert ranks.cores_per_rank(2) == 1  # at least one
    bound = [ranks.Peer(r, "h", 100 + r, "node 0", (r,)) for r in range(4)]
    monkeypatch.setattr(ranks, "_current", group(1, bound))
    assert ranks.cores_per_rank(1) == 1 and ranks.sharing(ranks._current) == 1
    hosts = [ranks.Peer(r, f"h{r % 2}", 100 + r, "node 0", four) for r in range(4)]
    monkeypatch.setattr(ranks, "_current", group(0, hosts))
    assert ranks.cores_per_rank(4) == 2
    monkeypatch.setattr(ranks, "_current", None)
    assert ranks.cores_per_rank(4) == 4  # one process: all of them
