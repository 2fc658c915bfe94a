"""Count NaN and Inf in stored elements with numpy, by dtype, without torch.

``verify --data`` scans every element of a checkpoint, so this is the hot loop next to the read
and the checksum. It works on the stored bit patterns, viewed through a numpy *carrier* of the
same width (bfloat16 and float8 have no numpy type), and answers the common case, "none", with
one pass:

* float32/float64 (and the complex types built on them): ``isfinite(x).all()``. Unlike a sum it
  cannot overflow, so a finite chunk never takes the slow path;
* 16-bit floats (and complex32): the largest ``bits & 0x7fff``; a value is NaN or Inf exactly
  when its exponent field is all ones, so the maximum reaches that pattern only if one does;
* 8-bit floats: a histogram of the 256 codes, weighed against per-format tables of which codes
  are NaN and which are Inf (float8 checkpoints are rare; correctness over speed);
* integers, bool, bit containers and float4 (no NaN/Inf encoding): nothing to count.

Only when the fast test fails are exact counts taken, with torch's meaning: a complex element
counts once as NaN if either part is NaN, and once as Inf if either part is infinite.
numpy releases the GIL in these loops, so worker threads scan in parallel. The fast test's result
array (a bool per float32, the magnitudes of 16-bit floats) is a buffer of the thread's own, reused
up to :data:`SCRATCH` bytes: a new one per 2 MiB window was an allocation of 0.5-2 MiB on every
worker for every window, which the kernel must zero and fault in when the allocator returns it.
"""

from __future__ import annotations

import threading

import numpy as np

from gtp_format.dtypes import BOOL, COMPLEX, FLOAT, SIGNED, DType

_NATIVE = {"float32": np.float32, "float64": np.float64, "complex64": np.complex64, "complex128": np.complex128}
_HALF_EXP = {"float16": 0x7C00, "bfloat16": 0x7F80, "complex32": 0x7C00}  # exponent all ones, sign masked


def _fp8_tables() -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per float8 format: (is NaN, is Inf) for each of the 256 codes."""
    codes = np.arange(256)
    low7 = codes & 0x7F
    none = np.zeros(256, dtype=bool)
    return {
        "float8_e4m3fn": (low7 == 0x7F, none),  # S.1111.111 is NaN; no Inf
        "float8_e5m2": (low7 > 0x7C, low7 == 0x7C),  # IEEE-like: exponent 11111
        "float8_e4m3fnuz": (codes == 0x80, none),  # "negative zero" is the only NaN
        "float8_e5m2fnuz": (codes == 0x80, none),
        "float8_e8m0fnu": (codes == 0xFF, none),  # exponent only; 0xFF is NaN
    }


_FP8 = _fp8_tables()
SCRATCH = 4 << 20  # the largest result array reused per thread; larger ones are allocated
_LOCAL = threading.local()


def _scratch(like: np.ndarray, dtype: np.dtype) -> np.ndarray | None:
    """This thread's reused array of ``like``'s shape in ``dtype``, or None above :data:`SCRATCH` bytes."""
    n = like.size * dtype.itemsize
    if n > SCRATCH:
        return None
    buf = getattr(_LOCAL, "buf", None)
    if buf is None or buf.size < n:
        buf = _LOCAL.buf = np.empty(max(n, 1 << 20), np.uint8)
    out = buf[:n].view(dtype)
    return out if like.ndim == 1 else out.reshape(like.shape)


_BOOL = np.dtype(np.bool_)
_ALL = np.logical_and.reduce  # ndarray.all() without its Python wrapper: called per 512 KiB piece on every worker


def carrier(dtype: DType) -> np.dtype:
    """The numpy type the stored elements are viewed as: same width, never converted.

    Little-endian whatever the host: that is how torch.save and safetensors store them.
    """
    native = _NATIVE.get(dtype.name)
    if native is not None:
        return np.dtype(native).newbyteorder("<")
    if dtype.kind == BOOL:
        return np.dtype(np.bool_)
    return np.dtype(f"<i{dtype.itemsize}" if dtype.kind == SIGNED else f"<u{dtype.itemsize}")  # ints as ints, else bits


def can_hold_nonfinite(dtype: DType) -> bool:
    return dtype.name in _NATIVE or dtype.name in _HALF_EXP or dtype.name in _FP8


def count_nonfinite(elements: np.ndarray, dtype: DType) -> tuple[int, int]:
    """``(NaN count, Inf count)`` of elements viewed through :func:`carrier` (any shape or strides)."""
    if elements.size == 0 or dtype.kind not in (FLOAT, COMPLEX):
        return 0, 0
    name = dtype.name
    if name in _NATIVE:
        if _ALL(np.isfinite(elements, out=_scratch(elements, _BOOL)), axis=None):
            return 0, 0
        return int(np.count_nonzero(np.isnan(elements))), int(np.count_nonzero(np.isinf(elements)))
    exp = _HALF_EXP.get(name)
    if exp is not None:
        if name == "complex32":  # two float16 halves per element
            elements = np.ascontiguousarray(elements).reshape(-1).view(np.uint16)
        magnitude = np.bitwise_and(elements, 0x7FFF, out=_scratch(elements, elements.dtype))
        if magnitude.max() < exp:
            return 0, 0
        nan, inf = magnitude > exp, magnitude == exp
        if name == "complex32":
            nan, inf = nan.reshape(-1, 2).any(1), inf.reshape(-1, 2).any(1)
        return int(np.count_nonzero(nan)), int(np.count_nonzero(inf))
    tables = _FP8.get(name)
    if tables is None:  # float4_e2m1fn_x2: no NaN or Inf codes
        return 0, 0
    histogram = np.bincount(elements.reshape(-1), minlength=256)
    return int(histogram[tables[0]].sum()), int(histogram[tables[1]].sum())
