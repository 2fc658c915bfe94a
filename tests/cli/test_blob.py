"""The zero-copy blob decoder and the one-read ``--data`` pass, against ``torch.load`` as reference."""

from __future__ import annotations

import io
import os
import pickle
import zipfile
from pathlib import Path

import pytest
import torch

from ckpt_tool import data_check
from ckpt_tool.errors import ChunkError
from ckpt_tool.model import TENSOR
from ckpt_tool.reader.blob import BlobError, ViewReader, parse_blob, tensor_view
from ckpt_tool.reader.checkpoint import open_checkpoint
from ckpt_tool.reader.chunks import chunk_bytes, load_chunk
from ckpt_tool.verify_core import verify

REPO = Path(__file__).parents[2]
FIXTURES = sorted(p.parent for p in REPO.glob("fixtures/*/*/iter_*/.metadata"))


def _saved(t: torch.Tensor) -> bytearray:
    buf = io.BytesIO()
    torch.save(t, buf)
    return bytearray(buf.getvalue())


def _decode(blob: bytearray) -> torch.Tensor:
    view = memoryview(blob)
    layout = parse_blob(ViewReader(view), len(view))
    return tensor_view(layout, view[layout.payload_offset:layout.payload_offset + layout.payload_bytes])


@pytest.mark.parametrize("make", [
    lambda: torch.arange(24, dtype=torch.float32).reshape(4, 6),
    lambda: torch.randn(7, 5).to(torch.bfloat16),
    lambda: torch.randn(3, 3).half(),
    lambda: torch.arange(10, dtype=torch.int64)[2:8],  # a view at a storage offset
    lambda: torch.arange(30, dtype=torch.float64).reshape(5, 6).t(),  # strided
    lambda: torch.tensor([True, False, True]),
    lambda: torch.tensor(3.5),
    lambda: torch.empty(0, 4),
    lambda: torch.randn(4, dtype=torch.complex64),
])
def test_decoder_matches_torch_load(make):
    t = make()
    blob = _saved(t)
    want = torch.load(io.BytesIO(bytes(blob)), weights_only=True)
    got = _decode(blob)
    assert got.dtype == want.dtype and got.shape == want.shape and got.stride() == want.stride()
    assert torch.equal(got, want)
    if got.numel():  # a view of the caller's buffer: no copy was made
        assert _address(blob) <= got.untyped_storage().data_ptr() < _address(blob) + len(blob)


def _address(buf: bytearray) -> int:
    return torch.frombuffer(buf, dtype=torch.uint8).data_ptr()


@pytest.mark.parametrize("run", FIXTURES, ids=[f"{p.parent.parent.name}/{p.parent.name}" for p in FIXTURES])
def test_every_fixture_chunk_decodes_as_torch_load_does(run: Path):
    ckpt = open_checkpoint(run)
    assert ckpt.encoding == "torch_save"
    n = 0
    for e in ckpt.entries.values():
        if e.kind != TENSOR:
            continue
        for c in e.chunks:
            want = torch.load(io.BytesIO(bytes(chunk_bytes(ckpt, e, c))), weights_only=True)
            got = load_chunk(ckpt, e, c)
            assert got.dtype == want.dtype and got.shape == want.shape
            assert torch.equal(got.nan_to_num(), want.nan_to_num()) and torch.equal(got.isnan(), want.isnan())
            n += 1
    assert n > 0


class _Evil:
    def __reduce__(self):
        return os.system, ("true",)


def _with_pickle(blob: bytearray, data: bytes) -> bytearray:
    src = zipfile.ZipFile(io.BytesIO(bytes(blob)))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            dst.writestr(info.filename, data if info.filename.endswith("data.pkl") else src.read(info))
    return bytearray(out.getvalue())


@pytest.mark.parametrize(("blob", "needle"), [
    (lambda: _with_pickle(_saved(torch.zeros(2)), pickle.dumps(_Evil(), protocol=2)), "posix.system"),
    (lambda: _with_pickle(_saved(torch.zeros(2)), pickle.dumps({"not": "a tensor"}, protocol=2)), "not a tensor"),
    (lambda: bytearray(b"PK\x03\x04 not really a zip"), "not a zip archive"),
    (lambda: _saved(torch.zeros(4))[:-30], "not a zip archive"),
])
def test_hostile_or_damaged_blobs_are_refused(blob, needle: str):
    with pytest.raises(BlobError, match=needle):
        _decode(blob())


def test_compressed_record_is_refused():
    src = zipfile.ZipFile(io.BytesIO(bytes(_saved(torch.zeros(1000)))))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info))
    with pytest.raises(BlobError, match="compressed"):
        _decode(bytearray(out.getvalue()))


def _verify_summary(run: Path) -> tuple:
    res = verify(open_checkpoint(run), data=True)
    return (sorted((p.severity, p.check, p.key, p.chunk, p.file, p.message) for p in res.problems),
            res.stats["nonfinite"], res.stats["bytes_read"])


@pytest.mark.parametrize("run", FIXTURES, ids=[f"{p.parent.parent.name}/{p.parent.name}" for p in FIXTURES])
def test_streaming_pass_gives_the_same_results_with_tiny_windows(run: Path, monkeypatch: pytest.MonkeyPatch):
    """Windows of 4 KiB make most chunks 'big' (parsed from their ends, scanned piece by piece)."""
    default = _verify_summary(run)
    monkeypatch.setattr(data_check, "WINDOW", 4096)
    assert _verify_summary(run) == default
    # and NaN/Inf counts equal those of decoding each chunk on its own
    ckpt = open_checkpoint(run)
    want = {}
    for e in ckpt.entries.values():
        if e.kind != TENSOR:
            continue
        nan = inf = 0
        for c in e.chunks:
            try:
                t = load_chunk(ckpt, e, c)
            except ChunkError:
                continue
            if t.is_floating_point():
                nan += int(t.isnan().sum())
                inf += int(t.isinf().sum())
        if nan or inf:
            want[e.key] = {"nan": nan, "inf": inf}
    assert default[1] == want


def test_nonfinite_counts_are_exact():
    t = torch.tensor([1.0, float("nan"), float("inf"), -float("inf"), 3.0e38, 3.0e38])
    assert data_check.count_nonfinite(t) == (1, 2)
    big = torch.full((8,), 3.0e38)  # the sum overflows although every element is finite
    assert data_check.count_nonfinite(big) == (0, 0)
    assert data_check.count_nonfinite(torch.full((4,), 60000.0).half()) == (0, 0)
    assert data_check.count_nonfinite(torch.tensor([1.0, float("nan")]).bfloat16()) == (1, 0)
    assert data_check.count_nonfinite(torch.arange(5)) == (0, 0)
