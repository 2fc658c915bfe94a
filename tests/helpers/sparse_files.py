"""Sparse files for tests: any size for free, which is exactly why readers must not trust sizes."""

from __future__ import annotations

from pathlib import Path


def grow_sparse(path: Path, size: int) -> int:
    """Grow ``path`` (created if absent) with holes to ``size`` bytes, or to the largest the
    filesystem allows (ext4 stops 4 KiB short of 16 TiB); returns the size reached."""
    path.touch()
    with open(path, "r+b") as f:
        while True:
            try:
                f.truncate(size)
                return size
            except OSError:
                size = size - 4096 if size % (1 << 30) == 0 else size // 2
