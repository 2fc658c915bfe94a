"""The element types a checkpoint can declare, described without importing torch.

Why not ``torch.dtype``: the ``ckpt`` CLI's read-only commands (``inspect``, ``verify``,
``verify --data``) need a dtype's name, size and kind, and nothing else from torch; importing torch
costs 2-4 s per process (more than a whole ``verify`` of a small checkpoint) and a few hundred MB.
So the format carries its own table, and code that builds real tensors converts with
:attr:`DType.torch`. ``tests/format/test_dtypes.py`` checks the table against the installed torch,
so a torch upgrade that adds or changes a dtype fails a test rather than a user's verify.

What a checkpoint records of a dtype: DCP's ``.metadata`` pickles each ``torch.dtype`` as the
module global ``torch.<name>``; ``torch.save`` names the legacy storage class of the classic
dtypes (``torch.FloatStorage``, :attr:`DType.storage`) and, for the dtypes that have none (float8,
uint16...), pickles the dtype itself next to an untyped storage; safetensors headers use short
codes (``"BF16"``, :attr:`DType.safetensors`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gtp_format.torch_adapter import torch_attr

FLOAT, COMPLEX, SIGNED, UNSIGNED, BOOL, OTHER = "float", "complex", "signed", "unsigned", "bool", "other"


@dataclass(frozen=True, eq=False)
class DType:
    """One torch dtype by name; one instance per name, so ``is`` and ``==`` agree."""

    name: str  # torch's canonical attribute name: "bfloat16", not "half"
    itemsize: int
    kind: str  # FLOAT, COMPLEX, SIGNED, UNSIGNED, BOOL or OTHER (bit containers, quantized)
    storage: str | None = None  # torch.save's legacy storage class, for the dtypes that have one
    safetensors: str | None = None  # the safetensors header code

    def __repr__(self) -> str:
        return f"torch.{self.name}"  # as torch prints it, so tags like Megatron's "(torch.bfloat16, ...)" agree

    __str__ = __repr__

    def __reduce__(self) -> tuple[Any, ...]:
        return (by_name, (self.name,))  # stays the singleton across pickling (worker processes)

    @property
    def is_floating_point(self) -> bool:
        return self.kind == FLOAT

    @property
    def is_complex(self) -> bool:
        return self.kind == COMPLEX

    @property
    def torch(self) -> Any:
        """The ``torch.dtype`` (imports torch: only for code that builds tensors)."""
        return torch_attr(self.name)


_TABLE: tuple[DType, ...] = (
    DType("bool", 1, BOOL, "BoolStorage", "BOOL"),
    DType("uint8", 1, UNSIGNED, "ByteStorage", "U8"),
    DType("int8", 1, SIGNED, "CharStorage", "I8"),
    DType("int16", 2, SIGNED, "ShortStorage", "I16"),
    DType("int32", 4, SIGNED, "IntStorage", "I32"),
    DType("int64", 8, SIGNED, "LongStorage", "I64"),
    DType("uint16", 2, UNSIGNED, None, "U16"),
    DType("uint32", 4, UNSIGNED, None, "U32"),
    DType("uint64", 8, UNSIGNED, None, "U64"),
    DType("float16", 2, FLOAT, "HalfStorage", "F16"),
    DType("bfloat16", 2, FLOAT, "BFloat16Storage", "BF16"),
    DType("float32", 4, FLOAT, "FloatStorage", "F32"),
    DType("float64", 8, FLOAT, "DoubleStorage", "F64"),
    DType("float8_e4m3fn", 1, FLOAT, None, "F8_E4M3"),
    DType("float8_e5m2", 1, FLOAT, None, "F8_E5M2"),
    DType("float8_e4m3fnuz", 1, FLOAT, None, "F8_E4M3FNUZ"),
    DType("float8_e5m2fnuz", 1, FLOAT, None, "F8_E5M2FNUZ"),
    DType("float8_e8m0fnu", 1, FLOAT, None, "F8_E8M0"),
    DType("float4_e2m1fn_x2", 1, FLOAT),
    DType("complex32", 4, COMPLEX),
    DType("complex64", 8, COMPLEX, "ComplexFloatStorage", "C64"),
    DType("complex128", 16, COMPLEX, "ComplexDoubleStorage"),
    DType("qint8", 1, OTHER, "QInt8Storage"),
    DType("quint8", 1, OTHER, "QUInt8Storage"),
    DType("qint32", 4, OTHER, "QInt32Storage"),
    DType("quint4x2", 1, OTHER, "QUInt4x2Storage"),
    DType("quint2x4", 1, OTHER, "QUInt2x4Storage"),
    DType("bits8", 1, OTHER),
    DType("bits16", 2, OTHER),
    DType("bits1x8", 1, OTHER),
    DType("bits2x4", 1, OTHER),
    DType("bits4x2", 1, OTHER),
    *(DType(f"int{n}", 1, SIGNED) for n in range(1, 8)),  # sub-byte types, one element per byte
    *(DType(f"uint{n}", 1, UNSIGNED) for n in range(1, 8)),
)

DTYPES: dict[str, DType] = {d.name: d for d in _TABLE}
BY_STORAGE: dict[str, DType] = {d.storage: d for d in _TABLE if d.storage}
BY_SAFETENSORS: dict[str, DType] = {d.safetensors: d for d in _TABLE if d.safetensors}

# Tensor layouts (torch.strided...; not a checkpoint layout, gtp_format.names.LAYOUTS) and memory
# formats, which DCP's TensorProperties also records; kept as names.
TENSOR_LAYOUTS = frozenset({"strided", "sparse_coo", "sparse_csr", "sparse_csc", "sparse_bsr", "sparse_bsc", "_mkldnn",
                            "jagged"})
MEMORY_FORMATS = frozenset({"contiguous_format", "channels_last", "channels_last_3d", "preserve_format"})


def by_name(name: str) -> DType:
    """The dtype called ``name`` (``"float32"``, without the ``torch.`` prefix); KeyError if unknown."""
    return DTYPES[name]


def from_repr(text: str) -> DType:
    """The entry for ``"torch.float32"`` (how manifests, indexes and key tags print a dtype); KeyError if unknown."""
    if not isinstance(text, str) or not text.startswith("torch."):
        raise KeyError(text)
    return DTYPES[text.removeprefix("torch.")]


def from_torch(dtype: Any) -> DType:
    """The entry for a ``torch.dtype`` (``str(torch.float32) == "torch.float32"``)."""
    return DTYPES[str(dtype).removeprefix("torch.")]
