"""The zero-copy blob decoder and the one-read ``--data`` pass, against ``torch.load`` as reference."""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from damage import truncate_once_planned
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gtp_format.check import data as data_check
from gtp_format.check.verify import verify
from gtp_format.errors import ChunkError
from gtp_format.model import TENSOR
from gtp_format.reader.blob import as_tensor, element_view, parse_blob
from gtp_format.reader.checkpoint import open_checkpoint
from gtp_format.reader.chunks import chunk_bytes, load_chunk, load_elements
from gtp_format.reader.zip_blob import BlobError, ViewReader

REPO = Path(__file__).parents[2]
FIXTURES = sorted(p.parent for p in REPO.glob("fixtures/*/*/iter_*/.metadata"))


def _saved(t: torch.Tensor) -> bytearray:
    buf = io.BytesIO()
    torch.save(t, buf)
    return bytearray(buf.getvalue())


def _decode(blob: bytearray) -> torch.Tensor:
    view = memoryview(blob)
    layout = parse_blob(ViewReader(view))
    return as_tensor(element_view(layout, view[layout.payload_offset:layout.payload_offset + layout.payload_bytes]),
                     layout.dtype)


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
    # dtypes without a legacy storage class: torch.save writes _rebuild_tensor_v3 and an untyped storage
    lambda: torch.randn(6, 4).to(torch.float8_e4m3fn),
    lambda: torch.randn(5).to(torch.float8_e5m2)[1:4],
    lambda: torch.arange(12, dtype=torch.int32).to(torch.uint16).reshape(3, 4).t(),
    lambda: torch.arange(6, dtype=torch.int64).to(torch.uint32),
])
def test_decoder_matches_torch_load(make):
    t = make()
    blob = _saved(t)
    want = torch.load(io.BytesIO(bytes(blob)), weights_only=True)
    got = _decode(blob)
    assert got.dtype == want.dtype and got.shape == want.shape and got.stride() == want.stride()
    assert torch.equal(got.view(torch.uint8) if got.dtype.itemsize == 1 and got.is_floating_point() else got,
                       want.view(torch.uint8) if want.dtype.itemsize == 1 and want.is_floating_point() else want)
    if got.numel():  # a view of the caller's buffer: no copy was made
        assert _address(blob) <= got.untyped_storage().data_ptr() < _address(blob) + len(blob)
    # the torch-free view (what verify --data scans) holds the same bits in the same order
    elements = _elements(blob)
    assert elements.shape == tuple(want.shape) and elements.tobytes() == _bits(want)


def _elements(blob: bytearray) -> np.ndarray:
    view = memoryview(blob)
    layout = parse_blob(ViewReader(view))
    return element_view(layout, view[layout.payload_offset:layout.payload_offset + layout.payload_bytes])


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def test_a_view_reaching_past_its_storage_is_refused():
    blob = _saved(torch.arange(10, dtype=torch.int64)[2:8])
    layout = parse_blob(ViewReader(memoryview(blob)))
    bad = dataclasses.replace(layout, size=(9,))  # offset 2 + 9 elements > 10
    with pytest.raises(BlobError, match="reaches element 10 of a 10-element storage"):
        element_view(bad, memoryview(blob)[layout.payload_offset:layout.payload_offset + layout.payload_bytes])


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
            assert load_elements(ckpt, e, c).tobytes() == _bits(want)
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


def test_a_data_pkl_seen_before_is_parsed_once_and_a_bad_one_every_time(monkeypatch):
    """Chunks of one shape carry the same ``data.pkl`` bytes, so its parse is kept per process
    (``blob._tensor_args``): the same bytes give the same layout without a second parse, a blob whose storage
    record disagrees with a remembered pickle is still refused, and a damaged pickle is judged every time."""
    from gtp_format.reader import blob as blob_mod

    blob_mod._tensor_args.cache_clear()
    calls = []
    real = blob_mod._TensorPickle.load
    monkeypatch.setattr(blob_mod._TensorPickle, "load", lambda self: (calls.append(1), real(self))[1])
    a, b = torch.arange(6, dtype=torch.float32), torch.arange(6, 12, dtype=torch.float32)
    assert torch.equal(_decode(_saved(a)), a) and torch.equal(_decode(_saved(b)), b)
    assert len(calls) == 1  # the second blob's data.pkl is the first's bytes
    short = _saved(torch.zeros(6))
    pkl_of_six = zipfile.ZipFile(io.BytesIO(bytes(short))).read(
        next(n for n in zipfile.ZipFile(io.BytesIO(bytes(short))).namelist() if n.endswith("data.pkl")))
    with pytest.raises(BlobError, match="holds 8 bytes but data.pkl declares 6"):
        _decode(_with_pickle(_saved(torch.zeros(2)), pkl_of_six))  # a remembered pickle, a record too short
    evil = _with_pickle(_saved(torch.zeros(2)), pickle.dumps(_Evil(), protocol=2))
    for _ in range(2):
        with pytest.raises(BlobError, match="posix.system"):
            _decode(evil)


def test_compressed_record_is_refused():
    src = zipfile.ZipFile(io.BytesIO(bytes(_saved(torch.zeros(1000)))))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info))
    with pytest.raises(BlobError, match="compressed"):
        _decode(bytearray(out.getvalue()))


def _rezip(blob: bytearray, **open_kw) -> bytearray:
    """The same records, written by Python's zipfile (no 64-byte alignment, its own zip64 choices)."""
    src = zipfile.ZipFile(io.BytesIO(bytes(blob)))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            with dst.open(info.filename, "w", **open_kw) as f:
                f.write(src.read(info))
    return bytearray(out.getvalue())


@pytest.mark.parametrize("open_kw", [{}, {"force_zip64": True}])
def test_archives_from_another_zip_writer_decode(open_kw: dict):
    t = torch.randn(6, 7)
    assert torch.equal(_decode(_rezip(_saved(t), **open_kw)), t)


def test_zip64_extra_field_is_read():
    """Sizes and offsets saturated at 0xFFFFFFFF in the central directory come from the zip64 extra field."""
    t = torch.arange(12, dtype=torch.float32)
    blob = _rezip(_saved(t))
    z = zipfile.ZipFile(io.BytesIO(bytes(blob)))
    out = bytearray(blob)
    cd = blob.rindex(b"PK\x05\x06")
    cd_offset = int.from_bytes(blob[cd + 16: cd + 20], "little")
    # rebuild the central directory with every size and offset in a zip64 extra field
    import struct
    entries, pos = [], cd_offset
    for info in z.infolist():
        head = bytearray(blob[pos: pos + 46])
        name_len, extra_len, comment_len = struct.unpack_from("<HHH", head, 28)
        name = bytes(blob[pos + 46: pos + 46 + name_len])
        struct.pack_into("<III", head, 20, 0xFFFFFFFF, 0xFFFFFFFF, 0)  # compressed, uncompressed size
        struct.pack_into("<I", head, 42, 0xFFFFFFFF)  # local header offset
        extra = struct.pack("<HHQQQ", 1, 24, info.file_size, info.compress_size, info.header_offset)
        struct.pack_into("<HHH", head, 28, name_len, len(extra), 0)
        entries.append(bytes(head) + name + extra)
        pos += 46 + name_len + extra_len + comment_len
    directory = b"".join(entries)
    eocd = struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, len(entries), len(entries), len(directory), cd_offset, 0)
    out = bytearray(blob[:cd_offset]) + directory + eocd
    assert torch.equal(_decode(out), t)
    short = bytearray(blob[:cd_offset]) + directory.replace(struct.pack("<HH", 1, 24), struct.pack("<HH", 1, 0), 1)
    with pytest.raises(BlobError, match="zip64 extra field"):
        _decode(short + eocd)


@pytest.mark.parametrize(("damage", "needle"), [
    (lambda b: b + b"comment", "end-of-central-directory"),  # bytes after the end record
    (lambda b: b[:-22] + b[-22:-2] + b"\x01\x00", "end-of-central-directory"),  # an archive comment length
    (lambda b: b[:-18] + b"\x01\x00" + b[-16:], "single-disk"),  # a second disk
    (lambda b: b.replace(b"archive/data.pkl", b"archive/data.pk2"), "data.pkl"),
    (lambda b: b.replace(b"little", b"bigend"), "CRC-32"),  # byteorder record damaged
])
def test_structural_damage_is_one_blob_error(damage, needle: str):
    with pytest.raises(BlobError, match=needle):
        _decode(bytearray(damage(bytes(_saved(torch.zeros(3))))))


def test_too_many_records_are_refused():
    blob = _saved(torch.zeros(3))
    src = zipfile.ZipFile(io.BytesIO(bytes(blob)))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info))
        for i in range(100):
            dst.writestr(f"archive/pad{i}", b"")
    with pytest.raises(BlobError, match="single-disk"):
        _decode(bytearray(out.getvalue()))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_damaged_blobs_give_blob_errors_or_the_right_tensor(data):
    """Any byte flipped, cut or inserted: the parser says BlobError, or decodes (structure intact) correctly.

    Never another exception, never a read outside the blob: every range goes through BlobReader.get.
    """
    t = torch.arange(20, dtype=torch.float32).reshape(4, 5)
    blob = bytearray(_saved(t))
    kind = data.draw(st.sampled_from(["flip", "cut", "insert", "tail"]))
    i = data.draw(st.integers(0, len(blob) - 1))
    if kind == "flip":
        blob[i] ^= data.draw(st.integers(1, 255))
    elif kind == "cut":
        del blob[i: i + data.draw(st.integers(1, 64))]
    elif kind == "insert":
        blob[i:i] = data.draw(st.binary(min_size=1, max_size=64))
    else:  # the structural tail, where offsets live
        j = len(blob) - 1 - data.draw(st.integers(0, 200))
        blob[j] ^= data.draw(st.integers(1, 255))
    try:
        elements = _elements(blob)  # the torch-free view verify --data scans
    except BlobError:
        with pytest.raises(BlobError):
            _decode(blob)
        return
    got = _decode(blob)
    # what parsed is the declared tensor (a flip in the elements themselves is the file checksum's job)
    assert got.dtype == t.dtype and got.shape == t.shape and elements.shape == tuple(t.shape)
    assert elements.tobytes() == _bits(got)


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
    # and NaN/Inf counts equal those of decoding each chunk on its own, megatron-core's alignment
    # padding (uninitialised memory, counted apart as an info line) left out
    from gtp_format.megatron.padding import padding_chunks
    from gtp_format.megatron.topology import is_megatron_core

    ckpt = open_checkpoint(run)
    padding = padding_chunks(ckpt) if ckpt.manifest is None and is_megatron_core(ckpt) else frozenset()
    want = {}
    for e in ckpt.entries.values():
        if e.kind != TENSOR:
            continue
        nan = inf = 0
        for c in e.chunks:
            if (e.key, c.index) in padding:
                continue
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


@pytest.mark.parametrize("run", FIXTURES, ids=[f"{p.parent.parent.name}/{p.parent.name}" for p in FIXTURES])
def test_report_does_not_depend_on_the_worker_count(run: Path, monkeypatch: pytest.MonkeyPatch):
    """Results are merged in file order: the same problems in the same order, the same digests and counts."""
    monkeypatch.setattr(data_check, "WINDOW", 4096)  # many windows in flight at once
    one = verify(open_checkpoint(run), data=True, workers=1)
    many = verify(open_checkpoint(run), data=True, workers=4)
    assert [p.to_dict() for p in one.problems] == [p.to_dict() for p in many.problems]
    assert one.stats == many.stats and one.ok == many.ok


def test_a_file_that_shrinks_during_the_pass_is_one_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Reads are preads, not a mapping: a file cut short under verify is reported, not a crash (SIGBUS)."""
    import shutil

    src = next(p for p in FIXTURES if p.parent.name == "fold_cp2_g2_dp2")
    run = tmp_path / src.name
    shutil.copytree(src, run)
    victim = "__3_0.distcp"
    monkeypatch.setattr(data_check, "WINDOW", 4096)
    truncate_once_planned(monkeypatch, run, victim)
    res = verify(open_checkpoint(run), data=True, workers=2)
    cut = [p for p in res.problems if p.check == "data_file"]
    assert len(cut) == 1 and cut[0].file == victim and "shrank while reading" in cut[0].message
    assert not res.ok


def test_an_unexpected_worker_error_propagates_after_every_read_ends(monkeypatch: pytest.MonkeyPatch):
    """Not a ChunkError (say EIO): verify raises it, and only once no worker reads a descriptor it closes."""
    import threading
    import time

    run = next(p for p in FIXTURES if p.parent.name == "fold_cp2_g2_dp2")
    monkeypatch.setattr(data_check, "WINDOW", 4096)
    work, calls, lock, busy = data_check._FilePass.work, [0], threading.Lock(), []

    def failing_work(self: data_check._FilePass, step) -> data_check._Found:
        with lock:
            calls[0] += 1
            n = calls[0]
        if n == 5:
            raise OSError(5, "Input/output error")
        time.sleep(0.01)
        busy.append(self.fd is not None)  # still open while a worker is on it
        return work(self, step)

    monkeypatch.setattr(data_check._FilePass, "work", failing_work)
    fds = len(os.listdir("/proc/self/fd"))
    with pytest.raises(OSError, match="Input/output error"):
        verify(open_checkpoint(run), data=True, workers=4)
    assert all(busy) and len(os.listdir("/proc/self/fd")) == fds


def test_rebuild_v3_guards():
    """The v3 form (an untyped storage plus a dtype) is checked like v2: a real dtype, whole elements."""
    from gtp_format.dtypes import DTYPES
    from gtp_format.reader import blob

    untyped = blob._StorageId(DTYPES["uint8"], "0", 6)
    args = blob._rebuild_tensor_v3(untyped, 1, (2,), (1,), False, {}, DTYPES["uint16"])
    assert args.storage.dtype is DTYPES["uint16"] and args.storage.numel == 3
    with pytest.raises(BlobError, match="not a whole number of torch.float32 elements"):
        blob._rebuild_tensor_v3(untyped, 0, (1,), (1,), False, {}, DTYPES["float32"])
    with pytest.raises(BlobError, match="untyped record and a dtype"):
        blob._rebuild_tensor_v3(untyped, 0, (1,), (1,), False, {}, "float32")
    typed = blob._StorageId(DTYPES["float32"], "0", 6)
    with pytest.raises(BlobError, match="untyped record and a dtype"):
        blob._rebuild_tensor_v3(typed, 0, (1,), (1,), False, {}, DTYPES["float32"])


@pytest.mark.filterwarnings("ignore::UserWarning")  # DCP without a process group: "assuming ... single process"
@pytest.mark.parametrize("window", [data_check.WINDOW, 4096])
def test_verify_counts_nonfinite_in_every_float_dtype_like_torch(tmp_path: Path, window: int,
                                                                 monkeypatch: pytest.MonkeyPatch):
    """A DCP save of every float dtype with NaN/Inf planted: verify --data counts what torch counts.

    With 4 KiB windows the larger tensors are scanned piece by piece as they stream past.
    """
    import torch.distributed.checkpoint as dcp

    g = torch.Generator().manual_seed(0)
    sd = {}
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64,
                  torch.float8_e4m3fn, torch.float8_e5m2):
        base = torch.randn(3000, generator=g, dtype=torch.complex64 if dtype.is_complex else torch.float32)
        t = base.to(dtype)
        if dtype.itemsize == 1:
            t.view(torch.uint8)[::97] = 0x7F  # NaN in e4m3fn, NaN in e5m2
            t.view(torch.uint8)[5::211] = 0x7C  # finite in e4m3fn, +Inf in e5m2
        else:
            t[::97] = float("nan")
            t[5::211] = float("inf")
            t[7::307] = -float("inf")
        sd[f"w.{str(dtype).removeprefix('torch.')}"] = t
    sd["ints"] = torch.arange(100, dtype=torch.int64)
    dcp.save(sd, checkpoint_id=str(tmp_path))
    monkeypatch.setattr(data_check, "WINDOW", window)
    res = verify(open_checkpoint(tmp_path), data=True, workers=3)

    def counts(t: torch.Tensor) -> dict[str, int]:
        f = t.to(torch.complex64) if t.is_complex() else t.float()
        return {"nan": int(torch.isnan(f).sum()), "inf": int(torch.isinf(f).sum())}

    want = {k: counts(t) for k, t in sd.items() if t.is_floating_point() or t.is_complex()}
    assert all(v["nan"] for v in want.values())
    assert res.stats["nonfinite"] == want
    assert not [p for p in res.problems if p.severity == "error"]
