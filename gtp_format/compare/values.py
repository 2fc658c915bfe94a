"""Elementwise comparison of two same-shape, same-dtype tensors: bitwise, or within a tolerance.

Two rules, because the callers ask two different questions:

* **bitwise** (round trips, resumes): did every element come back with the same bits? ``-0.0``
  differs from ``0.0`` and a NaN equals only a NaN with the same payload. A checkpoint format
  that changes a bit is wrong even when the value "looks" equal.
* **tolerance** (``ckpt diff``): is ``|a - b| <= atol + rtol * |b|``? NaN equals NaN. The default
  ``rtol = atol = 0`` is exact equality of values (so ``-0.0 == 0.0``).

Values are widened to float64 (complex128) only where the rule needs arithmetic: equality is
decided on the bits first, so integers beyond 2**53 (which float64 would round together) and
NaN payloads are compared exactly. The first differing element is reported as a flat row-major
index into the compared piece, and ``max_abs_diff`` is the largest *finite* ``|a - b|`` among the
differing elements (a NaN or infinity on one side has no finite distance).

This module asks :mod:`gtp_format.torch_adapter` for torch inside its functions only: :mod:`gtp_format` must
import without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from gtp_format.torch_adapter import load_torch

_INT_OF_SIZE = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}


@dataclass(frozen=True)
class Rule:
    """How values are compared: ``bitwise``, or within ``rtol`` / ``atol``."""

    bitwise: bool = False
    rtol: float = 0.0
    atol: float = 0.0

    def __post_init__(self) -> None:
        if self.rtol < 0 or self.atol < 0 or self.rtol != self.rtol or self.atol != self.atol:
            raise ValueError(f"tolerances must be non-negative numbers, got rtol={self.rtol} atol={self.atol}")
        if self.bitwise and (self.rtol or self.atol):
            raise ValueError("a bitwise comparison has no tolerance")

    @classmethod
    def bits(cls) -> Rule:
        return cls(bitwise=True)

    @classmethod
    def tolerance(cls, rtol: float = 0.0, atol: float = 0.0) -> Rule:
        return cls(rtol=float(rtol), atol=float(atol))

    @property
    def exact(self) -> bool:
        return self.bitwise or not (self.rtol or self.atol)

    def describe(self) -> str:
        if self.bitwise:
            return "bitwise"
        return f"rtol={self.rtol}, atol={self.atol}"


BITWISE = Rule.bits()
EXACT = Rule.tolerance()


class ValueDiff(NamedTuple):
    """How two pieces differ: count, largest finite ``|a - b|`` over those, first flat index."""

    differing: int
    max_abs_diff: float | None
    first: int | None


SAME = ValueDiff(0, None, None)


def _carriers(t: Any) -> Any:
    """The stored bits as integers, one row per element (a complex element has two parts)."""
    torch = load_torch()

    t = t.detach().contiguous().reshape(-1)
    t = torch.view_as_real(t) if t.is_complex() else t.reshape(-1, 1)
    return t.view(getattr(torch, _INT_OF_SIZE[t.element_size()]))


def _wide(t: Any) -> Any:
    torch = load_torch()

    t = t.detach().reshape(-1)
    return t.to(torch.complex128) if t.is_complex() else t.to(torch.float64)


def _distance(xa: Any, xb: Any) -> Any:
    """``|a - b|`` as float64, for 1-D pieces of one dtype; integers are subtracted exactly first."""
    torch = load_torch()

    if xa.is_complex() or xa.is_floating_point() or xa.dtype == torch.uint64:
        return (_wide(xa) - _wide(xb)).abs()
    ia, ib = xa.to(torch.int64), xb.to(torch.int64)
    d = ia - ib
    wrapped = ((ia ^ ib) < 0) & ((d ^ ia) < 0)  # signs differ and the int64 difference overflowed
    out = d.to(torch.float64).abs()
    out[wrapped] = (ia[wrapped].to(torch.float64) - ib[wrapped].to(torch.float64)).abs()
    return out


def compare_values(a: Any, b: Any, rule: Rule) -> ValueDiff:
    """Compare two same-shape, same-dtype ``torch.Tensor`` pieces under ``rule``."""
    torch = load_torch()

    if tuple(a.shape) != tuple(b.shape) or a.dtype != b.dtype:
        raise ValueError(f"compare_values needs equal shapes and dtypes, got {tuple(a.shape)} {a.dtype} and "
                         f"{tuple(b.shape)} {b.dtype}")
    bad = (_carriers(a) != _carriers(b)).any(dim=1)
    if not bool(bad.any()):
        return SAME
    xa, xb = a.detach().reshape(-1)[bad], b.detach().reshape(-1)[bad]
    dist = _distance(xa, xb)
    if not rule.bitwise and (a.is_floating_point() or a.is_complex()):
        # Different bits, yet equal or close values: -0.0 and 0.0, two NaN payloads, a tolerance.
        keep = ~torch.isclose(_wide(xa), _wide(xb), rtol=rule.rtol, atol=rule.atol, equal_nan=True)
    elif not rule.exact:  # integers and bools: equal bits are equal values; a tolerance needs arithmetic
        keep = dist > rule.atol + rule.rtol * _wide(xb).abs()
    else:
        keep = None
    if keep is not None:
        bad[bad.clone()] = keep
        dist = dist[keep]
    count = int(bad.sum())
    if not count:
        return SAME
    dist = dist[torch.isfinite(dist)]
    return ValueDiff(count, float(dist.max()) if dist.numel() else None, int(bad.nonzero()[0, 0]))


def unravel(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major multi-index of flat index ``flat`` in ``shape`` (``()`` for a 0-D tensor)."""
    out = []
    for n in reversed(shape):
        flat, i = divmod(flat, n)
        out.append(i)
    return tuple(reversed(out))
