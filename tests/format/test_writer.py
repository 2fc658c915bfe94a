"""The one checkpoint writer (gtp_format.writer.checkpoint) and its work folders (gtp_format.work)."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from gtp_format import commit, work
from gtp_format.manifest import read_manifest
from gtp_format.names import LATEST_FILE, MANIFEST_FILE, MEGATRON_METADATA_FILE
from gtp_format.writer.checkpoint import (
    CheckpointWriter,
    DestinationTaken,
    data_file_name,
    file_entry,
    megatron_metadata,
)

REPO = Path(__file__).resolve().parents[2]
FIXTURE = REPO / "fixtures" / "gtp" / "fold_cp2_g2_dp2" / "iter_0000002"


@pytest.fixture(params=["renameat2", "portable"])
def kernel(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each commit test runs with Linux renameat2 and with the fallback used where it is missing."""
    if request.param == "portable":
        monkeypatch.setattr(commit, "_renameat2", lambda a, b, flags: False)
    return request.param


def _rebuild_fixture(writer: CheckpointWriter) -> None:
    """Copy the fixture's data files and .metadata through the writer, as reshard/the runtime do."""
    manifest = read_manifest(FIXTURE, strict=True)
    for name in manifest.files:
        if name != ".metadata":
            (writer.folder / name).write_bytes((FIXTURE / name).read_bytes())
    writer.add_files({n: file_entry(writer.folder / n) for n in manifest.files if n != ".metadata"})
    (writer.folder / ".metadata").write_bytes((FIXTURE / ".metadata").read_bytes())
    writer.add_file(".metadata")
    writer.finish(manifest, megatron_metadata(manifest.layout))


def test_writer_output_is_the_runtime_format_byte_for_byte(tmp_path: Path, kernel: str) -> None:
    target = tmp_path / "iter_0000002"
    with CheckpointWriter(target) as w:
        assert w.work is not None and w.work.parent == tmp_path and w.work.name.startswith(".tmp.iter_0000002.w")
        _rebuild_fixture(w)
        w.commit()
        w.set_latest(2)
    assert sorted(os.listdir(tmp_path)) == sorted([LATEST_FILE, "iter_0000002"])
    assert (tmp_path / LATEST_FILE).read_text() == "2\n"
    for name in os.listdir(FIXTURE):
        assert (target / name).read_bytes() == (FIXTURE / name).read_bytes(), name
    assert sorted(os.listdir(target)) == sorted(os.listdir(FIXTURE))


def test_nested_output_holds_the_iteration_and_the_marker_written_last(tmp_path: Path, kernel: str) -> None:
    dst = tmp_path / "out"
    with CheckpointWriter(dst, inner="iter_0000002", latest="2") as w:
        _rebuild_fixture(w)
        marker = w.work / LATEST_FILE  # type: ignore[operator]
        assert marker.stat().st_mtime_ns >= (w.folder / MEGATRON_METADATA_FILE).stat().st_mtime_ns
        w.commit()
    assert sorted(os.listdir(dst)) == sorted([LATEST_FILE, "iter_0000002"]) and os.listdir(tmp_path) == ["out"]
    assert json.loads((dst / "iter_0000002" / MANIFEST_FILE).read_text())["files"] == \
        json.loads((FIXTURE / MANIFEST_FILE).read_text())["files"]


def test_a_destination_that_appears_is_never_replaced(tmp_path: Path, kernel: str) -> None:
    dst = tmp_path / "out"
    with CheckpointWriter(dst, inner="iter_0000002", latest="2") as w:
        _rebuild_fixture(w)  # a real checkpoint: the writer reads it back before it commits
        dst.mkdir()  # empty: a bare rename() would silently replace it
        with pytest.raises(DestinationTaken, match="appeared while"):
            w.commit()
    assert os.listdir(dst) == [] and os.listdir(tmp_path) == ["out"]
    (dst / "theirs").write_text("keep")
    with CheckpointWriter(dst) as w:
        w.finish(None, None)
        with pytest.raises(DestinationTaken):
            w.commit()
    assert os.listdir(dst) == ["theirs"] and os.listdir(tmp_path) == ["out"]


def test_two_writers_race_to_one_destination_exactly_one_wins(tmp_path: Path, kernel: str) -> None:
    dst, start = tmp_path / "out", threading.Barrier(8)
    outcomes: list[str] = []

    def one(i: int) -> None:
        with CheckpointWriter(dst) as w:
            (w.folder / "who").write_text(str(i))
            w.finish(None, None)
            start.wait()
            try:
                w.commit()
                outcomes.append(f"won {i}")
            except DestinationTaken:
                outcomes.append("refused")

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    won = [o for o in outcomes if o.startswith("won")]
    assert len(won) == 1 and outcomes.count("refused") == 7
    assert (dst / "who").read_text() == won[0].split()[1] and os.listdir(tmp_path) == ["out"]


def test_replace_exchanges_and_keeps_no_old_copy(tmp_path: Path, kernel: str) -> None:
    target = tmp_path / "iter_0000003"
    target.mkdir()
    (target / "f").write_text("old")
    with CheckpointWriter(target, replace=True) as w:
        (w.folder / "f").write_text("new")
        w.finish(None, None)
        w.commit()
        w.set_latest(3)
    assert (target / "f").read_text() == "new" and sorted(os.listdir(tmp_path)) == sorted([LATEST_FILE, "iter_0000003"])


def test_abort_removes_only_its_own_work(tmp_path: Path) -> None:
    (tmp_path / "unrelated").write_text("x")
    with pytest.raises(RuntimeError), CheckpointWriter(tmp_path / "out", inner="iter_0000001") as w:
        (w.folder / "half").write_bytes(b"\0" * 100)
        raise RuntimeError("disk full")
    assert os.listdir(tmp_path) == ["unrelated"]


def test_data_file_names_are_dcps() -> None:
    assert data_file_name(3, 1, "torch_dist") == "__3_1.distcp"
    assert data_file_name(0, 0, "safetensors") == "__0_0.safetensors"


def test_file_entry_matches_the_manifest() -> None:
    manifest = read_manifest(FIXTURE, strict=True)
    for name, entry in manifest.files.items():
        assert file_entry(FIXTURE / name) == entry


# -- work folders of dead processes --------------------------------------------------------------

def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


TOKEN = "0123456789abcdef" * 2


def _foreign(parent: Path, target: str, pid: int, start: int, host: str | None = None, tag: str = "tmp") -> Path:
    """A work folder as a writer of ``pid`` makes it: owner in the name, the matching token inside."""
    nonce = hashlib.sha256(TOKEN.encode()).hexdigest()[:6]
    name = f".{tag}.{target}.w{host or work._host_id()}{work._boot_id()}-{pid}-{start}-{nonce}"
    (parent / name).mkdir()
    (parent / name / work.TOKEN_FILE).write_text(TOKEN + "\n")
    (parent / name / "__0_0.distcp").write_bytes(b"x" * 10)
    return parent / name


def test_stale_work_of_dead_owners_is_cleaned_never_a_live_ones(tmp_path: Path) -> None:
    me = os.getpid()
    live = _foreign(tmp_path, "iter_0000001", me, work.start_ticks(me) or 0)
    dead = _foreign(tmp_path, "iter_0000001", _dead_pid(), 1)
    reused = _foreign(tmp_path, "out", me, (work.start_ticks(me) or 0) + 1)  # pid reused since
    other_host = _foreign(tmp_path, "out", 1, 1, host="00000000" if work._host_id() != "00000000" else "11111111")
    legacy = tmp_path / ".tmp.out.0123abcd"
    legacy.mkdir()
    (tmp_path / "iter_0000001").mkdir()
    states = {w.path: w.state for w in work.leftovers(tmp_path)}
    assert states == {live: "live", dead: "dead", reused: "dead", other_host: "unknown", legacy: "unknown"}
    with CheckpointWriter(tmp_path / "new") as w:
        assert w.work is not None
        w.finish(None, None)
        w.commit()
    assert sorted(os.listdir(tmp_path)) == sorted(["iter_0000001", "new", live.name, other_host.name, legacy.name])


def test_only_finished_copies_of_the_missing_latest_iteration_are_kept(tmp_path: Path) -> None:
    (tmp_path / LATEST_FILE).write_text("5\n")
    kept = _foreign(tmp_path, "iter_0000005", _dead_pid(), 1)
    (kept / MEGATRON_METADATA_FILE).write_text("{}")  # finished: written last
    unfinished = _foreign(tmp_path, "iter_0000005", _dead_pid(), 1, tag="old")
    other = _foreign(tmp_path, "iter_0000004", _dead_pid(), 1)  # finished, but no marker names it
    (other / MEGATRON_METADATA_FILE).write_text("{}")
    with CheckpointWriter(tmp_path / "iter_0000006", replace=True) as w:
        w.finish(None, None)
        w.commit()
    assert kept.exists() and not unfinished.exists() and not other.exists()


SIGTERM_CHILD = """
import sys, time
from pathlib import Path
from gtp_format.writer.checkpoint import CheckpointWriter
with CheckpointWriter(Path(sys.argv[1])) as w:
    (w.folder / "half").write_bytes(b"x")
    print("ready", flush=True)
    time.sleep(60)
"""


def test_sigterm_removes_the_work_folder(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    p = subprocess.Popen([sys.executable, "-c", SIGTERM_CHILD, str(tmp_path / "out")], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env=env, text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    assert len(os.listdir(tmp_path)) == 1
    t0 = time.monotonic()
    p.send_signal(signal.SIGTERM)
    p.wait(timeout=60)
    assert p.returncode != 0 and time.monotonic() - t0 < 30
    assert os.listdir(tmp_path) == []

