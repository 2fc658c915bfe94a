"""The streamed ``torch.save`` file (:mod:`gtp_format.writer.torch_file`) against torch itself.

What could fail: the pickle (a dict of tensors: memo indices past 255, SETITEMS batches past 1000
items, untyped storages for dtypes without a legacy class, scalars and empty tensors), the zip
(alignment, CRC-32 of data given in pieces, zip64 fields) and the order (records written in another
order than the dict's keys). Each file is read back by ``torch.load(weights_only=True)`` and by
Python's ``zipfile``, whose ``testzip`` checks every record's CRC-32.
"""

from __future__ import annotations

import io
import random
import zipfile
import zlib
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gtp_format.dtypes import from_torch
from gtp_format.writer.torch_file import TorchStateFile

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.int8,
          torch.uint8, torch.bool, torch.uint16, torch.float8_e4m3fn, torch.complex64]
SHAPES = st.lists(st.integers(0, 5), max_size=3).map(tuple)


def _tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size(),),
                        dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)


def _write(state: dict[str, torch.Tensor], order: list[int], pieces: int, zip64: bool = False,
           hashed: bool = False) -> bytes:
    """``hashed``: each piece comes with its CRC-32 (export's reader threads), which the file combines."""
    out = io.BytesIO()
    items = list(state.items())
    spec = [(k, from_torch(t.dtype), tuple(t.shape)) for k, t in items]
    w = TorchStateFile(lambda parts: [out.write(bytes(p)) for p in parts], spec, order, zip64=zip64)
    w.begin()
    for i in order:
        assert w.start() == items[i][0]
        raw = items[i][1].contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        step = max(1, len(raw) // pieces)
        for at in range(0, len(raw), step):
            piece = raw[at:at + step]
            w.data([piece], zlib.crc32(piece) if hashed else None)
        w.end()
    w.finish()
    return out.getvalue()


def _check(blob: bytes, state: dict[str, torch.Tensor], tmp: Path) -> None:
    with zipfile.ZipFile(io.BytesIO(blob)) as z:
        assert z.testzip() is None  # every CRC-32
    path = tmp / f"f{random.random()}.pt"
    path.write_bytes(blob)
    got = torch.load(path, weights_only=True)
    assert list(got) == list(state)
    for k, t in state.items():
        assert got[k].dtype == t.dtype and got[k].shape == t.shape, k
        assert torch.equal(got[k].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), k


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(specs=st.lists(st.tuples(st.sampled_from(DTYPES), SHAPES), min_size=0, max_size=8),
       seed=st.integers(0, 1 << 16), pieces=st.integers(1, 4), zip64=st.booleans(), hashed=st.booleans())
def test_any_state_loads_back_bit_for_bit(tmp_path: Path, specs: list, seed: int, pieces: int, zip64: bool,
                                          hashed: bool) -> None:
    state = {f"k{i}.{d}": _tensor(d, s, seed + i) for i, (d, s) in enumerate(specs)}
    order = list(range(len(state)))
    random.Random(seed).shuffle(order)
    blob = _write(state, order, pieces, zip64, hashed)
    _check(blob, state, tmp_path)
    if hashed:  # the CRC-32s combined from the pieces' own are the ones hashing the bytes gives
        assert blob == _write(state, order, pieces, zip64)


def test_many_keys_cross_the_memo_and_batch_limits(tmp_path: Path) -> None:
    state = {f"layer.{i}": torch.tensor(float(i)) for i in range(1203)}  # memo past 255, 2 SETITEMS batches
    state["w"] = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    _check(_write(state, list(range(len(state)))[::-1], 1), state, tmp_path)


def test_a_record_given_the_wrong_length_is_refused() -> None:
    w = TorchStateFile(lambda parts: None, [("a", from_torch(torch.float32), (2,))], [0])
    w.begin()
    w.start()
    with pytest.raises(ValueError, match="needs 8 more"):
        w.data([b"x" * 9])
    w.data([b"x" * 4])
    with pytest.raises(ValueError, match="4 bytes short"):
        w.end()
    with pytest.raises(ValueError, match="every tensor"):
        TorchStateFile(lambda parts: None, [("a", from_torch(torch.float32), (2,))], [0, 0])
