"""A file written as runs by several threads at once (:class:`gtp_format.writer.sink.SharedFile`,
:class:`~gtp_format.writer.sink.RunSink`; the ``.distcp`` files of ``import --to megatron-core``,
:func:`ckpt_tool.copying.engine.write_distcp_files`) against one :class:`~gtp_format.writer.sink.Sink`
writing the same bytes in order:

* any bytes cut into any runs (empty ones, runs inside one block, boundaries on and off the blocks), each
  written on its own thread in any pieces and zeros, direct or buffered, any staging size: the file, its
  size, its CRC-32C and every segment hash are those of the bytes in order;
* runs that do not tile the file, or a run that wrote more or fewer bytes than planned, are refused before
  anything more is written; a failing write propagates and every descriptor is closed;
* ``write_distcp_files`` at any run size writes the files, records and blob places that ``write_distcp``
  writes for each file on one thread (the serialization ids drawn in the same order), and holds at most its
  threads' chunks at once.
"""

from __future__ import annotations

import errno
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import google_crc32c
import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckpt_tool.copying import writers
from ckpt_tool.copying.engine import write_distcp_files
from ckpt_tool.copying.plan import FP32, OutChunk
from ckpt_tool.copying.writers import Zeros, plan_runs, write_distcp
from gtp_format.writer import sink as sink_mod
from gtp_format.writer import torch_blob
from gtp_format.writer.sink import ALIGN, SharedFile

# one run: its writes, each ("b", n) bytes of the stream or ("z", n) zeros (the stream holds zeros there too)
WRITES = st.lists(st.tuples(st.sampled_from("bbz"), st.integers(0, 3 * ALIGN + 17)), max_size=5)


def _stream(runs: list[list[tuple[str, int]]], seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    out = bytearray()
    for writes in runs:
        for kind, n in writes:
            out += bytes(n) if kind == "z" else rng.integers(1, 256, n, dtype=np.uint8).tobytes()
    return bytes(out)


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(runs=st.lists(WRITES, min_size=1, max_size=6), stage=st.sampled_from([ALIGN, 2 * ALIGN, 3 * ALIGN + 5]),
       direct=st.booleans(), seed=st.integers(0, 250))
def test_runs_on_threads_give_the_bytes_in_order(tmp_path: Path, runs: list[list[tuple[str, int]]], stage: int,
                                                 direct: bool, seed: int) -> None:
    data = _stream(runs, seed)
    path = tmp_path / f"f{len(list(tmp_path.iterdir()))}"
    starts = np.cumsum([0] + [sum(n for _, n in w) for w in runs]).tolist()
    shared = SharedFile(path, stage, len(data), direct=direct)

    def one(k: int) -> tuple[int, object, list[tuple[int, bytes]], dict[tuple[int, int], str]]:
        out = shared.run(starts[k], stage, segments=True)
        with out:
            pos = starts[k]
            for kind, n in runs[k]:
                out.cut()
                if kind == "z":
                    out.write_zeros(n)
                else:
                    out.write([data[pos:pos + n]])
                pos += n
            entry = out.close()
        return starts[k], entry, out.edges, out.segments

    with ThreadPoolExecutor(len(runs)) as pool:
        got = list(pool.map(one, range(len(runs))))
    entry = shared.finish([g[:3] for g in got])  # type: ignore[misc]
    assert path.read_bytes() == data
    assert entry.size == len(data) and entry.checksums == {"crc32c": f"{google_crc32c.value(data):08x}"}
    for *_, segments in got:
        for (a, b), digest in segments.items():
            assert digest == xxhash.xxh3_128_hexdigest(data[a:b]), (a, b)
    assert shared.fd == -1


def test_direct_runs_write_whole_blocks_and_the_shared_ones_once(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Direct: every write is whole aligned blocks, no block is written twice, and a run's unaligned edges
    are written by ``finish`` alone (the last block padded, then cut back)."""
    writes: list[tuple[int, int]] = []
    lock = threading.Lock()
    real = os.pwrite

    def spy(fd: int, view: memoryview, offset: int) -> int:
        with lock:
            writes.append((offset, len(view)))
        return real(fd, view, offset)

    monkeypatch.setattr(sink_mod.os, "pwrite", spy)
    data = np.random.default_rng(1).integers(0, 256, 9 * ALIGN + 123, dtype=np.uint8).tobytes()
    cuts = [0, 100, 3 * ALIGN + 7, 3 * ALIGN + 9, 6 * ALIGN, len(data)]
    shared = SharedFile(tmp_path / "f", 2 * ALIGN, len(data), direct=True)
    if not shared.direct:
        shared.abort()
        pytest.skip("this file system refuses O_DIRECT")
    done = []
    for a, b in zip(cuts, cuts[1:]):
        out = shared.run(a, 2 * ALIGN)
        with out:
            out.write([data[a:b]])
            done.append((a, out.close(), out.edges))
    shared.finish(done)
    assert (tmp_path / "f").read_bytes() == data
    assert all(off % ALIGN == 0 and n % ALIGN == 0 for off, n in writes), writes
    blocks = [off // ALIGN + i for off, n in writes for i in range(n // ALIGN)]
    assert sorted(blocks) == list(range(len(data) // ALIGN + 1))  # each block once, the padded last one too


def test_runs_that_do_not_tile_the_file_are_refused(tmp_path: Path) -> None:
    data = bytes(range(256)) * 40
    fds = _fds()
    shared = SharedFile(tmp_path / "f", ALIGN, len(data) + 1)
    out = shared.run(0, ALIGN)
    with out:
        out.write([data])
        entry = out.close()
    with pytest.raises(AssertionError, match="runs of 10240 bytes for a 10241-byte file"):
        shared.finish([(0, entry, out.edges)])
    assert _fds() == fds
    shared = SharedFile(tmp_path / "g", ALIGN, 2 * len(data))
    with pytest.raises(AssertionError, match="a run starts at 5, the one before ended at 0"):
        shared.finish([(5, entry, out.edges)])


def test_a_run_that_fails_propagates_and_closes_every_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def full(fd: int, data: memoryview, offset: int) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(sink_mod.os, "pwrite", full)
    chunks = [[_chunk("a", i, 3 << 20) for i in range(4)], [_chunk("b", i, 1 << 20) for i in range(2)]]
    fds = _fds()
    with pytest.raises(OSError, match="No space left"):
        write_distcp_files(tmp_path, ["__0_0.distcp", "__1_0.distcp"], chunks, _fill, 3, lambda n: None,
                           4 << 20, [[], []], 4 << 20)
    assert _fds() == fds


def _chunk(key: str, i: int, nbytes: int) -> OutChunk:
    n = nbytes // 4
    return OutChunk(key, (i * n,), (n,), FP32, "p" if i % 3 != 2 else None, "param", ((i * n,), (n,)))


def _fill(c: OutChunk) -> np.ndarray | Zeros:
    if c.param is None:  # every third chunk: known zeros
        return Zeros(c.nbytes)
    rng = np.random.default_rng(c.offsets[0] + len(c.key))
    return rng.standard_normal(c.sizes[0]).astype(np.float32)


@pytest.mark.parametrize("run_bytes", [1, 5 << 20, 1 << 40])
@pytest.mark.parametrize("threads", [1, 3])
def test_files_written_as_runs_equal_one_thread_per_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         run_bytes: int, threads: int) -> None:
    ids = iter(range(10**6))
    monkeypatch.setattr(torch_blob, "new_serialization_id", lambda: f"{next(ids):040d}")
    sizes = [3 << 20, (1 << 20) + 4, 4100, (2 << 20) + 8]
    files = [[_chunk("w", i, sizes[i % 4]) for i in range(9)], [_chunk("opt", i, 1 << 20) for i in range(3)], []]
    names = [f"__{i}_0.distcp" for i in range(len(files))]
    (tmp_path / "one").mkdir()
    (tmp_path / "runs").mkdir()
    want_records: list[list[object]] = [[] for _ in files]
    want = [write_distcp(tmp_path / "one" / n, f, _fill, lambda n: None, 4 << 20, want_records[i])
            for i, (n, f) in enumerate(zip(names, files))]
    ids = iter(range(10**6))
    live, most = [0], [0]
    real_fill = _fill

    def counted(c: OutChunk) -> np.ndarray | Zeros:  # chunks held at once: one per thread at most
        live[0] += 1
        most[0] = max(most[0], live[0])
        try:
            return real_fill(c)
        finally:
            live[0] -= 1

    records: list[list[object]] = [[] for _ in files]
    ticks: list[int] = []
    got = write_distcp_files(tmp_path / "runs", names, files, counted, threads, ticks.append, 4 << 20, records,
                             run_bytes)
    for n in names:
        assert (tmp_path / "runs" / n).read_bytes() == (tmp_path / "one" / n).read_bytes(), n
    assert [g[0] for g in got] == [w[0] for w in want]
    assert [[(c.key, c.offsets, off, ln) for c, off, ln in g[1]] for g in got] == \
        [[(c.key, c.offsets, off, ln) for c, off, ln in w[1]] for w in want]
    assert records == want_records
    assert sum(ticks) == sum(c.nbytes for f in files for c in f)
    assert most[0] <= threads
    if run_bytes == 1:
        runs = plan_runs(files, run_bytes)[2]  # the files were cut: several runs each, one for the empty file
        assert sum(r.file == 0 for r in runs) >= 6 and sum(r.file == 1 for r in runs) == 3
        assert [r for r in runs if r.file == 2] == [writers.Run(2, 0, 0, 0, 0)]



def test_each_runs_next_chunk_is_asked_for_before_the_current_is_filled(tmp_path: Path) -> None:
    """``ahead``: every chunk once, the first of a run before anything is filled, each next one before the
    current one's fill (a read-ahead one chunk deep per thread)."""
    files = [[_chunk("w", i, 1 << 20) for i in range(7)], [_chunk("opt", i, 1 << 20) for i in range(2)]]
    events: list[tuple[str, str, tuple[int, ...]]] = []
    lock = threading.Lock()

    def ahead(c: OutChunk) -> None:
        with lock:
            events.append(("ahead", c.key, c.offsets))

    def fill(c: OutChunk) -> np.ndarray | Zeros:
        with lock:
            events.append(("fill", c.key, c.offsets))
        return _fill(c)

    write_distcp_files(tmp_path, ["a", "b"], files, fill, 1, lambda n: None, 4 << 20, [[], []], 3 << 20, ahead)
    asked = [e[1:] for e in events if e[0] == "ahead"]
    assert sorted(asked) == sorted((c.key, c.offsets) for f in files for c in f)
    for k, e in enumerate(events):
        if e[0] == "fill":
            assert ("ahead", *e[1:]) in events[:k]
    runs = plan_runs(files, 3 << 20)[2]
    for r in runs:  # the run's second chunk is asked for before its first is filled
        if r.last - r.first > 1:
            first, second = files[r.file][r.first], files[r.file][r.first + 1]
            assert events.index(("ahead", second.key, second.offsets)) < \
                events.index(("fill", first.key, first.offsets))
