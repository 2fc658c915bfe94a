"""A CRC noted by the read ledger for a buffer (``hashing.remember``) is taken by the writer only for exactly that
memory, under the same algorithm, once, on the same thread, and never after :func:`hashing.forget`; a sink that
takes it writes the same file entry as one that hashes the bytes again; a copy forgets before each chunk."""

from __future__ import annotations

import threading
from pathlib import Path

import google_crc32c
import numpy as np

from gtp_format.hashing import CRCS, KNOWN_MIN, forget, recall, remember
from gtp_format.writer.sink import Sink


def _buf(n: int = KNOWN_MIN, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def test_a_note_is_taken_for_exactly_its_memory_once() -> None:
    a = _buf(2 * KNOWN_MIN)
    value = CRCS["crc32c"].update(a, 0)
    remember("crc32c", a, value)
    assert recall("crc32", a) is None  # another algorithm
    assert recall("crc32c", a[1:]) is None  # another start
    assert recall("crc32c", a[:-1]) is None  # another length
    assert recall("crc32c", memoryview(a)) == value  # the same memory, any kind of buffer
    assert recall("crc32c", a) is None  # taken once


def test_forget_small_buffers_and_other_threads() -> None:
    a = _buf()
    remember("crc32c", a, 1)
    forget()
    assert recall("crc32c", a) is None
    small = _buf(KNOWN_MIN - 1)
    remember("crc32c", small, 1)
    assert recall("crc32c", small) is None  # too small to be worth a combine: never noted
    remember("crc32c", a, 1)
    seen: list[int | None] = []
    t = threading.Thread(target=lambda: seen.append(recall("crc32c", a)))
    t.start()
    t.join()
    assert seen == [None]  # another thread's note is not this one's
    forget()


def test_a_sink_that_takes_a_known_crc_writes_the_same_entry(tmp_path: Path) -> None:
    head, body, tail = b"head" * 100, _buf(3 * KNOWN_MIN + 7, 1), b"tail"
    want = google_crc32c.value(head + body.tobytes() + tail)
    entries = []
    for k, note in enumerate((False, True)):
        with Sink(tmp_path / f"f{k}", 1 << 22, direct=False, segments=True) as out:
            out.write([head])
            if note:
                remember("crc32c", body, CRCS["crc32c"].update(body, 0))
            out.write([body])
            assert recall("crc32c", body) is None  # taken by the write
            out.write([tail])
            entries.append((out.close(), out.segments))
    assert entries[0] == entries[1]
    assert entries[1][0].checksums == {"crc32c": f"{want:08x}"}


def test_a_wrong_note_would_show_so_the_copy_forgets_before_each_chunk(tmp_path: Path) -> None:
    """What forgetting guards against: a note left for a buffer whose bytes changed is trusted by the sink (the
    entry is then wrong), so ``chunk_data`` drops the note before it fills a chunk."""
    from ckpt_tool.copying import engine

    body = _buf(KNOWN_MIN, 2)
    remember("crc32c", body, 0xDEADBEEF)
    with Sink(tmp_path / "stale", 1 << 22, direct=False) as out:
        out.write([body])
        stale = out.close()
    assert stale.checksums != {"crc32c": f"{google_crc32c.value(body.tobytes()):08x}"}
    remember("crc32c", body, 0xDEADBEEF)
    src = type("S", (), {})()
    chunk = type("C", (), {"values": [1, 2], "copy": False, "param": None})()
    engine.chunk_data(src, chunk)  # type: ignore[arg-type]
    assert recall("crc32c", body) is None
