"""Damage made on purpose, for the integrity tests: one flipped bit at a known place of a copy.

Tests flip bits only in copies they made: a migrated folder's data files are hard links to SRC's,
so flipping in place there would damage the source (and the fixture it was copied from).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any


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


def truncate_once_planned(monkeypatch: Any, run: Path, victim: str) -> None:
    """``verify --data`` of ``run``: ``victim`` (a data file's name) cut to half its size right after its read
    plan is made, so that the reads find it shorter than when it was opened (a file that shrinks under a
    running verify)."""
    from gtp_format.check import data as data_check

    plan = data_check._FilePass.open_and_plan

    def plan_then_truncate(self: Any) -> list:
        steps = plan(self)
        if self.rel == victim:
            os.truncate(run / victim, (run / victim).stat().st_size // 2)
        return steps

    monkeypatch.setattr(data_check._FilePass, "open_and_plan", plan_then_truncate)
