"""A ``torch.save`` file of a dict of tensors, written as the tensors' bytes arrive, without torch.

Why: ``ckpt export --to torch`` held every tensor in memory and then called ``torch.save``, so its
local work (``import torch``, the serialisation, torch's own CRC-32 pass) came after the whole read
instead of beside it: from a bucket, 0.64-0.71x boto3's download of the same objects at 304.8 MB
(docs/performance.md, "Checkpoints on a bucket"), and never more than ``--max-memory`` of state.
Written here, ``data.pkl`` needs only the keys, dtypes and shapes, so it goes first, then each
tensor's record as its bytes come, in the order the source stores them: memory is a few slices,
whatever the model's size.

The layout is :mod:`gtp_format.writer.torch_blob`'s (PyTorch 2.x ``PyTorchStreamWriter``: stored
records, 64-byte aligned data, data descriptors, zip64 end records), with ``data.pkl`` a protocol-2
pickle of a ``dict`` (the output's key order) of ``_rebuild_tensor_v2`` / ``_v3`` reductions whose
storages are ``data/0``, ``data/1``, ... in the order they are written. A record or offset at or
past 4 GiB gets zip64 fields (sizes and offset in the central directory's extra field, an 8-byte
data descriptor), as a file of a model of tens of GB needs. ``tests/format/test_torch_file.py``
loads what this writes with ``torch.load(weights_only=True)`` and Python's ``zipfile`` (which checks
every CRC-32).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from gtp_format.dtypes import DType
from gtp_format.hashing import CRCS, crc32
from gtp_format.writer.torch_blob import Pickle2, ZipBuilder, tensor_reduce

_BATCH = 1000  # items per SETITEMS, as pickle batches them


def state_pkl(tensors: list[tuple[str, DType, tuple[int, ...]]], storage_keys: list[str],
              objects: list[tuple[str, bytes]] = ()) -> bytes:  # type: ignore[assignment]
    """``data.pkl`` of ``{key: tensor}`` in this order; tensor ``i``'s storage is ``data/<storage_keys[i]>``.
    ``objects``: (key, value) after the tensors, each value a protocol-2 pickle body without PROTO, STOP
    or memo opcodes (``ckpt_tool.export.torch_objects.fragment``), placed as it is."""
    p = Pickle2()
    p.out += b"}"
    p.put()
    items: list[Any] = [*zip(tensors, storage_keys), *objects]
    for at in range(0, len(items), _BATCH):
        p.out += b"("
        for item in items[at:at + _BATCH]:
            if isinstance(item[1], bytes):
                p.str(item[0])
                p.out += item[1]
            else:
                (key, dtype, sizes), sk = item
                p.str(key)
                tensor_reduce(p, dtype, sizes, sk)
        p.out += b"u"
    p.out += b"."
    return bytes(p.out)


class TorchStateFile(ZipBuilder):
    """Write ``{key: tensor}`` as ``torch.save`` does, streamed through ``write`` (a list of bytes-like).

    ``tensors``: (key, dtype, shape) in the dict's order; ``order``: the indices of ``tensors`` in
    the order their bytes will be given. Call :meth:`begin`, then for each tensor in ``order``
    :meth:`start`, :meth:`data` (its bytes, C order, in any number of pieces) and :meth:`end`, then
    :meth:`finish`. A tensor given more or fewer bytes than its shape holds is refused (ValueError).
    ``objects``: non-tensor values after the tensors (see :func:`state_pkl`).
    """

    def __init__(self, write: Callable[[list[Any]], None], tensors: list[tuple[str, DType, tuple[int, ...]]],
                 order: list[int], serialization_id: str | None = None, zip64: bool = False,
                 objects: list[tuple[str, bytes]] = ()) -> None:  # type: ignore[assignment]
        super().__init__(zip64=zip64)
        if sorted(order) != list(range(len(tensors))):
            raise ValueError("order must name every tensor once")
        self._write, self._tensors, self._order = write, tensors, order
        keys = [""] * len(tensors)
        for n, i in enumerate(order):
            keys[i] = str(n)
        self._pkl = state_pkl(tensors, keys, list(objects))
        self._sid = serialization_id.encode() if serialization_id else None
        self._next = 0  # position in ``order`` of the tensor to start
        self._left = -1  # bytes the open tensor still needs; -1 when none is open
        self._crc = 0

    def _nbytes(self, i: int) -> int:
        _, dtype, sizes = self._tensors[i]
        return dtype.itemsize * math.prod(sizes)

    def begin(self) -> None:
        out = bytearray()
        for name, data in (("data.pkl", self._pkl), (".format_version", b"1"), (".storage_alignment", b"64"),
                           ("byteorder", b"little")):
            out += self._whole(name, data)
        self._write([out])

    def start(self) -> str:
        """Open the next tensor's record; its key."""
        if self._left >= 0 or self._next >= len(self._order):
            raise ValueError("start() with a tensor open, or after the last one")
        i = self._order[self._next]
        self._next += 1
        self._left, self._crc = self._nbytes(i), 0
        self._write([self._local(f"data/{self._next - 1}")])
        return self._tensors[i][0]

    def data(self, parts: list[Any], crc: int | None = None) -> None:
        """The open tensor's next bytes. ``crc``: their CRC-32, when the caller hashed them already (on the
        threads that read them: zlib's CRC-32 is 1.7 GB/s here, a serial pass on the one thread that writes)."""
        views = [memoryview(p).cast("B") for p in parts]
        n = sum(v.nbytes for v in views)
        if n > self._left:
            raise ValueError(f"{n} bytes given where the tensor needs {self._left} more")
        if crc is not None:
            self._crc = CRCS["crc32"].combine(self._crc, crc, n)
        else:
            for v in views:
                self._crc = crc32(v, self._crc)
        self._left -= n
        self._write(views)

    def end(self) -> None:
        if self._left != 0:
            raise ValueError(f"the tensor's record ended {self._left} bytes short")
        i = self._order[self._next - 1]
        self._write([self._descriptor(self._crc, self._nbytes(i))])
        self._left = -1

    def finish(self) -> None:
        if self._left >= 0 or self._next != len(self._order):
            raise ValueError("finish() before every tensor was written")
        version = self._whole("version", b"3\n")
        self._write([version + self._whole(".data/serialization_id", self._sid or self._content_id())
                     + self._directory()])

    def _content_id(self) -> bytes:
        """40 digits from the records written so far: their CRC-32s folded with ``c10::hash_combine``
        (20 digits; PyTorch 2.13's ``torch.save`` writes this same fold as the last 20 digits of its
        id), then their count (20). The same checkpoint exports to the same bytes."""
        h = 0
        for _, _, crc, _ in self._records:
            h = (h ^ (crc + 0x9E3779B9 + (h << 6) + (h >> 2))) & 0xFFFFFFFFFFFFFFFF
        return f"{h:020d}{len(self._records):020d}".encode()
