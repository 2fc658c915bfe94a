"""File checksums keyed by algorithm name, computed in 8 MiB blocks.

The manifest records ``files: {relative_path: {"size": n, "<algorithm>": "<hex>"}}``. Which
algorithm the writer picks is its business, so the verifier looks algorithms up by name here and
reports names it does not know instead of failing. Streaming keeps memory flat on multi-GB files.
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Callable
from typing import BinaryIO, Protocol

BLOCK = 8 << 20


class Hasher(Protocol):
    def update(self, data: bytes, /) -> None: ...

    def hexdigest(self) -> str: ...


class _Crc32:
    """zlib's CRC-32 behind the hashlib interface; hex is 8 lowercase digits."""

    def __init__(self) -> None:
        self._crc = 0

    def update(self, data: bytes, /) -> None:
        self._crc = zlib.crc32(data, self._crc)

    def hexdigest(self) -> str:
        return f"{self._crc:08x}"


HASHERS: dict[str, Callable[[], Hasher]] = {
    "sha256": hashlib.sha256,
    "crc32": _Crc32,
}


def file_digests(f: BinaryIO, algorithms: list[str]) -> dict[str, str]:
    """Hex digests of an open file for each known algorithm, reading it once."""
    hashers = {a: HASHERS[a]() for a in algorithms}
    while block := f.read(BLOCK):
        for h in hashers.values():
            h.update(block)
    return {a: h.hexdigest() for a, h in hashers.items()}
