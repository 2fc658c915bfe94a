"""The reshard writers' output file (:class:`gtp_format.writer.sink.Sink`) against brute force: for
any split of any bytes into writes, any staging size, direct or buffered, and a direct write that
comes back short or is refused part-way, the file holds exactly the concatenation and the entry
has its size and CRC-32C; a full disk propagates and leaves no open descriptor."""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

import google_crc32c
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gtp_format.writer import sink as sink_mod
from gtp_format.writer.sink import ALIGN, PIECE, Sink, stage_bytes

SIZES = st.lists(st.integers(0, 3 * ALIGN + 17), max_size=12)


def _payload(sizes: list[int], seed: int) -> list[bytes]:
    out, k = [], seed
    for n in sizes:
        out.append(bytes((k + i * 7) % 251 for i in range(n)))
        k += 13
    return out


def _check(path: Path, parts: list[bytes], entry: object) -> None:
    want = b"".join(parts)
    assert path.read_bytes() == want
    assert entry.size == len(want)  # type: ignore[attr-defined]
    assert entry.checksums == {"crc32c": f"{google_crc32c.value(want):08x}"}  # type: ignore[attr-defined]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sizes=st.lists(SIZES, max_size=6), stage=st.sampled_from([1, ALIGN, 2 * ALIGN, 3 * ALIGN + 5]),
       direct=st.booleans(), seed=st.integers(0, 250))
def test_any_writes_give_the_concatenation(tmp_path: Path, sizes: list[list[int]], stage: int, direct: bool,
                                           seed: int) -> None:
    path = tmp_path / f"f{len(list(tmp_path.iterdir()))}"
    calls = [_payload(s, seed + i) for i, s in enumerate(sizes)]
    with Sink(path, stage, direct=direct) as out:
        for parts in calls:
            out.write(parts)
        entry = out.close()
    _check(path, [p for parts in calls for p in parts], entry)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sizes=st.lists(SIZES, max_size=6), cuts=st.lists(st.booleans(), max_size=6),
       stage=st.sampled_from([1, ALIGN, 3 * ALIGN + 5]), direct=st.booleans(), seed=st.integers(0, 250),
       piece=st.sampled_from([PIECE, 1000, ALIGN + 3]))
def test_segment_hashes_are_the_hashes_of_the_bytes_between_cuts(tmp_path: Path, sizes: list[list[int]],
                                                                 cuts: list[bool], stage: int, direct: bool,
                                                                 seed: int, piece: int) -> None:
    """What the runtime's save records instead of reading its files back: for any writes and any cuts
    between them (a cut twice at one place included), each non-empty run between two cuts, the last
    one ended by ``close``, has the xxh3-128 of exactly those bytes of the file. ``piece``: the sink
    hashes and copies a part in pieces of this size; smaller than a part here, so a part's pieces
    cross staging-buffer ends."""
    path = tmp_path / f"f{len(list(tmp_path.iterdir()))}"
    calls = [_payload(s, seed + i) for i, s in enumerate(sizes)]
    marks = {0}
    saved, sink_mod.PIECE = sink_mod.PIECE, piece
    try:
        with Sink(path, stage, direct=direct, segments=True) as out:
            for i, parts in enumerate(calls):
                out.write(parts)
                if i < len(cuts) and cuts[i]:
                    marks.add(out.cut())
                    marks.add(out.cut())
            entry = out.close()
    finally:
        sink_mod.PIECE = saved
    data = path.read_bytes()
    _check(path, [p for parts in calls for p in parts], entry)
    bounds = sorted(marks | {len(data)})
    want = {(a, b): xxhash.xxh3_128_hexdigest(data[a:b]) for a, b in zip(bounds, bounds[1:]) if b > a}
    assert out.segments == want


def test_direct_is_used_where_the_file_system_takes_it(tmp_path: Path) -> None:
    """On this checkout's temp folder (ext4 here) the fast path runs; elsewhere the fallback does,
    with the same bytes (the test above)."""
    out = Sink(tmp_path / "f", ALIGN, direct=True)
    taken = out.direct
    small = Sink(tmp_path / "g", sink_mod.DIRECT_MIN - ALIGN)
    assert not small.direct  # small stages go through the page cache
    small.abort()
    out.write([b"x" * 10])
    out.close()
    assert (tmp_path / "f").read_bytes() == b"x" * 10
    if os.uname().sysname == "Linux" and taken is False:
        pytest.skip("this file system refuses O_DIRECT: the fallback is what ran")


@pytest.mark.parametrize("short_at", [0, 1, 2])
def test_short_then_refused_direct_write_falls_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     short_at: int) -> None:
    """A direct write that comes back short (one block of several), then one refused with EINVAL,
    switches the file to buffered writes from the right offset; the bytes are unchanged."""
    real = os.pwrite
    state = {"n": 0, "refused": False}

    def fake(fd: int, data: memoryview, offset: int) -> int:
        state["n"] += 1
        direct = bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)
        if direct and state["n"] == short_at + 1 and len(data) > ALIGN:
            return real(fd, data[:ALIGN], offset)
        if direct and state["n"] > short_at + 1 and not state["refused"]:
            state["refused"] = True
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, data, offset)

    monkeypatch.setattr(sink_mod.os, "pwrite", fake)
    parts = _payload([5 * ALIGN + 3, 7, 9 * ALIGN, 100], 3)
    path = tmp_path / "f"
    with Sink(path, 2 * ALIGN, direct=True) as out:
        if not out.direct:
            pytest.skip("this file system refuses O_DIRECT")
        out.write(parts[:2])
        out.write(parts[2:])
        entry = out.close()
    assert state["refused"] and not out.direct
    _check(path, parts, entry)


def test_full_disk_propagates_and_closes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def full(fd: int, data: memoryview, offset: int) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(sink_mod.os, "pwrite", full)
    monkeypatch.setattr(sink_mod.os, "writev", lambda fd, views: full(fd, views[0], 0))
    for direct in (True, False):
        path = tmp_path / f"f{direct}"
        out = Sink(path, ALIGN, direct=direct)
        fd = out.fd
        with pytest.raises(OSError) as info:
            with out:
                out.write([b"y" * (3 * ALIGN)])
                out.close()
        assert info.value.errno == errno.ENOSPC
        assert out.fd == -1
        with pytest.raises(OSError):
            os.fstat(fd)


def test_a_file_cut_short_after_its_fsync_fails_its_close(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The size check that replaced the save's read-back: a file whose size on disk is not what was
    handed in (here: cut by a second ftruncate) fails ``close`` with the file's name."""
    real = os.ftruncate
    monkeypatch.setattr(sink_mod.os, "ftruncate", lambda fd, n: real(fd, n - 1))
    path = tmp_path / "f"
    with pytest.raises(OSError) as info:
        with Sink(path, ALIGN, direct=True) as out:
            if not out.direct:
                pytest.skip("this file system refuses O_DIRECT: no padded last block to cut")
            out.write([b"z" * (ALIGN + 5)])
            out.close()
    assert info.value.errno == errno.EIO and info.value.filename == str(path)


def test_two_stages_take_at_most_one_chunk() -> None:
    assert stage_bytes(1 << 20) == 1 << 19  # two buffers: one chunk of the worker's four
    assert stage_bytes(1 << 30) == sink_mod.COPY_STAGE


def _shm_sink() -> Path:
    shm = Path("/dev/shm")
    if not shm.is_dir() or not os.access(shm, os.W_OK):
        pytest.skip("no writable /dev/shm here")
    return shm / f"ckpt-sink-test-{os.getpid()}"


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sizes=st.lists(st.integers(0, 2 * PIECE + 17), max_size=6), zeros=st.lists(st.integers(0, PIECE + 9),
       max_size=3), seed=st.integers(0, 250))
def test_a_file_in_memory_is_written_without_staging_with_the_same_bytes(tmp_path: Path, sizes: list[int],
                                                                         zeros: list[int], seed: int) -> None:
    """On tmpfs (``/dev/shm``) a default sink writes the caller's pieces from the caller's bytes, at their offsets,
    on its writer thread (no ``O_DIRECT``, no staging copy): the file, its CRC-32C and its segment hashes are those
    of a staged direct sink on disk, zeros included."""
    mem = _shm_sink()
    parts = _payload(sizes, seed)
    try:
        got = []
        for path, direct in ((mem, None), (tmp_path / "disk", True)):
            path.unlink(missing_ok=True)
            with Sink(path, sink_mod.DIRECT_MIN, direct=direct, segments=True) as out:
                if path == mem:
                    if not sink_mod.memory_backed(out.fd):
                        pytest.skip("/dev/shm is not tmpfs here")
                    assert not out.direct
                for k, p in enumerate(parts):
                    out.write([p])
                    out.cut()
                    if k < len(zeros):
                        out.write_zeros(zeros[k])
                        out.cut()
                entry = out.close()
            got.append((path.read_bytes(), entry, out.segments))
        assert got[0] == got[1]
        want = b"".join(p + bytes(zeros[k]) if k < len(zeros) else p for k, p in enumerate(parts))
        assert got[0][0] == want and got[0][1].checksums == {"crc32c": f"{google_crc32c.value(want):08x}"}
    finally:
        mem.unlink(missing_ok=True)


def test_a_full_file_system_in_memory_propagates_and_closes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A write the writer thread fails (ENOSPC: a full /dev/shm) is raised by the write that handed it over, and
    the file is closed."""
    mem = _shm_sink()

    def full(fd: int, data: memoryview, offset: int) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(sink_mod.os, "pwrite", full)
    try:
        out = Sink(mem, sink_mod.DIRECT_MIN, segments=True)
        if not sink_mod.memory_backed(out.fd):
            out.abort()
            pytest.skip("/dev/shm is not tmpfs here")
        with pytest.raises(OSError) as info:
            with out:
                out.write([b"y" * (3 * PIECE)])
        assert info.value.errno == errno.ENOSPC and out.fd == -1
    finally:
        mem.unlink(missing_ok=True)
