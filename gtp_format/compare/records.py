"""What a comparison finds: one :class:`Difference` record per finding, with a stable code.

Like ``ckpt verify``'s :class:`gtp_format.model.Problem`, a comparison never stops at the first
difference and never raises for one: it returns records that scripts match on by ``code`` and
people read by ``detail``. The codes are the contract; the wording of ``detail`` may change.

:class:`Tally` adds records up (keys, elements, differing elements, the largest finite
``|a - b|``); ``diff``, ``verify-roundtrip`` and the runtime's per-rank snapshot checks all report
through it, so "3 of 4096 elements differ, max 0.5" means the same thing everywhere.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

# Stable codes. Key sets:
ONLY_IN_A = "only_in_a"
ONLY_IN_B = "only_in_b"
# Metadata of a key present on both sides (values are not compared after one of these):
KIND = "kind"  # a tensor on one side, a byte object on the other
SHAPE = "shape"  # global shape
DTYPE = "dtype"
# Layout, reported only when asked for (a resharded copy legitimately cuts tensors differently):
CHUNKS = "chunks"
# Contents:
VALUES = "values"  # tensor elements (bitwise, or outside the tolerance)
OBJECT = "object"  # a byte object (stored bytes, or the decoded object)

CODES = (ONLY_IN_A, ONLY_IN_B, KIND, SHAPE, DTYPE, CHUNKS, VALUES, OBJECT)
KEY_SET_CODES = frozenset({ONLY_IN_A, ONLY_IN_B})
METADATA_CODES = frozenset({KIND, SHAPE, DTYPE})
CONTENT_CODES = frozenset({VALUES, OBJECT})


@dataclass(frozen=True)
class Difference:
    """One way one key differs between side A and side B.

    ``a`` and ``b`` describe each side for metadata codes (a shape as a list, a dtype or kind as a
    string, a chunk count). For ``values``: ``numel`` elements were compared, ``differing`` of them
    differ, ``max_abs_diff`` is the largest finite ``|a - b|`` among those (``None`` when every
    differing pair has a NaN or an infinity), and ``first_index`` is the first differing element's
    index in the global tensor (row-major order).
    """

    code: str
    key: str
    detail: str = ""
    a: Any = None
    b: Any = None
    numel: int = 0
    differing: int = 0
    max_abs_diff: float | None = None
    first_index: tuple[int, ...] | None = None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["first_index"] = list(self.first_index) if self.first_index is not None else None
        return d


def fmt_index(index: tuple[int, ...]) -> str:
    """An element index as people write it: ``5`` in a vector, ``[2, 3]`` in a matrix."""
    return str(index[0]) if len(index) == 1 else str(list(index))


@dataclass(frozen=True)
class KeyResult:
    """Everything found about one key. ``numel`` is side A's element count (0 for a key only in B),
    ``chunks`` its chunk count; no differences means equal under the rule used."""

    key: str
    numel: int
    chunks: int
    differences: tuple[Difference, ...] = ()
    # values that differ only in alignment padding (megatron-core's uninitialised bucket gaps): reported
    # apart and not a difference, since they belong to no parameter
    padding: Difference | None = None

    @property
    def ok(self) -> bool:
        return not self.differences

    def codes(self) -> set[str]:
        return {d.code for d in self.differences}


@dataclass
class Tally:
    """A running total over keys: how many, how many elements, what differed."""

    keys: int = 0
    elements: int = 0
    differing: int = 0
    max_abs_diff: float | None = None
    differences: list[Difference] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.differences

    def add(self, numel: int, differences: Iterable[Difference] = ()) -> None:
        """Count one key of ``numel`` elements and whatever differed in it."""
        self.keys += 1
        self.elements += numel
        for d in differences:
            self.differences.append(d)
            self.differing += d.differing
            if d.max_abs_diff is not None:
                self.max_abs_diff = max(self.max_abs_diff or 0.0, d.max_abs_diff)

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "keys": self.keys, "elements": self.elements, "differing": self.differing,
                "max_abs_diff": self.max_abs_diff, "diffs": [d.to_dict() for d in self.differences]}


@dataclass
class Report:
    """The result of one comparison: one :class:`KeyResult` per selected key, in key order."""

    results: list[KeyResult] = field(default_factory=list)
    rule: str = ""  # how values were compared, for the reader of a report

    def __iter__(self) -> Iterator[KeyResult]:
        return iter(self.results)

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.results)

    @property
    def only_in_a(self) -> list[str]:
        return [r.key for r in self.results if ONLY_IN_A in r.codes()]

    @property
    def only_in_b(self) -> list[str]:
        return [r.key for r in self.results if ONLY_IN_B in r.codes()]

    @property
    def common(self) -> list[KeyResult]:
        """Results of the keys present on both sides."""
        return [r for r in self.results if not r.codes() & KEY_SET_CODES]

    def differences(self, codes: Iterable[str] = CODES) -> list[Difference]:
        wanted = set(codes)
        return [d for r in self.results for d in r.differences if d.code in wanted]

    def tally(self) -> Tally:
        t = Tally()
        for r in self.results:
            t.add(r.numel, r.differences)
        return t
