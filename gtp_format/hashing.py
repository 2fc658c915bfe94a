"""File checksums keyed by algorithm name, computed in 8 MiB blocks; CRC arithmetic (shift, combine).

The manifest records ``files: {relative_path: {"size": n, "<algorithm>": "<hex>"}}``. Which
algorithm the writer picks is its business, so the verifier looks algorithms up by name here and
reports names it does not know instead of failing. Streaming keeps memory flat on multi-GB files.
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, BinaryIO, Protocol

import google_crc32c

BLOCK = 8 << 20


class Hasher(Protocol):
    def update(self, data: bytes, /) -> None: ...

    def hexdigest(self) -> str: ...


class _CrcHasher:
    """A :class:`Crc` behind the hashlib interface; hex is 8 lowercase digits."""

    def __init__(self, crc: Crc) -> None:
        self._update, self._crc = crc.update, 0

    def update(self, data: bytes, /) -> None:
        self._crc = self._update(data, self._crc)

    def hexdigest(self) -> str:
        return f"{self._crc:08x}"


HASHERS: dict[str, Callable[[], Hasher]] = {
    "sha256": hashlib.sha256,
    "crc32": lambda: _CrcHasher(CRCS["crc32"]),
    "crc32c": lambda: _CrcHasher(CRCS["crc32c"]),
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


@dataclass(frozen=True)
class Crc:
    """A reflected 32-bit CRC with all-ones init and final XOR (CRC-32 and CRC-32C are both).

    ``update(data, crc)`` continues a running value; :meth:`shift` and :meth:`combine` are the
    GF(2) arithmetic that joins CRCs of pieces hashed separately (zlib's ``crc32_combine``,
    generalised to the polynomial), which is what lets the windows of one file be hashed on
    several threads at once.
    """

    name: str
    poly: int  # reflected polynomial
    update: Callable[[Any, int], int]

    def shift(self, nbytes: int) -> list[int]:
        """GF(2) operator taking the CRC of ``A`` to the register after ``nbytes`` more bytes.

        ``crc(A + B) == gf2_times(shift(len(B)), crc(A)) ^ crc(B)``; the operator is kept so that
        appending the same blob again costs 32 XORs.
        """
        return [self._advance(1 << n, nbytes) for n in range(32)]  # the image of each basis bit

    def combine(self, crc_a: int, crc_b: int, len_b: int) -> int:
        """CRC of ``A + B`` from ``crc(A)``, ``crc(B)`` and ``len(B)``: one operator per set bit (microseconds)."""
        return self._advance(crc_a, len_b) ^ crc_b

    def _advance(self, crc: int, nbytes: int) -> int:
        """The register ``crc`` after ``nbytes`` zero bytes: the operator for each set bit of ``nbytes``."""
        k = 0
        while nbytes:
            if nbytes & 1:
                crc = gf2_times(self._pow2(k), crc)
            nbytes >>= 1
            k += 1
        return crc

    def _pow2(self, k: int) -> list[int]:
        """The operator for ``2**k`` zero bytes, built once per polynomial."""
        table = _POW2_SHIFTS.setdefault(self.poly, [])
        if not table:
            op = [self.poly] + [1 << n for n in range(31)]  # one zero bit
            for _ in range(3):  # 8 zero bits
                op = gf2_square(op)
            for _ in range(64):
                table.append(op)
                op = gf2_square(op)
        return table[k]


_POW2_SHIFTS: dict[int, list[list[int]]] = {}


def _crc32c_update(data: Any, crc: int = 0) -> int:
    # google_crc32c takes only immutable bytes (and releases the GIL only for those, from 1 MiB)
    return google_crc32c.extend(crc, data if type(data) is bytes else bytes(data))


CRCS: dict[str, Crc] = {
    "crc32": Crc("crc32", 0xEDB88320, zlib.crc32),
    "crc32c": Crc("crc32c", 0x82F63B78, _crc32c_update),
}
