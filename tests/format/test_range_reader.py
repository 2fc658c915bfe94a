""":class:`gtp_format.reader.zip_blob.RangeReader`'s windows: the same bytes as the file holds, for any ranges in any
order (against slicing the file), a range the file no longer holds refused, never a read outside the blob, and a
``torch.save`` blob's structure parsed in a few system calls instead of one per field."""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gtp_format.reader import zip_blob
from gtp_format.reader.zip_blob import BlobError, RangeReader, zip_records


@settings(max_examples=200, deadline=None)
@given(data=st.binary(min_size=1, max_size=12000), before=st.integers(0, 300), after=st.integers(0, 300),
       cut=st.integers(0, 13000), ranges=st.lists(st.tuples(st.integers(0, 12000), st.integers(0, 6000)), max_size=12))
def test_windows_give_the_file_s_bytes_or_refuse(tmp_path_factory, data, before, after, cut, ranges):
    raw = os.urandom(before) + data + os.urandom(after)
    path = tmp_path_factory.mktemp("r") / "f"
    kept = raw[:min(len(raw), cut)] if cut < len(raw) else raw  # a file cut anywhere, or whole
    path.write_bytes(kept)
    seen: list[tuple[int, int]] = []
    real = zip_blob.pread

    def spy(fd, n, offset):
        seen.append((offset, offset + n))
        return real(fd, n, offset)

    fd = os.open(path, os.O_RDONLY)
    try:
        zip_blob.pread = spy
        r = RangeReader(fd, before, len(data))
        for a, n in ranges:
            a, b = min(a, len(data)), min(len(data), min(a, len(data)) + n)
            want = kept[before + a:before + b]
            if len(want) == b - a:
                assert bytes(r.get(a, b)) == want
            else:
                with pytest.raises(BlobError, match="ends inside the blob"):
                    r.get(a, b)
    finally:
        zip_blob.pread = real
        os.close(fd)
    assert all(before <= lo and hi <= before + len(data) for lo, hi in seen)  # never outside the blob


def test_a_blob_s_structure_takes_a_few_reads(tmp_path: Path, monkeypatch):
    buf = io.BytesIO()
    torch.save(torch.arange(4096, dtype=torch.float32), buf)
    blob = buf.getvalue()
    path = tmp_path / "f"
    path.write_bytes(b"x" * 100 + blob)
    calls = []
    real = zip_blob.pread
    monkeypatch.setattr(zip_blob, "pread", lambda fd, n, off: calls.append(n) or real(fd, n, off))
    fd = os.open(path, os.O_RDONLY)
    try:
        records = zip_records(RangeReader(fd, 100, len(blob)))
    finally:
        os.close(fd)
    assert any(name.endswith("data.pkl") for name in records)
    assert len(calls) <= 3, calls  # one pread per field before: 20-35 per blob
