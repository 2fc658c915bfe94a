"""The numpy NaN/Inf scan counts exactly what torch.isnan / torch.isinf count, for every float dtype."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gtp_format.dtypes import DTYPES, from_torch
from gtp_format.scan import can_hold_nonfinite, carrier, count_nonfinite

FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128,
          torch.complex32]
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz, torch.float8_e8m0fnu]


def _reference(t: torch.Tensor) -> tuple[int, int]:
    if t.dtype == torch.complex32:
        t = t.to(torch.complex64)  # exact: every complex32 value is a complex64 value
    elif t.dtype.itemsize == 1 and t.is_floating_point():
        t = t.float()
    return int(torch.isnan(t).sum()), int(torch.isinf(t).sum())


def _elements(t: torch.Tensor) -> np.ndarray:
    """The tensor's stored bytes, viewed through the scan's carrier (what verify --data hands it)."""
    d = from_torch(t.dtype)
    raw = t.contiguous().view(torch.uint8).numpy() if t.numel() else np.zeros(0, np.uint8)
    return np.frombuffer(raw.tobytes(), dtype=carrier(d)).reshape(t.shape)


@pytest.mark.parametrize("dtype", FP8, ids=str)
def test_every_float8_code(dtype):
    t = torch.arange(256, dtype=torch.uint8).view(dtype)
    assert count_nonfinite(_elements(t), from_torch(dtype)) == _reference(t)


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@settings(max_examples=60, deadline=None)
@given(dtype=st.sampled_from(FLOATS), n=st.integers(0, 3000), seed=st.integers(0, 2**31 - 1),
       specials=st.lists(st.sampled_from(["nan", "inf", "-inf", "max", "nan_imag"]), max_size=6))
def test_matches_torch(dtype, n, seed, specials):
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(n, dtype=torch.complex64 if dtype.is_complex else torch.float32, generator=g) * 100
    t = base.to(dtype)
    for i, s in enumerate(specials):
        if n == 0:
            break
        pos = (seed + 7919 * i) % n
        value = {"nan": float("nan"), "inf": float("inf"), "-inf": -float("inf"),
                 "max": torch.finfo(torch.float16 if dtype in (torch.float16, torch.complex32) else
                                    torch.float32).max}.get(s)
        if s == "nan_imag":
            value = complex(1.0, float("nan")) if dtype.is_complex else float("nan")
        t[pos] = value
    assert count_nonfinite(_elements(t), from_torch(dtype)) == _reference(t)


def test_strided_view_counts_only_its_elements():
    t = torch.zeros(4, 6, dtype=torch.bfloat16)
    t[:, 1] = float("nan")  # in the view below
    t[:, 0] = float("inf")  # outside it
    base = _elements(t)
    view = base[:, 1::2]
    assert count_nonfinite(view, DTYPES["bfloat16"]) == (4, 0)
    assert count_nonfinite(base.T, DTYPES["bfloat16"]) == (4, 4)


def test_non_float_dtypes_are_not_scanned():
    for name in ("int64", "uint8", "bool", "float4_e2m1fn_x2", "qint8"):
        d = DTYPES[name]
        assert count_nonfinite(np.full(8, 0xFF, dtype=carrier(d)), d) == (0, 0)
    assert {d.name for d in DTYPES.values() if can_hold_nonfinite(d)} == {
        str(t).removeprefix("torch.") for t in FLOATS + FP8}


def test_overflowing_values_are_finite_and_counts_are_exact():
    def count(t):
        return count_nonfinite(_elements(t), from_torch(t.dtype))

    assert count(torch.tensor([1.0, float("nan"), float("inf"), -float("inf"), 3.0e38, 3.0e38])) == (1, 2)
    assert count(torch.full((8,), 3.0e38)) == (0, 0)  # a sum would overflow although every element is finite
    assert count(torch.full((4,), 60000.0).half()) == (0, 0)
    assert count(torch.tensor([1.0, float("nan")]).bfloat16()) == (1, 0)
    assert count(torch.arange(5)) == (0, 0)
