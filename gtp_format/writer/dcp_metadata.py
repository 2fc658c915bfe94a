"""DCP's ``.metadata`` (a pickled ``torch.distributed.checkpoint.metadata.Metadata``), without torch.

What ``FileSystemWriter.finish`` pickles, object for object: ``Metadata(state_dict_metadata,
planner_data, storage_data)`` (``storage_meta`` and ``version`` None) with a
``TensorStorageMetadata`` per key (``TensorProperties`` pickled through its ``__getstate__``
tuple: the dtype, ``torch.serialization._get_layout('torch.strided')``, ``requires_grad`` False,
``_MEM_FORMAT_ENCODING(0)``, ``pin_memory`` False), a ``ChunkStorageMetadata`` per chunk, and
``storage_data`` mapping ``MetadataIndex(fqn, offset)`` to ``_StorageInfo(relative_path, offset,
length)`` (no ``transform_descriptors``: DCP leaves the field out when there are none);
``torch.Size`` pickles as ``torch.Size((...,))``.

Why the opcodes are emitted here rather than by :mod:`pickle`: the pickler writes a class only
after importing its module (torch), and the standard library's pure-Python pickler, taught to
skip that, took 12 s for 20,000 chunks. The protocol-4 opcodes below are the ones ``pickle``
writes for these objects; each global is memoized on first use and fetched after, as ``pickle``
does, and framing (optional for a reader) is left out. ``tests/format/test_dcp_metadata.py``
unpickles the result with torch and compares it with the same ``Metadata`` built from torch's
classes, and ``torch.distributed.checkpoint`` loads a checkpoint written with it.
"""

from __future__ import annotations

import pickle
import struct
from collections.abc import Iterable

from gtp_format.dtypes import DType

_MD = "torch.distributed.checkpoint.metadata"
P = pickle


class _Emitter:
    """Protocol-4 opcodes into a list of byte strings, with a memo for globals."""

    def __init__(self) -> None:
        self.out: list[bytes] = [P.PROTO + b"\x04"]
        self.memo: dict[object, int] = {}

    def memoize(self, key: object) -> None:
        self.memo[key] = len(self.memo)
        self.out.append(P.MEMOIZE)

    def get(self, key: object) -> bool:
        """Fetch a memoized value; False when it was never memoized."""
        i = self.memo.get(key)
        if i is None:
            return False
        self.out.append(P.BINGET + bytes((i,)) if i < 256 else P.LONG_BINGET + struct.pack("<I", i))
        return True

    def str(self, s: str) -> None:
        raw = s.encode("utf-8", "surrogatepass")
        n = len(raw)
        head = P.SHORT_BINUNICODE + bytes((n,)) if n < 256 else P.BINUNICODE + struct.pack("<I", n)
        self.out.append(head + raw)

    def int(self, v: int) -> None:
        if 0 <= v < 256:
            self.out.append(P.BININT1 + bytes((v,)))
        elif 0 <= v < 65536:
            self.out.append(P.BININT2 + struct.pack("<H", v))
        elif -(1 << 31) <= v < (1 << 31):
            self.out.append(P.BININT + struct.pack("<i", v))
        else:
            raw = v.to_bytes((v.bit_length() + 8) // 8, "little", signed=True)
            self.out.append(P.LONG1 + bytes((len(raw),)) + raw)

    def glob(self, module: str, name: str) -> None:
        if not self.get((module, name)):
            self.str(module)
            self.str(name)
            self.out.append(P.STACK_GLOBAL)
            self.memoize((module, name))

    def tuple_of_ints(self, values: tuple[int, ...]) -> None:
        if len(values) > 3:
            self.out.append(P.MARK)
        for v in values:
            self.int(v)
        self.out.append({0: P.EMPTY_TUPLE, 1: P.TUPLE1, 2: P.TUPLE2, 3: P.TUPLE3}.get(len(values), P.TUPLE))

    def size(self, values: tuple[int, ...]) -> None:
        """``torch.Size(values)``: ``REDUCE(torch.Size, (values,))``."""
        self.glob("torch", "Size")
        self.tuple_of_ints(tuple(values))
        self.out.append(P.TUPLE1 + P.REDUCE)

    def new(self, module: str, name: str) -> None:
        """``cls.__new__(cls)``, to be followed by a state and ``BUILD``."""
        self.glob(module, name)
        self.out.append(P.EMPTY_TUPLE + P.NEWOBJ)

    def field(self, name: str) -> None:
        self.str(name)


def metadata_bytes(shapes: dict[str, tuple[tuple[int, ...], DType]],
                   placed: Iterable[tuple[str, str, tuple[int, ...] | None, tuple[int, ...] | None, int, int]],
                   objects: Iterable[str] = ()) -> bytes:
    """The pickled ``Metadata`` of tensors ``shapes`` (key -> global shape, dtype), whose chunks are
    ``placed`` as ``(file, key, offsets, sizes, byte offset, byte length)``, in that order, and of
    the byte objects ``objects`` (a ``BytesStorageMetadata`` each; placed with offsets ``None``, as
    DCP indexes a byte object by its name alone)."""
    placed = list(placed)
    objects = list(objects)
    by_key: dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]] = {k: [] for k in shapes}
    for _, key, offsets, sizes, _, _ in placed:
        if key in by_key and offsets is not None and sizes is not None:
            by_key[key].append((offsets, sizes))
    e = _Emitter()
    e.new(_MD, "Metadata")
    e.out.append(P.EMPTY_DICT + P.MARK)
    e.field("state_dict_metadata")
    e.out.append(P.EMPTY_DICT)
    for key, (shape, dt) in shapes.items():
        e.out.append(P.MARK)
        e.str(key)
        e.memoize(("key", key))
        e.new(_MD, "TensorStorageMetadata")
        e.out.append(P.EMPTY_DICT + P.MARK)
        e.field("properties")
        e.new(_MD, "TensorProperties")
        e.out.append(P.MARK)
        e.glob("torch", dt.name)
        e.glob("torch.serialization", "_get_layout")
        e.str("torch.strided")
        e.out.append(P.TUPLE1 + P.REDUCE + P.NEWFALSE)
        e.glob(_MD, "_MEM_FORMAT_ENCODING")
        e.int(0)
        e.out.append(P.TUPLE1 + P.REDUCE + P.NEWFALSE + P.TUPLE + P.BUILD)
        e.field("size")
        e.size(shape)
        e.field("chunks")
        e.out.append(P.EMPTY_LIST + P.MARK)
        for offsets, sizes in by_key[key]:
            e.new(_MD, "ChunkStorageMetadata")
            e.out.append(P.EMPTY_DICT + P.MARK)
            e.field("offsets")
            e.size(offsets)
            e.field("sizes")
            e.size(sizes)
            e.out.append(P.SETITEMS + P.BUILD)
        e.out.append(P.APPENDS + P.SETITEMS + P.BUILD + P.SETITEMS)  # chunks, TSM state, TSM, sdm[key]
    for key in objects:  # BytesStorageMetadata has no fields: pickle writes no state for it
        e.out.append(P.MARK)
        e.str(key)
        e.memoize(("key", key))
        e.new(_MD, "BytesStorageMetadata")
        e.out.append(P.SETITEMS)
    e.field("planner_data")
    e.out.append(P.EMPTY_DICT)
    for key in [*shapes, *objects]:
        e.out.append(P.MARK)
        e.get(("key", key))
        e.get(("key", key))
        e.out.append(P.TUPLE1 + P.SETITEMS)
    e.field("storage_data")
    e.out.append(P.EMPTY_DICT)
    for file, key, offsets, _, at, length in placed:
        e.out.append(P.MARK)
        e.new(_MD, "MetadataIndex")
        e.out.append(P.EMPTY_DICT + P.MARK)
        e.field("fqn")
        e.get(("key", key))
        e.field("index")
        e.out.append(P.NONE)
        e.field("offset")
        if offsets is None:
            e.out.append(P.NONE)
        else:
            e.size(offsets)
        e.out.append(P.SETITEMS + P.BUILD)
        e.new("torch.distributed.checkpoint.filesystem", "_StorageInfo")
        e.out.append(P.EMPTY_DICT + P.MARK)
        e.field("relative_path")
        if not e.get(("file", file)):
            e.str(file)
            e.memoize(("file", file))
        e.field("offset")
        e.int(at)
        e.field("length")
        e.int(length)
        e.out.append(P.SETITEMS + P.BUILD + P.SETITEMS)
    e.field("storage_meta")
    e.out.append(P.NONE)
    e.field("version")
    e.out.append(P.NONE + P.SETITEMS + P.BUILD + P.STOP)
    return b"".join(e.out)
