"""Which keys a comparison looks at: ``--keys GLOB`` and ``--ignore GLOB``, each repeatable.

A key is selected when it matches one of the ``keys`` globs (or there are none) and none of the
``ignore`` globs: ignore wins. Globs are :func:`fnmatch.fnmatchcase` patterns on the whole key
name, case-sensitive like the keys themselves (``*`` also crosses dots), the same matching as
``ckpt inspect --keys``.

A selection that matches no key at all is refused rather than reported as "identical": a typo in
a glob must not turn a comparison into a silent pass.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase

from gtp_format.errors import EXIT_BAD_INPUT, FormatError


@dataclass(frozen=True)
class KeyFilter:
    """A predicate on key names (picklable: ranks receive it whole)."""

    keys: tuple[str, ...] = ()
    ignore: tuple[str, ...] = ()

    @classmethod
    def of(cls, keys: Sequence[str] | None = None, ignore: Sequence[str] | None = None) -> KeyFilter:
        return cls(tuple(keys or ()), tuple(ignore or ()))

    def __call__(self, key: str) -> bool:
        if self.keys and not any(fnmatchcase(key, g) for g in self.keys):
            return False
        return not any(fnmatchcase(key, g) for g in self.ignore)

    @property
    def everything(self) -> bool:
        return not self.keys and not self.ignore

    def describe(self) -> str:
        """The selection as the command line spells it (empty when everything is selected)."""
        return " ".join([*(f"--keys {g!r}" for g in self.keys), *(f"--ignore {g!r}" for g in self.ignore)])

    def to_dict(self) -> dict[str, list[str]]:
        return {"keys": list(self.keys), "ignore": list(self.ignore)}

    def require_match(self, *key_sets: Iterable[str], where: str = "either checkpoint") -> None:
        """Raise (exit 2) when the selection is not everything and matches no key of ``key_sets``."""
        if self.everything or any(self(k) for keys in key_sets for k in keys):
            return
        raise FormatError(f"{self.describe()} matches no key of {where}; list the keys with "
                          "'ckpt inspect PATH --keys GLOB' and fix the globs", EXIT_BAD_INPUT)


EVERYTHING = KeyFilter()
