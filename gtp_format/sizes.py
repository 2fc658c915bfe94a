"""Sizes with units: the one parser of every size option, ``ckpt``'s and the launcher's.

Units as Hugging Face reads them (``max_shard_size="5GB"``): SI prefixes are powers of 1000, binary
ones (KiB, MiB, GiB, TiB) powers of 1024, a bare number is bytes. A lowercase ``b`` after a prefix
(``5Gb``) is refused, because HF reads it as bits. Torch-free, so the runtime (which never imports
the CLI) and ``ckpt`` read ``24GiB`` the same way; before, the launcher read ``24G`` as GiB and
``ckpt`` refused it.
"""

from __future__ import annotations

import re
from fractions import Fraction

UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_NAMES = {u.lower(): u for u in ("KB", "MB", "GB", "TB", "KiB", "MiB", "GiB", "TiB")}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*")


class SizeError(ValueError):
    """A size option's value that is not a size (the message is one line, in plain words)."""


def parse_size(text: str | int, minimum: int = 1) -> int:
    """Bytes of ``5GB``, ``512MiB``, ``1.5GiB`` or ``1000000``; :class:`SizeError` on anything else,
    or on a size under ``minimum`` bytes."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        m = _SIZE.fullmatch(str(text))
        unit = m.group(2) if m else ""
        if m is None or unit.lower() not in UNITS:
            raise SizeError(f"{str(text)!r} is not a size: write bytes (1000000) or a number with a unit "
                            "(5GB = 5*10^9 bytes, 512MiB = 512*2^20, 1.5GiB)")
        if len(unit) == 2 and unit.endswith("b"):  # HF: "5Gb" is gigabits; "5gib" is still GiB
            raise SizeError(f"{text!r}: a lowercase b means bits in Hugging Face's sizes; write "
                            f"{_NAMES[unit.lower()]} for bytes")
        value = int(Fraction(m.group(1)) * UNITS[unit.lower()])
    if value < minimum:
        raise SizeError(f"{text!r} is {value} bytes, less than the smallest allowed, {minimum} bytes")
    return value
