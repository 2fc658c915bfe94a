"""``BoxReader.chunk_rows`` on chunks stored in another dimension order, against brute force.

Issue 22: a chunk that is not row-major (DCP saves a transposed tensor as it is) was decoded whole
for every row block asked of it: B blocks read it B times and held it whole. Now a block reads its
own bytes once. Checked here: any dense stride order and any row block gives the same bits as
slicing the tensor (hypothesis), reading a chunk in blocks reads its bytes exactly once, and a
strided view with gaps (never written by DCP) is one line naming the key.
"""

from __future__ import annotations

import itertools
import math
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given, settings
from hypothesis import strategies as st

from gtp_format.errors import ChunkError
from gtp_format.reader.boxes import BoxReader, dense_order
from gtp_format.reader.checkpoint import open_checkpoint


def _save(folder: Path, tensors: dict[str, torch.Tensor]) -> BoxReader:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ... single process"
        dcp.save(tensors, checkpoint_id=str(folder))
    return BoxReader(open_checkpoint(folder))


def _permuted(t: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """``t``'s values, stored with dimension ``order[0]`` outermost (a dense, non-row-major layout)."""
    return t.permute(order).contiguous().permute(tuple(np.argsort(order)))


@settings(max_examples=30, deadline=None)
@given(shape=st.lists(st.integers(1, 5), min_size=1, max_size=4), data=st.data())
def test_rows_of_any_dense_order_match_brute_force(tmp_path_factory: pytest.TempPathFactory, shape: list[int],
                                                   data: st.DataObject) -> None:
    order = tuple(data.draw(st.permutations(range(len(shape)))))
    dtype = data.draw(st.sampled_from([torch.float32, torch.int16, torch.bfloat16, torch.float64]))
    t = torch.arange(math.prod(shape)).reshape(shape).to(dtype)
    stored = _permuted(t, order)
    assert torch.equal(stored, t)
    reader = _save(tmp_path_factory.mktemp("box"), {"w": stored})
    entry = reader.ckpt.entries["w"]
    r0 = data.draw(st.integers(0, shape[0]))
    r1 = data.draw(st.integers(r0, shape[0]))
    got = reader.chunk_rows(entry, entry.chunks[0], r0, r1)
    want = t[r0:r1].contiguous().view(-1).view(torch.uint8).numpy()
    assert np.ascontiguousarray(got).reshape(-1).view(np.uint8).tobytes() == want.tobytes()
    assert got.shape == (r1 - r0, *shape[1:])


def test_blocks_of_a_transposed_chunk_read_its_bytes_once(tmp_path: Path) -> None:
    t = torch.arange(64 * 48, dtype=torch.float32).reshape(64, 48)
    reader = _save(tmp_path, {"w": t.t().contiguous().t()})  # column-major, like a saved W.t()
    entry = reader.ckpt.entries["w"]
    assert reader._payload_start(entry, entry.chunks[0])[1] == (1, 64)  # really not row-major
    rows = [reader.chunk_rows(entry, entry.chunks[0], r, r + 4).copy() for r in range(0, 64, 4)]
    assert np.array_equal(np.concatenate(rows), t.numpy())
    assert reader.bytes_read == t.numel() * 4  # 16 blocks, each its own bytes: not 16 whole chunks


def test_read_box_across_permuted_chunks(tmp_path: Path) -> None:
    t = torch.arange(6 * 5 * 4, dtype=torch.float64).reshape(6, 5, 4)
    reader = _save(tmp_path, {"w": _permuted(t, (2, 0, 1))})
    for offsets, sizes in itertools.product([(0, 0, 0), (1, 2, 1)], [(2, 3, 3), (5, 3, 2)]):
        box = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
        assert np.array_equal(reader.read_box("w", offsets, sizes), t[box].numpy())


def test_dense_order() -> None:
    assert dense_order((4, 3), (3, 1)) == [0, 1]
    assert dense_order((4, 3), (1, 4)) == [1, 0]
    assert dense_order((4, 1, 3), (1, 99, 4)) == [2, 0]  # a size-1 dimension's stride is free
    assert dense_order((4, 3), (4, 1)) is None  # a gap after every row
    assert dense_order((4, 3), (0, 1)) is None  # broadcast rows


def test_strided_view_with_gaps_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import gtp_format.reader.boxes as boxes

    reader = _save(tmp_path, {"w": torch.arange(8.0).reshape(4, 2)})
    entry = reader.ckpt.entries["w"]
    real = boxes.parse_blob

    def gappy(r):  # the blob's data.pkl claims strides (4, 1) over a 4 x 2 view: a gap after each row
        layout = real(r)
        return type(layout)(**{**layout.__dict__, "stride": (4, 1), "storage_numel": 16})

    monkeypatch.setattr(boxes, "parse_blob", gappy)
    monkeypatch.setattr(boxes, "check_layout", lambda *a: None)
    with pytest.raises(ChunkError) as info:
        reader.chunk_rows(entry, entry.chunks[0], 0, 2)
    assert "w chunk 0" in info.value.message and "strided view with gaps" in info.value.message
    assert "\n" not in info.value.message


def test_prefetched_layouts_equal_the_lazy_ones() -> None:
    """``prefetch_layouts`` (background threads, export's cold-cache read-ahead) caches exactly what each
    read would have parsed itself, for every chunk of the keys given and no other; ``close`` stops it."""
    fold = Path(__file__).resolve().parents[2] / "fixtures/gtp/fold_cp2_g2_dp2"
    ckpt = open_checkpoint(fold)
    keys = sorted(ckpt.entries)[::2]
    ahead = BoxReader(ckpt)
    ahead.prefetch_layouts(keys, threads=3)
    assert ahead._prefetch is not None
    ahead._prefetch.shutdown(wait=True)  # let every queued parse finish
    lazy = BoxReader(ckpt)
    want = {(k, c.index): lazy._payload_start(ckpt.entries[k], c) for k in keys for c in ckpt.entries[k].chunks
            if ckpt.entries[k].kind == "tensor" and c.storage is not None}
    assert want and ahead._layouts == want
    ahead.close()
    assert ahead._prefetch is None
    stopped = BoxReader(ckpt)
    stopped.prefetch_layouts(sorted(ckpt.entries))
    stopped.close()  # cancels what has not started and waits for what has: nothing runs after it
    n = len(stopped._layouts)
    time.sleep(0.2)
    assert len(stopped._layouts) == n and stopped._prefetch is None
