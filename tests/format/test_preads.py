"""Range reads into a caller's buffer (the runtime's loads): ``O_DIRECT`` for large ranges, the cache
path otherwise or where refused, and the buffer asked for only after the range is checked.

Brute force: every read is compared with the file's bytes sliced in Python.
"""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gtp_format.errors import ChunkError
from gtp_format.reader import preads
from gtp_format.reader.storage import read_range

MIB = 1 << 20
SIZE = 3 * MIB + 777  # not a multiple of the alignment: the aligned range runs past the end of the file


class Buffers:
    """A buffer provider like the runtime's pool: each buffer placed at a chosen misalignment inside a
    larger bytearray, and every size asked for recorded."""

    def __init__(self, shift: int = 0) -> None:
        self.shift, self.asked = shift, []

    def __call__(self, n: int) -> memoryview:
        self.asked.append(n)
        return memoryview(bytearray(n + self.shift))[self.shift:]


@pytest.fixture(scope="module")
def data_file(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, bytes]:
    root = tmp_path_factory.mktemp("preads")
    body = os.urandom(SIZE)
    (root / "d.bin").write_bytes(body)
    return root, body


def _direct_works(root: Path) -> bool:
    fd = os.open(root / "d.bin", os.O_RDONLY)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_DIRECT)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(offset=st.integers(0, SIZE), length=st.integers(0, SIZE), shift=st.sampled_from([0, 1, 16, 4095, 4096, 5000]))
def test_a_range_into_a_buffer_is_the_files_bytes(data_file: tuple[Path, bytes], offset: int, length: int,
                                                   shift: int):
    root, body = data_file
    length = min(length, SIZE - offset)
    got = read_range(root, "d.bin", offset, length, Buffers(shift))
    assert bytes(got) == body[offset:offset + length]
    assert bytes(read_range(root, "d.bin", offset, length)) == body[offset:offset + length]


def test_large_ranges_take_the_direct_path_where_the_file_system_allows_it(data_file, monkeypatch):
    root, body = data_file
    if not _direct_works(root):
        pytest.skip("this file system refuses O_DIRECT; the fallback is tested below")
    seen: list[int] = []
    real = preads.read_fully

    def spy(fd: int, buf, offset: int) -> int:
        seen.append(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)
        return real(fd, buf, offset)

    monkeypatch.setattr(preads, "read_fully", spy)
    monkeypatch.setattr("gtp_format.storage.local.read_fully", spy)
    assert bytes(read_range(root, "d.bin", 4097, 2 * MIB + 3, Buffers(7))) == body[4097:4097 + 2 * MIB + 3]
    assert read_range(root, "d.bin", 5, 1000, Buffers()) and seen == [os.O_DIRECT, 0]  # small: the cache


def test_a_refused_direct_read_falls_back_to_the_cache(data_file, monkeypatch):
    root, body = data_file
    real = fcntl.fcntl

    def refuse(fd, cmd, arg=0):
        if cmd == fcntl.F_SETFL and arg & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, cmd, arg)

    monkeypatch.setattr(fcntl, "fcntl", refuse)
    assert bytes(read_range(root, "d.bin", 3, 2 * MIB, Buffers(1))) == body[3:3 + 2 * MIB]


def test_a_read_refused_after_fcntl_accepted_falls_back(data_file, monkeypatch):
    root, body = data_file
    real = preads.read_fully
    calls = []

    def einval_once(fd: int, buf, offset: int) -> int:
        calls.append(offset)
        if len(calls) == 1:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, buf, offset)

    monkeypatch.setattr(preads, "read_fully", einval_once)
    got = read_range(root, "d.bin", 10, 2 * MIB, Buffers())
    if _direct_works(root):
        assert bytes(got) == body[10:10 + 2 * MIB]


@pytest.mark.parametrize("offset,length", [(SIZE - 10, 2 * MIB), (0, SIZE + 1), (-1, 5)])
def test_a_bad_range_never_asks_for_a_buffer(data_file, offset: int, length: int):
    root, _ = data_file
    buffers = Buffers()
    with pytest.raises(ChunkError):
        read_range(root, "d.bin", offset, length, buffers)
    assert buffers.asked == []


def test_a_sparse_file_never_sizes_a_buffer(tmp_path: Path):
    with open(tmp_path / "s.bin", "wb") as f:
        f.truncate(1 << 40)  # 1 TiB of nothing stored
    buffers = Buffers()
    with pytest.raises(ChunkError, match="s.bin"):
        read_range(tmp_path, "s.bin", 0, 1 << 39, buffers)
    assert buffers.asked == []


def test_the_buffer_asked_for_is_the_range_and_a_little_alignment(data_file):
    root, _ = data_file
    buffers = Buffers()
    read_range(root, "d.bin", 4095, 2 * MIB, buffers)
    assert buffers.asked and max(buffers.asked) <= 2 * MIB + 3 * preads.ALIGN
