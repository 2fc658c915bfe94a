"""File checksums keyed by algorithm name, computed in 8 MiB blocks; CRC-32 arithmetic.

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


def gf2_times(mat: list[int], vec: int) -> int:
    out, i = 0, 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec >>= 1
        i += 1
    return out


def gf2_square(mat: list[int]) -> list[int]:
    return [gf2_times(mat, mat[n]) for n in range(32)]


def crc32_shift(nbytes: int) -> list[int]:
    """GF(2) operator taking a CRC-32 over ``A`` to the register after ``nbytes`` more bytes.

    ``crc32(A + B) == gf2_times(crc32_shift(len(B)), crc32(A)) ^ crc32(B)``: zlib's
    ``crc32_combine``, with the operator kept so that appending the same blob again costs 32 XORs.
    """
    odd = [0xEDB88320] + [1 << n for n in range(31)]  # one zero bit
    even = gf2_square(odd)
    odd = gf2_square(even)
    op = [1 << n for n in range(32)]
    n = nbytes
    while n:
        even = gf2_square(odd)
        if n & 1:
            op = [gf2_times(even, c) for c in op]
        n >>= 1
        if not n:
            break
        odd = gf2_square(even)
        if n & 1:
            op = [gf2_times(odd, c) for c in op]
        n >>= 1
    return op


_POW2_SHIFTS: list[list[int]] = []  # operator for 2**k zero bytes, k = 0, 1, ...


def crc32_combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """CRC-32 of ``A + B`` from ``crc32(A)``, ``crc32(B)`` and ``len(B)``, as zlib's ``crc32_combine``.

    It lets windows of one file be hashed on several threads at once. The operators for 2**k
    zero bytes are built once; shifting by ``len_b`` applies one per set bit (microseconds).
    """
    if not _POW2_SHIFTS:
        op = crc32_shift(1)
        for _ in range(64):
            _POW2_SHIFTS.append(op)
            op = gf2_square(op)
    k = 0
    while len_b:
        if len_b & 1:
            crc_a = gf2_times(_POW2_SHIFTS[k], crc_a)
        len_b >>= 1
        k += 1
    return crc_a ^ crc_b
