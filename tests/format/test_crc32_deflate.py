"""``hashing.crc32``: zlib's CRC-32 through zlib-ng (or libdeflate where the system has it and zlib-ng is not
installed), the same value as ``zlib.crc32`` for every buffer kind, start value, alignment and length, with either
library, and zlib's own answer (or error) for everything else."""

from __future__ import annotations

import os
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gtp_format import hashing
from gtp_format.hashing import CRCS, crc32

REPO = Path(__file__).resolve().parents[2]


BACKENDS = {"zlib-ng": hashing._zlib_ng_crc32(), "libdeflate": hashing._libdeflate_crc32()}


@pytest.fixture(params=sorted(BACKENDS))
def always_deflate(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each fast library that is here, alone, for every length."""
    fn = BACKENDS[request.param]
    if fn is None:
        pytest.skip(f"{request.param} is not on this system")
    monkeypatch.setattr(hashing, "_ZLIB_NG", fn if request.param == "zlib-ng" else None)
    monkeypatch.setattr(hashing, "_DEFLATE", fn if request.param == "libdeflate" else None)
    monkeypatch.setattr(hashing, "DEFLATE_MIN", 0)


def test_zlib_ng_is_installed_and_chosen() -> None:
    assert BACKENDS["zlib-ng"] is not None and hashing.crc32_backend() == "zlib-ng"  # a declared dependency


@given(st.binary(max_size=1 << 13), st.integers(0, 2**32 - 1), st.integers(0, 15))
def test_every_buffer_kind_gives_zlibs_value(data: bytes, start: int, skip: int) -> None:
    old = hashing.DEFLATE_MIN
    hashing.DEFLATE_MIN = 0  # every length through zlib-ng where it is there (hypothesis: no fixtures)
    try:
        want = zlib.crc32(data[skip:], start)
        arr = np.frombuffer(data, dtype=np.uint8)[skip:]  # unaligned starts too
        for buf in (data[skip:], arr, memoryview(bytearray(data))[skip:], bytearray(data[skip:])):
            assert crc32(buf, start) == want
            assert CRCS["crc32"].update(buf, start) == want
    finally:
        hashing.DEFLATE_MIN = old


def test_large_buffers_and_chained_pieces_give_zlibs_value(always_deflate: None) -> None:
    assert crc32(b"x" * 100, 7) == zlib.crc32(b"x" * 100, 7) and crc32(b"") == 0
    data = np.random.default_rng(1).bytes((3 << 20) + 5)
    assert crc32(data) == zlib.crc32(data)
    value = 0
    for lo in range(0, len(data), 512 << 10):  # how the data pass continues a window's CRC piece by piece
        value = crc32(memoryview(data)[lo:lo + (512 << 10)], value)
    assert value == zlib.crc32(data)
    floats = np.frombuffer(data[:1 << 20], dtype=np.float32)
    assert crc32(floats) == zlib.crc32(floats)  # a typed view: its bytes, as zlib reads them


def test_a_buffer_zlib_refuses_is_refused_the_same(always_deflate: None) -> None:
    strided = memoryview(bytearray(1 << 16))[::2]
    with pytest.raises(BufferError) as ours:
        crc32(strided)
    with pytest.raises(BufferError) as theirs:
        zlib.crc32(strided)
    assert str(ours.value) == str(theirs.value)
    with pytest.raises(TypeError):
        crc32("text")  # type: ignore[arg-type]


def test_the_switch_gives_zlib() -> None:
    code = "from gtp_format.hashing import crc32_backend; print(crc32_backend())"
    env = {**os.environ, "PYTHONPATH": str(REPO), hashing.CRC32_ZLIB_ENV: "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "zlib"
    env.pop(hashing.CRC32_ZLIB_ENV)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == hashing.crc32_backend()
