"""The torch-free decoder of small torch.save-d objects (Megatron's per_bucket_numel), against torch.save."""

from __future__ import annotations

import argparse
import collections
import io
import os
import pickle
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gtp_format.dtypes import DTYPES
from gtp_format.reader.object_blob import ObjectPickle, load_plain_object
from gtp_format.reader.zip_blob import BlobError, ViewReader


def _saved(obj: object) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _load(blob: bytes) -> object:
    return load_plain_object(ViewReader(memoryview(blob)))


def test_megatron_per_bucket_numel():
    obj = [[{(torch.bfloat16, torch.float32): [4096, 128]}, {(torch.float32, torch.float32): [7]}]]
    assert _load(_saved(obj)) == [[{(DTYPES["bfloat16"], DTYPES["float32"]): [4096, 128]},
                                   {(DTYPES["float32"], DTYPES["float32"]): [7]}]]


def test_one_bytesio_wrapper_is_undone_but_not_two():
    inner = _saved([{"a": 1}])
    assert _load(_saved(io.BytesIO(inner))) == [{"a": 1}]
    with pytest.raises(BlobError, match="more than twice"):
        _load(_saved(io.BytesIO(_saved(io.BytesIO(inner)))))


_plain = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.tuples(inner, inner)
    | st.dictionaries(st.text(max_size=8) | st.integers(), inner, max_size=4),
    max_leaves=25,
)


@settings(max_examples=150, deadline=None)
@given(obj=_plain)
def test_plain_objects_round_trip(obj):
    assert _load(_saved(obj)) == obj


def test_ordered_dict_and_sets():
    obj = {"od": collections.OrderedDict([("x", 1), ("y", [2])]), "s": {1, 2}, "f": frozenset({"a"})}
    assert _load(_saved(obj)) == obj


class _Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_hostile_object_runs_nothing(tmp_path: Path):
    marker = tmp_path / "pwned"
    with pytest.raises(BlobError, match=r"posix\.system.*nothing was run"):
        _load(_saved([1, _Evil(marker)]))
    assert not marker.exists()


@pytest.mark.parametrize(("obj", "needle"), [
    ({"t": torch.zeros(2)}, "references torch._utils._rebuild_tensor_v2"),
    (torch.nn.Linear(1, 1).state_dict(), "references collections.OrderedDict|_rebuild"),
    (argparse.Namespace(a=1), "argparse.Namespace"),
])
def test_objects_beyond_plain_data_are_refused(obj, needle):
    with pytest.raises(BlobError, match=needle):
        _load(_saved(obj))


def test_bytes_decoding_is_only_latin1():
    # protocol 2 pickles bytes as _codecs.encode(text, "latin1"); another codec is not what torch.save writes
    data = bytearray(_saved(b"\xff\x00"))
    i = data.find(b"latin1")
    data[i:i + 6] = b"utf_16"
    with pytest.raises(BlobError):  # the zip CRC or the codec check: either way one BlobError
        _load(bytes(data))


def test_bytes_constructor_cannot_allocate():
    evil = b"\x80\x02c__builtin__\nbytes\nJ\x00\x00\x00\x40\x85R."  # bytes(2**30): a 1 GiB allocation
    with pytest.raises(pickle.UnpicklingError, match="only allowed without arguments"):
        ObjectPickle(evil, "data.pkl").load()
