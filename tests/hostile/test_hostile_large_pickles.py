"""The hostile pickles again through the compiled pre-walk (gtp_format/reader/pickle_walk.py, which large
files go through), which must refuse to vouch for every one the Python walks refuse, so that the outcome
(the same one-line error) is what it is without it. Its size threshold is lowered to take them as they are;
two cases also run behind MIN_BYTES of harmless opcodes, at the real threshold."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from gtp_format.errors import FormatError
from gtp_format.reader import pickle_walk, unpickler
from gtp_format.reader.pickle_scan import PickleScanError, check_pickle
from gtp_format.reader.pickle_shape import check_shape
from gtp_format.reader.safe_pickle import load_metadata_pickle

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hostile_pickles import P, build_pickles  # noqa: E402

FILLER = b"N0" * (pickle_walk.MIN_BYTES // 2 + 16)  # push None, pop it: accepted by both walks, builds nothing


def _large(data: bytes) -> bytes:
    return P + FILLER + (data[len(P):] if data.startswith(P) else data)


def _outcome(data: bytes) -> str:
    try:
        return f"ok {type(load_metadata_pickle(data, 'ckpt/.metadata')).__name__}"
    except FormatError as e:
        return f"error {e.message}"


def _walks_accept(data: bytes) -> bool:
    try:
        check_pickle(data)
        check_shape(data)
    except PickleScanError:
        return False
    return True


def _same_outcome(name: str, data: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    vouched = pickle_walk.passes(data)
    if not _walks_accept(data):
        assert not vouched, f"{name}: the compiled walk accepted what the Python walks refuse"
    with_walk = _outcome(data)
    with monkeypatch.context() as m:
        m.setattr(unpickler, "passes", lambda d: False)  # the Python walks alone, as before
        assert _outcome(data) == with_walk, name


@pytest.mark.parametrize("name", sorted(build_pickles("/nonexistent/canary")))
def test_hostile_pickle_same_outcome(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pickle_walk, "MIN_BYTES", 0)
    data = build_pickles("/nonexistent/canary")[name][1]
    _same_outcome(name, data, monkeypatch)  # some are refused later, by the model's checks (dcp_reader)


@pytest.mark.parametrize("name", ["memo_bomb_long_binput", "build_on_dtype"])
def test_large_hostile_pickle_same_outcome(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    data = _large(build_pickles("/nonexistent/canary")[name][1])
    assert len(data) >= pickle_walk.MIN_BYTES
    _same_outcome(name, data, monkeypatch)
