"""``show``'s tensor helpers: parse ``--slice``, summarise a tensor (NaN/Inf aware).

Assembling a region from chunks is :mod:`gtp_format.reader.region` (``diff`` and
``verify-roundtrip`` assemble through it too); comparing values is :mod:`gtp_format.compare`.
"""

from __future__ import annotations

from typing import Any

import torch

from gtp_format.errors import FormatError


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
