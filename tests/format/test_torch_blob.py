"""``gtp_format.writer.torch_blob`` writes what ``torch.save`` writes for one tensor, byte for byte.

The only free part of torch's archive is its random ``.data/serialization_id``; each case takes
torch's id, so the whole blob must be equal. Our own reader and ``torch.load(weights_only=True)``
read the result back.
"""

from __future__ import annotations

import io
import zipfile

import numpy as np
import pytest
import torch

from gtp_format.dtypes import by_name
from gtp_format.reader.blob import parse_blob
from gtp_format.reader.zip_blob import ViewReader
from gtp_format.writer.torch_blob import TensorBlob, data_pkl, new_serialization_id, tensor_blob

CASES = [
    ("float32", (2, 5)), ("float32", (1000, 300)), ("bfloat16", ()), ("float16", (1, 1)), ("int64", (7,)),
    ("bool", (70000,)), ("float8_e4m3fn", (3, 4, 5, 6)), ("uint16", (5,)), ("int8", (300, 70000)),
    ("float64", (2, 3, 4)), ("int32", (1 << 17,)),
]


def _tensor(dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    n = int(np.prod(shape)) if shape else 1
    bits = np.random.default_rng(n).integers(0, 256, n * by_name(dtype).itemsize, dtype=np.uint8)
    if dtype == "bool":
        bits &= 1
    return torch.from_numpy(bits).view(getattr(torch, dtype)).reshape(shape)


@pytest.mark.parametrize(("dtype", "shape"), CASES, ids=[f"{d}{list(s)}" for d, s in CASES])
def test_blob_equals_torch_save(dtype: str, shape: tuple[int, ...]) -> None:
    t = _tensor(dtype, shape)
    buf = io.BytesIO()
    torch.save(t, buf)
    theirs = buf.getvalue()
    sid = zipfile.ZipFile(io.BytesIO(theirs)).read("archive/.data/serialization_id").decode()
    data = t.reshape(-1).view(torch.uint8).numpy()
    ours = tensor_blob(by_name(dtype), shape, data, sid)
    assert ours == theirs
    back = torch.load(io.BytesIO(tensor_blob(by_name(dtype), shape, data)), weights_only=True)
    assert back.dtype == t.dtype and back.shape == t.shape
    assert back.reshape(-1).view(torch.uint8).numpy().tobytes() == data.tobytes()
    layout = parse_blob(ViewReader(memoryview(ours)))
    assert layout.dtype is by_name(dtype) and tuple(layout.size) == shape and layout.payload_offset % 64 == 0


def test_head_tail_around_streamed_data() -> None:
    """The streamed form (head, data, tail) is the whole blob; the data starts 64-byte aligned."""
    data = np.arange(12, dtype=np.float32)
    blob = TensorBlob(by_name("float32"), (3, 4), "7" * 40)
    import zlib
    streamed = blob.head + data.tobytes() + blob.tail(zlib.crc32(data.tobytes()))
    assert streamed == tensor_blob(by_name("float32"), (3, 4), data, "7" * 40)
    assert len(blob.head) % 64 == 0 and blob.nbytes == 48


def test_data_pkl_and_ids() -> None:
    assert data_pkl(by_name("float32"), (2, 5)).startswith(b"\x80\x02ctorch._utils\n_rebuild_tensor_v2\n")
    a, b = new_serialization_id(), new_serialization_id()
    assert len(a) == 40 and a.isdigit() and a != b
    with pytest.raises(ValueError, match="empty tensor"):
        TensorBlob(by_name("float32"), (0, 3))
