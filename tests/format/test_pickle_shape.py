"""Nesting depth and container count are bounded before the C unpickler builds anything."""

from __future__ import annotations

import pickle

import pytest

from gtp_format.errors import FormatError
from gtp_format.reader.pickle_scan import PickleScanError
from gtp_format.reader.pickle_shape import MAX_DEPTH, check_shape
from gtp_format.reader.safe_pickle import load_metadata_pickle


def _nested(n: int) -> tuple:
    x: tuple = ()
    for _ in range(n):
        x = (x,)
    return x


@pytest.mark.parametrize("proto", range(6))
def test_genuine_shapes_pass(proto):
    for obj in [_nested(MAX_DEPTH - 2), {_nested(10): 1}, [[[[1]]]], {"a": {"b": [1, (2, 3)]}}, {1, 2},
                frozenset([3]), list(range(1000))]:
        check_shape(pickle.dumps(obj, protocol=proto))


@pytest.mark.parametrize("proto", range(6))
def test_deep_nesting_refused(proto):
    with pytest.raises(PickleScanError, match="nested"):
        check_shape(pickle.dumps({_nested(MAX_DEPTH + 5): 1}, protocol=proto))


def test_deep_tuple_key_is_one_line_error_not_a_segfault():
    # a dict key a million tuples deep: hashing it recursed in C and killed the process
    data = b"\x80\x04}" + b")" + b"\x85" * 10**6 + b"Ns."
    with pytest.raises(FormatError, match="nested"):
        load_metadata_pickle(data, "x/.metadata")


def test_append_chain_depth_refused():
    data = b"\x80\x04" + b"]" * 40 + b"a" * 39 + b"."
    with pytest.raises(PickleScanError):
        check_shape(data, max_containers=10**6)


def test_empty_container_flood_refused():
    with pytest.raises(PickleScanError, match="containers"):
        check_shape(b"\x80\x04" + b"]" * 100_000 + b".")


def test_stack_underflow_is_a_scan_error():
    with pytest.raises(PickleScanError, match="stack"):
        check_shape(b"\x80\x04a.")


def test_fixture_metadata_passes(fixtures_dir=None):
    from pathlib import Path

    files = sorted(Path(__file__).resolve().parents[2].glob("fixtures/*/*/iter_*/.metadata"))
    assert files
    for f in files:
        check_shape(f.read_bytes())


@pytest.mark.parametrize("data", [
    b"\x80\x04ctorch\nfloat32\n}\x8c\x08itemsizeK\x07sb.",  # GLOBAL then BUILD with a dict state
    b"\x80\x04\x8c\x05torch\x8c\x07float32\x93N}\x8c\x08itemsizeK\x07s\x86b.",  # STACK_GLOBAL, slot state
    b"\x80\x04ctorch\nfloat32\n\x94N0h\x00}\x8c\x08itemsizeK\x07sb.",  # a memo copy of the global
    b"\x80\x04ctorch\nSize\n}\x8c\x0c__defaults__K\x07\x85sb.",  # a helper function's defaults
])
def test_build_on_allow_listed_global_refused(data):
    from gtp_format.dtypes import DTYPES

    with pytest.raises(FormatError, match="global"):
        load_metadata_pickle(data, "x/.metadata")
    assert DTYPES["float32"].itemsize == 4


def test_build_on_fresh_instances_still_allowed():
    from gtp_format.reader.safe_pickle import MetadataRecord

    data = (b"\x80\x04ctorch.distributed.checkpoint.metadata\nMetadata\n)\x81}\x8c\x07versionX\x01\x00\x00\x001sb.")
    md = load_metadata_pickle(data, "x/.metadata")
    assert type(md) is MetadataRecord and md.get("version") == "1"
