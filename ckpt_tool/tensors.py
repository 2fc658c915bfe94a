"""Assemble (part of) a tensor from its chunks, summarise it, compare two of them.

``show`` and ``diff`` read real data, so the memory they may use is bounded up front: the
assembled region's size is computed from metadata and refused over a limit, and over the bytes
its chunks really store (a declared 2 GB bool tensor backed by a 1 KB chunk was allocated whole),
before anything is allocated; only the chunks that intersect the requested rows are read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from gtp_format.check.geometry import check_coverage
from gtp_format.errors import EXIT_BAD_INPUT, FormatError
from gtp_format.model import Checkpoint, Chunk, Entry
from gtp_format.reader.chunks import checked_ref, load_chunk
from gtp_format.reader.storage import file_size


def parse_slice(text: str | None, dim0: int) -> tuple[int, int]:
    """``a:b`` / ``a:`` / ``:b`` / ``i`` on dim 0, Python-style (negative counts from the end)."""
    if text is None:
        return 0, dim0
    parts = text.split(":")
    try:
        if len(parts) == 1:
            i = int(parts[0])
            i = i + dim0 if i < 0 else i
            start, stop = i, i + 1
        elif len(parts) == 2:
            start, stop, _ = slice(int(parts[0]) if parts[0] else None,
                                   int(parts[1]) if parts[1] else None).indices(dim0)
        else:
            raise ValueError
    except ValueError:
        raise FormatError(f"--slice {text!r} is not a:b, a:, :b or a single index") from None
    if not 0 <= start <= dim0 or stop < start or stop > dim0:
        raise FormatError(f"--slice {text!r} is outside dim 0 of size {dim0}")
    return start, stop


@dataclass
class Assembled:
    tensor: torch.Tensor
    start: int
    stop: int
    chunks_read: int
    missing: int  # elements of the region no chunk covers (left as zero)


def assemble(ckpt: Checkpoint, entry: Entry, start: int, stop: int, max_bytes: int) -> Assembled:
    """Rows ``[start, stop)`` of dim 0 (the whole tensor when 0-D), reading only chunks that meet them."""
    assert entry.shape is not None and entry.dtype is not None
    shape = (stop - start, *entry.shape[1:]) if entry.shape else ()
    nbytes = math.prod(shape) * entry.itemsize
    if nbytes > max_bytes:
        raise FormatError(f"{entry.key}: the requested region is {math.prod(shape)} elements ({nbytes} bytes), over "
                        f"the {max_bytes}-byte limit; pass --slice a:b for fewer rows or raise --max-bytes",
                        EXIT_BAD_INPUT)
    held = [c for c in entry.chunks if len(c.offsets) == len(entry.shape)
            and (not entry.shape or _intersection(c, start, stop) is not None)]
    for c in held:
        checked_ref(ckpt, entry, c)  # no storage, transforms, a declared size its blob cannot hold: by name
    # real sizes, from the opened files: a path outside the folder or a missing file fails here, by name
    sizes = {f: ckpt.data_files[f] if f in ckpt.data_files else file_size(ckpt.root, f)
             for f in {c.storage.file for c in held}}
    stored = sum(min(c.storage.length, sizes[c.storage.file]) for c in held)
    if nbytes > stored:  # the allocation below is sized by metadata: back it by bytes that really exist
        raise FormatError(f"{entry.key}: the requested region is {nbytes} bytes but the chunks that hold it store only "
                          f"{stored} bytes in real files; the metadata declares more than was written: run "
                          "'ckpt verify' on the checkpoint", EXIT_BAD_INPUT)
    out = torch.zeros(shape, dtype=entry.dtype.torch)
    boxes = []
    read = 0
    for c in entry.chunks:
        if len(c.offsets) != len(entry.shape) or any(
                o + s > n for o, s, n in zip(c.offsets, c.sizes, entry.shape, strict=True)):
            raise FormatError(f"{entry.key} chunk {c.index} (offsets {list(c.offsets)}, sizes {list(c.sizes)}) leaves "
                            f"the global shape {list(entry.shape)}; run 'ckpt verify' on the checkpoint")
        region = _intersection(c, start, stop) if entry.shape else (0, 0)
        if region is None:
            continue
        t = load_chunk(ckpt, entry, c)
        read += 1
        if not entry.shape:
            out.copy_(t)
            boxes.append(((), ()))
            continue
        lo, hi = region
        src = t[lo - c.offsets[0]: hi - c.offsets[0]]
        dst_index = (slice(lo - start, hi - start),) + tuple(
            slice(o, o + s) for o, s in zip(c.offsets[1:], c.sizes[1:], strict=True))
        out[dst_index].copy_(src)
        boxes.append(((lo - start, *c.offsets[1:]), (hi - lo, *c.sizes[1:])))
    return Assembled(out, start, stop, read, check_coverage(shape, boxes).missing or 0)


def _intersection(c: Chunk, start: int, stop: int) -> tuple[int, int] | None:
    """Rows of ``[start, stop)`` this chunk holds, or ``None`` (empty chunks hold none)."""
    lo, hi = max(start, c.offsets[0]), min(stop, c.offsets[0] + c.sizes[0])
    return (lo, hi) if lo < hi and c.numel else None


def summary(t: torch.Tensor) -> dict[str, Any]:
    """Shape, dtype and statistics of the finite values, plus NaN/Inf counts."""
    info: dict[str, Any] = {"shape": list(t.shape), "dtype": str(t.dtype), "numel": t.numel()}
    if t.is_complex():
        t = torch.view_as_real(t)
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    floating = t.is_floating_point()
    nan = int(torch.isnan(t).sum()) if floating else 0
    inf = int(torch.isinf(t).sum()) if floating else 0
    finite = t[torch.isfinite(t)] if floating else t.reshape(-1)
    finite = finite.to(torch.float64)
    info.update(nan=nan, inf=inf)
    if finite.numel():
        info.update(min=finite.min().item(), max=finite.max().item(), mean=finite.mean().item(),
                    std=finite.std().item() if finite.numel() > 1 else 0.0)
    else:
        info.update(min=None, max=None, mean=None, std=None)
    return info


@dataclass
class Comparison:
    mismatches: int
    max_abs_diff: float | None  # over mismatching elements with a finite difference
    first_mismatch: int | None  # flat index inside the compared piece


def compare(a: torch.Tensor, b: torch.Tensor, rtol: float, atol: float) -> Comparison:
    """Elementwise ``|a - b| <= atol + rtol * |b|`` (NaN equals NaN), on same-shape tensors."""
    if a.dtype == torch.bool:
        a, b = a.to(torch.uint8), b.to(torch.uint8)
    if a.is_complex():
        a, b = torch.view_as_real(a), torch.view_as_real(b)
    a64, b64 = a.to(torch.float64).reshape(-1), b.to(torch.float64).reshape(-1)
    close = torch.isclose(a64, b64, rtol=rtol, atol=atol, equal_nan=True)
    bad = (~close).nonzero()
    diff = (a64 - b64).abs()[~close]
    diff = diff[torch.isfinite(diff)]  # a NaN or Inf on one side has no finite distance
    return Comparison(
        mismatches=int(bad.numel()),
        max_abs_diff=diff.max().item() if diff.numel() else None,
        first_mismatch=int(bad[0, 0]) if bad.numel() else None,
    )
