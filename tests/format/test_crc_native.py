"""The CRC-32C that releases the GIL (``hashing._NATIVE``, google_crc32c's C function through ctypes)
gives google_crc32c's own values, and lets another Python thread run while it hashes."""

from __future__ import annotations

import threading
import time

import google_crc32c
import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from gtp_format import hashing
from gtp_format.hashing import CRCS


def test_the_native_function_is_found() -> None:
    assert hashing._NATIVE is not None


@given(st.binary(max_size=1 << 14), st.integers(0, 2**32 - 1), st.integers(0, 15))
def test_every_buffer_kind_gives_google_crc32c_value(data: bytes, start: int, skip: int) -> None:
    want = google_crc32c.extend(start, data[skip:])
    arr = np.frombuffer(data, dtype=np.uint8)[skip:]  # unaligned starts too
    for buf in (data[skip:], arr, memoryview(bytearray(data))[skip:], bytearray(data[skip:])):
        assert CRCS["crc32c"].update(buf, start) == want


def test_the_native_crc_leaves_the_interpreter_to_other_threads() -> None:
    """A pure-Python counter runs during a 256 MiB hash through ctypes; through the extension on a
    numpy buffer it would not (that is the GIL this avoids). Compared, not timed: the counter's
    progress during the native hash must exceed what it made during the extension's hash of the same
    buffer, and the hash must take long enough for the comparison to mean something."""
    arr = np.frombuffer(np.random.default_rng(0).bytes(256 << 20), dtype=np.uint8)
    count, stop = [0], [False]

    def spin() -> None:
        while not stop[0]:
            count[0] += 1

    t = threading.Thread(target=spin, daemon=True)
    t.start()
    try:
        def progress(fn: object) -> float:
            c0, t0 = count[0], time.perf_counter()
            fn()  # type: ignore[operator]
            return (count[0] - c0) / (time.perf_counter() - t0)

        held = progress(lambda: google_crc32c.extend(0, arr))
        free = 0.0
        for _ in range(10):  # a loaded machine may give the counter no core for one hash: retry
            free = max(free, progress(lambda: CRCS["crc32c"].update(arr, 0)))
            if free > 2 * held:
                break
    finally:
        stop[0] = True
        t.join()
    assert free > 2 * held
