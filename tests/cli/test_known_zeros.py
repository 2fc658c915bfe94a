"""Chunks written as known zeros (a fresh optimizer's Adam moments) against the same zeros as an array.

* ``Crc.zeros`` is the CRC of that many zero bytes continued from any value, for CRC-32 and CRC-32C
  (lengths across the operator's powers of two, 0 included), on several threads at once (its operator
  table is built once and never seen half-filled);
* ``Sink.write_zeros`` between any other writes, direct or buffered, any staging size, with or without
  segments: the file, its CRC-32C and every segment hash are those of ``write([bytes(n)])``;
* ``zero_stats`` is what :class:`StatsStream` computes from all-zero elements, for every dtype with
  statistics, empty included;
* ``write_distcp`` given :class:`Zeros` writes the same file and the same records as given the zeros' array;
* a full disk while zeros are written propagates and closes the file, as for other bytes.
"""

from __future__ import annotations

import errno
import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import google_crc32c
import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckpt_tool.copying.plan import OutChunk
from ckpt_tool.copying.writers import Zeros, write_distcp
from gtp_format import hashing
from gtp_format.dtypes import by_name
from gtp_format.hashing import CRCS
from gtp_format.integrity.stats import element_stats, has_stats, zero_stats
from gtp_format.scan import carrier
from gtp_format.writer import sink as sink_mod
from gtp_format.writer import torch_blob
from gtp_format.writer.sink import ALIGN, Sink

LENGTHS = [0, 1, 3, 255, 4096, 65537, (1 << 20) + 5, 3 << 20]


@pytest.mark.parametrize("name", ["crc32", "crc32c"])
def test_crc_of_zeros_is_the_crc_of_the_bytes(name: str) -> None:
    crc = CRCS[name]
    for start in (0, crc.update(b"abc", 0), 0xFFFFFFFF):
        for n in LENGTHS:
            assert crc.zeros(start, n) == crc.update(bytes(n), start), (start, n)
    assert CRCS["crc32"].zeros(0, 12345) == zlib.crc32(bytes(12345))
    assert CRCS["crc32c"].zeros(0, 12345) == google_crc32c.value(bytes(12345))


def test_the_operator_table_is_whole_for_every_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """Threads that build the table at once (a fresh process's first moments on every file thread) each see
    it whole: one once read another's half-filled table and failed with an IndexError."""
    monkeypatch.setattr(hashing, "_POW2_SHIFTS", {})
    n = (1 << 40) + 3  # the operator's high powers, the last ones a builder appends
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda _: CRCS["crc32c"].zeros(0, n), range(32)))
    assert set(got) == {CRCS["crc32c"].zeros(0, n)}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.tuples(st.booleans(), st.integers(0, 3 * ALIGN + 17), st.booleans()), max_size=8),
       stage=st.sampled_from([1, ALIGN, 3 * ALIGN + 5]), direct=st.booleans(), segments=st.booleans(),
       piece=st.sampled_from([sink_mod.PIECE, 1000]))
def test_write_zeros_is_writing_the_zero_bytes(tmp_path: Path, ops: list[tuple[bool, int, bool]], stage: int,
                                               direct: bool, segments: bool, piece: int) -> None:
    """``(zeros?, n, cut after?)``: a run of ``n`` zeros or of ``n`` other bytes; both sinks get the same runs,
    one through ``write_zeros``, one through ``write``."""
    paths = [tmp_path / f"{name}{len(list(tmp_path.iterdir()))}" for name in ("z", "w")]
    saved_piece = sink_mod.PIECE
    sink_mod.PIECE = piece
    sink_mod._zero_piece.cache_clear()
    try:
        results = []
        for path, fast in zip(paths, (True, False)):
            with Sink(path, stage, direct=direct, segments=segments) as out:
                for i, (zeros, n, cut) in enumerate(ops):
                    if zeros and fast:
                        out.write_zeros(n)
                    else:
                        out.write([bytes(n) if zeros else bytes((i * 7 + k) % 251 for k in range(n))])
                    if cut:
                        out.cut()
                entry = out.close()
            results.append((path.read_bytes(), entry, dict(out.segments)))
    finally:
        sink_mod.PIECE = saved_piece
        sink_mod._zero_piece.cache_clear()
    assert results[0] == results[1]
    data, entry, segs = results[0]
    assert entry.checksums == {"crc32c": f"{google_crc32c.value(data):08x}"}
    assert all(xxhash.xxh3_128_hexdigest(data[a:b]) == h for (a, b), h in segs.items())


@pytest.mark.parametrize("name", ["float32", "float64", "float16", "bfloat16", "int64", "int8", "uint8", "bool"])
@pytest.mark.parametrize("numel", [0, 1, 1000, (1 << 20) + 3])
def test_zero_stats_are_the_statistics_of_zero_elements(name: str, numel: int) -> None:
    dt = by_name(name)
    assert has_stats(dt)
    assert zero_stats(dt, numel) == element_stats(np.zeros(numel, carrier(dt)), dt)


def test_no_statistics_for_a_dtype_without_them() -> None:
    dt = by_name("complex64")
    assert not has_stats(dt) and zero_stats(dt, 4) is None


def test_distcp_of_known_zeros_is_the_zeros_array(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch_blob, "new_serialization_id", lambda: "7" * 40)
    rng = np.random.default_rng(3)
    chunks = [OutChunk("w", (0, 0), (300, 7), by_name("bfloat16")),
              OutChunk("m", (0,), ((1 << 20) // 4 * 3 + 77,), by_name("float32")),
              OutChunk("v", (0, 0), (5, 3), by_name("bfloat16"))]
    weights = rng.integers(0, 1 << 16, size=(300, 7), dtype=np.uint16)

    def arrays(c: OutChunk) -> np.ndarray:
        return weights if c.key == "w" else np.zeros(c.sizes, carrier(c.dtype))

    def known(c: OutChunk) -> np.ndarray | Zeros:
        return weights if c.key == "w" else Zeros(c.nbytes)

    out = []
    for name, fill in (("a", arrays), ("z", known)):
        records: list = []
        path = tmp_path / f"{name}.distcp"
        entry, placed = write_distcp(path, chunks, fill, lambda n: None, 3 << 20, records)
        out.append((path.read_bytes(), entry, [(c.key, o, n) for c, o, n in placed],
                    [(r.key, r.offset, r.length, r.digest, r.stats) for r in records]))
    assert out[0] == out[1]
    assert out[1][3][1][4] == element_stats(np.zeros(chunks[1].sizes, np.float32), chunks[1].dtype)


def test_a_known_zeros_of_the_wrong_size_is_refused(tmp_path: Path) -> None:
    c = OutChunk("m", (0,), (4,), by_name("float32"))
    with pytest.raises(AssertionError, match="produced 12 bytes for 16"):
        write_distcp(tmp_path / "x.distcp", [c], lambda c: Zeros(12), lambda n: None)


def test_a_full_disk_while_writing_zeros_propagates_and_closes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                               ) -> None:
    """The fault case: zeros hit a full disk as written bytes do (the error, the file closed)."""
    def full(fd: int, data: memoryview, offset: int) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(sink_mod.os, "pwrite", full)
    monkeypatch.setattr(sink_mod.os, "writev", lambda fd, views: full(fd, views[0], 0))
    for direct in (True, False):
        out = Sink(tmp_path / f"f{direct}", ALIGN, direct=direct, segments=True)
        fd = out.fd
        with pytest.raises(OSError) as info:
            with out:
                out.write_zeros(3 * ALIGN + 5)
                out.close()
        assert info.value.errno == errno.ENOSPC
        assert out.fd == -1
        with pytest.raises(OSError):
            os.fstat(fd)
