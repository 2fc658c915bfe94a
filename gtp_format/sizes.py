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
# ASCII only: str patterns' \d also takes other scripts' digits ("\u0665GB" was read as 5 GB)
_SIZE = re.compile(r"\s*(\d{1,30}(?:\.\d{1,30})?)\s*([A-Za-z]*)\s*", re.ASCII)
MAX_SIZE = (1 << 63) - 1  # what a file offset (off_t) and torch's int64 sizes can hold


class SizeError(ValueError):
    """A size option's value that is not a size (the message is one line, in plain words)."""


def parse_size(text: str | int, minimum: int = 1) -> int:
    """Bytes of ``5GB``, ``512MiB``, ``1.5GiB`` or ``1000000``; :class:`SizeError` on anything else,
    on a size under ``minimum`` bytes, or over :data:`MAX_SIZE` (digits are capped at 30 before and 30
    after the point, so no text reaches Python's 4300-digit limit on ``int`` and raises past this)."""
    if isinstance(text, int) and text.bit_length() > 256:  # str() of an int over 4300 digits raises
        shown = f"an integer of {text.bit_length()} bits"
    else:  # an error line stays one short line
        shown = repr(str(text)[:60]) + ("..." if len(str(text)) > 60 else "")
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        m = _SIZE.fullmatch(str(text))
        unit = m.group(2) if m else ""
        if m is None or unit.lower() not in UNITS:
            raise SizeError(f"{shown} is not a size: write bytes (1000000) or a number with a unit "
                            "(5GB = 5*10^9 bytes, 512MiB = 512*2^20, 1.5GiB)")
        if len(unit) == 2 and unit.endswith("b"):  # HF: "5Gb" is gigabits; "5gib" is still GiB
            raise SizeError(f"{shown}: a lowercase b means bits in Hugging Face's sizes; write "
                            f"{_NAMES[unit.lower()]} for bytes")
        exact = Fraction(m.group(1)) * UNITS[unit.lower()]
        if exact.denominator != 1:  # "1.5" was read as 1 byte: a size is a whole number of bytes
            raise SizeError(f"{shown} is {float(exact):g} bytes, not a whole number of bytes; write whole bytes "
                            "(1500000) or a number that a unit makes whole (1.5MB)")
        value = int(exact)
    if value > MAX_SIZE:
        raise SizeError(f"{shown} is over 2^63 - 1 bytes, more than any file or memory can hold; write a "
                        "smaller size")
    if value < minimum:
        raise SizeError(f"{shown} is {value} bytes, less than the smallest allowed, {minimum} bytes")
    return value
