"""The report of ``verify-roundtrip``: one row per check (and per rank where ranks compare).

A row adds up :meth:`gtp_format.compare.Tally.to_dict` summaries (from the ranks, as JSON, or
from the parent) and names the first difference in one phrase, which is what the command's
one-line error quotes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any

from gtp_format.progress import Progress

# ``progress(total, description, unit)`` -> a context yielding the phase's ``advance(n)``
# (:data:`gtp_format.progress.Progress`): a round trip has several phases (load and save, compare),
# each with its own bar; the command draws them (``ckpt_tool.output.progress``; unit "B" for bytes,
# else a plural noun), a library caller passes nothing.
ProgressBars = Callable[..., AbstractContextManager[Progress]]


@contextmanager
def no_progress(total: int, description: str, unit: str = "steps") -> Iterator[Progress]:
    yield lambda n: None


@dataclass
class Outcome:
    """A finished round trip: the JSON document (``doc["ok"]``, ``doc["checks"]``) and its title."""

    doc: dict[str, Any]
    title: str

    @property
    def failed(self) -> list[dict[str, Any]]:
        return [c for c in self.doc["checks"] if not c["ok"]]


MANIFEST = "manifest"  # code of a manifest field that changed in a re-save (beside the engine's codes)


def row(check: str, rank: int | str, summaries: list[tuple[int | None, dict[str, Any]]], unit: str = "tensors",
        expected: str = "") -> dict[str, Any]:
    """One check from one or more (rank, summary) pairs; ``unit`` says what ``keys``/``elements`` count."""
    keys = sum(s["keys"] for _, s in summaries)
    elements = sum(s["elements"] for _, s in summaries)
    differing = sum(s["differing"] for _, s in summaries)
    maxes = [s["max_abs_diff"] for _, s in summaries if s["max_abs_diff"] is not None]
    diffs = [(r, d) for r, s in summaries for d in s["diffs"]]
    first = None
    if diffs:
        r, d = diffs[0]
        where = f"rank {r}: " if r is not None and rank == "all" else ""
        what = d["detail"] or d["code"]
        first = f"{where}{what}" if d["code"] == MANIFEST else f"{where}{d['key']}: {what}"
    return {"check": check, "rank": rank, "ok": not diffs, "keys": keys, "elements": elements, "unit": unit,
            "differing_keys": len(diffs), "differing": differing, "max_abs_diff": max(maxes) if maxes else None,
            "first_difference": first, "expected": expected,
            "differences": [{"rank": r, **d} for r, d in diffs][:50]}
