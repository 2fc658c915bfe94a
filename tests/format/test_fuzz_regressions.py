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


def test_unknown_dp_group_kind_is_a_manifest_error(tmp_path):
    """Finding (issue 22, CLI fuzz of manifest layouts): ``buffers[i].dp_group_kind`` 'nope' parsed,
    then ``inspect --params`` reached ``Topology.groups`` and ended in the last-resort "unexpected
    KeyError" line. Now the parser names the field; the lenient read drops the section and the
    per-parameter view says why."""
    import json
    import shutil
    from pathlib import Path

    from gtp_format.errors import FormatError
    from gtp_format.manifest import ManifestError, parse_manifest
    from gtp_format.reader.checkpoint import open_checkpoint
    from gtp_format.views.ours import param_views

    src = Path(__file__).resolve().parents[2] / "fixtures/gtp/fold_cp2_g2_dp2/iter_0000002"
    folder = tmp_path / src.name
    shutil.copytree(src, folder)
    doc = json.loads((folder / "gtp_manifest.json").read_text())
    doc["buffers"][0]["dp_group_kind"] = "nope"
    (folder / "gtp_manifest.json").write_text(json.dumps(doc))
    with pytest.raises(ManifestError, match=r"buffers\[0\].dp_group_kind is 'nope', not a group kind"):
        parse_manifest(doc, "gtp_manifest.json", strict=True)
    ckpt = open_checkpoint(folder)
    assert ckpt.manifest.buffers is None
    with pytest.raises(FormatError, match="dp_group_kind is 'nope'"):
        param_views(ckpt.manifest)


def test_empty_sequence_inside_another_is_no_overlap(tmp_path):
    """Finding (issue 22, hypothesis against brute force in tests/runtime/test_data_bounds.py): the
    first overlap check compared each sequence's end with the next pointer, so an empty sequence
    at the pointer of a non-empty one (``[(0, 1), (0, 0)]``) was refused. Empty sequences hold no
    token; only the furthest end of the sequences before a non-empty one counts."""
    import numpy as np

    from gtp_runtime.data.indexed import INDEX_HEADER, read_index

    (tmp_path / "d.bin").write_bytes(bytes(64))
    head = INDEX_HEADER + struct.pack("<QBQQ", 1, 8, 3, 2)
    body = np.array([4, 0, 2], np.int32).tobytes() + np.array([0, 2, 8], np.int64).tobytes()
    (tmp_path / "d.idx").write_bytes(head + body + np.array([0, 3], np.int64).tobytes())
    assert read_index(tmp_path / "d").lengths.tolist() == [4, 0, 2]


@pytest.mark.parametrize("field,value", [("tp_mode", "diagonal"), ("shard_kind", "sideways")])
def test_unknown_tp_mode_or_shard_kind_is_a_manifest_error(field, value):
    """Finding (issue 22, the same CLI fuzz): an unknown ``tp_mode`` or ``shard_kind`` parsed and
    was read as TP-replicated / unsharded, so ``inspect --params`` printed a wrong view, exit 0."""
    import json
    from pathlib import Path

    from gtp_format.manifest import ManifestError, parse_manifest

    src = Path(__file__).resolve().parents[2] / "fixtures/gtp/fold_cp2_g2_dp2/iter_0000002/gtp_manifest.json"
    doc = json.loads(src.read_text())
    doc["buffers"][0]["buckets"][0]["params"][0][field] = value
    with pytest.raises(ManifestError, match=rf"buffers\[0\].buckets\[0\].params\[0\] has tp_mode .*{value}"):
        parse_manifest(doc, "gtp_manifest.json", strict=True)
