"""Assemble (part of) a tensor from its chunks, summarise it, compare two of them.

``show`` and ``diff`` read real data, so the memory they may use is bounded up front: the
assembled region's size is computed from metadata and refused over a limit before anything is
allocated, and only the chunks that intersect the requested rows are read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from gtp_format.errors import FormatError
from gtp_format.reader.region import Assembled, assemble  # noqa: F401 - moved there; diff still imports it here


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
