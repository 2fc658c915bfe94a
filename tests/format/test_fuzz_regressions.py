"""Findings of benchmarks/fuzz_readers.py, each rebuilt from a genuine input (no binaries committed)."""

from __future__ import annotations

import io
import struct

import pytest
import torch

from gtp_format.reader.blob import parse_blob
from gtp_format.reader.zip_blob import BlobError, ViewReader, zip_records


def _blob() -> bytearray:
    buf = io.BytesIO()
    torch.save(torch.arange(8.0), buf)
    return bytearray(buf.getvalue())


def test_misplaced_record_message_is_one_line():
    """Fuzz finding (zip, seed 1): the central directory pointed a record at bytes whose local header
    carried a name with a newline and binary junk, and the message quoted that name raw."""
    raw = _blob()
    recs = zip_records(ViewReader(memoryview(bytes(raw))))
    first, last = min(recs.values(), key=lambda r: r.header_offset), max(recs.values(), key=lambda r: r.header_offset)
    name_at = first.header_offset + 30
    raw[name_at + 2] = ord("\n")  # the first record's local name now holds a newline
    at = raw.rindex(last.name.encode()) - 46  # the last record's central header
    struct.pack_into("<I", raw, at + 42, first.header_offset)
    with pytest.raises(BlobError) as info:
        parse_blob(ViewReader(memoryview(bytes(raw))))
    assert "\n" not in str(info.value) and "\\n" in str(info.value)
