"""Damage made on purpose, for the integrity tests: one flipped bit at a known place of a copy.

Tests flip bits only in copies they made: a migrated folder's data files are hard links to SRC's,
so flipping in place there would damage the source (and the fixture it was copied from).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path


def flip(path: Path, pos: int, mask: int = 0x01) -> None:
    """XOR the byte at ``pos`` of ``path`` with ``mask``, in place."""
    with open(path, "r+b") as f:
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ mask]))


def flip_inside_a_chunk(folder: Path, in_file: Callable[[str], bool] = lambda name: True
                        ) -> tuple[str, int, str, int, int]:
    """Flip a bit in the middle of the first chunk (by key) of a file ``in_file`` accepts, as the
    checkpoint's own metadata places it; return that chunk's (key, index, file, start, stop)."""
    from gtp_format.reader.checkpoint import open_checkpoint

    ckpt = open_checkpoint(folder)
    e, c = next((e, c) for e in sorted(ckpt.entries.values(), key=lambda e: e.key) for c in e.chunks
                if c.storage is not None and in_file(c.storage.file) and c.storage.length > 64)
    s = c.storage
    flip(folder / s.file, s.offset + s.length // 2, 0x10)
    return e.key, c.index, s.file, s.offset, s.offset + s.length
