"""Every pointer in the docs and the code leads somewhere real.

Why: module moves left seven stale references behind (``tests/format/test_param_layout.py``,
``ckpt_tool.reshard.megatron``, ``bucket_size_from_manifest``...), and a newcomer who follows one
lands nowhere. A pointer is either a dotted module path (``gtp_format.check.gate.open_gated``) or a
repository file path (``gtp_format/check/gate.py``, optionally ``:name``), found in ``docs/``,
``README.md`` and every Python file of the packages, the tests and the benchmarks. It is resolved
statically (no import): the longest prefix that is a module file, then the next name must be
defined there (``def``, ``class``, an assignment or an import) and any further name must occur in it.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("gtp_format", "gtp_runtime", "ckpt_tool")
TOP_DIRS = (*PACKAGES, "tests", "docs", "scripts", "benchmarks", "fixtures")
DOTTED = re.compile(r"(?<![\w./-])((?:" + "|".join(PACKAGES) + r")(?:\.[A-Za-z_]\w*)+)")
PATH = re.compile(r"(?<![\w./-])((?:" + "|".join(TOP_DIRS) + r")/[\w./-]*\w)(?::(\w+))?")


def _sources() -> list[Path]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for top in (*PACKAGES, "tests", "benchmarks", "scripts"):
        files += sorted(p for p in (ROOT / top).rglob("*.py") if "_venv" not in p.parts)
    return [f for f in files if f != Path(__file__).resolve()]  # this file names stale pointers on purpose


@cache
def _text(path: Path) -> str:
    return path.read_text(errors="replace")


def _defines(module: Path, name: str) -> bool:
    text = _text(module)
    return re.search(rf"^\s*(?:async\s+)?(?:def|class)\s+{name}\b|^\s*{name}\s*(?::[^=\n]*)?=|"
                     rf"^\s*(?:\w+\s*,\s*)*{name}\s*(?:,\s*\w+\s*)*=|\bimport\b[^\n]*\b{name}\b|^\s+{name},$",
                     text, re.M) is not None


def _module_file(parts: list[str]) -> Path | None:
    base = ROOT.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def dotted_problem(pointer: str) -> str | None:
    """Why ``pointer`` (``pkg.module.name.attr``) leads nowhere, or None."""
    parts = pointer.split(".")
    if any(p.startswith("__") for p in parts):
        return None  # a module's own attributes (__path__, __version__)
    for cut in range(len(parts), 0, -1):
        module = _module_file(parts[:cut])
        if module is None:
            continue
        rest = parts[cut:]
        if not rest:
            return None
        if not _defines(module, rest[0]) and _module_file(parts[:cut + 1]) is None:
            return f"{'.'.join(parts[:cut])} defines no {rest[0]}"
        # an attribute of a name the module re-exports is defined beside it, in the same package
        package = [module] if module.name != "__init__.py" else sorted(module.parent.rglob("*.py"))
        missing = [r for r in rest[1:] if not any(re.search(rf"\b{r}\b", _text(f)) for f in package)]
        return f"{'.'.join(parts[:cut + 1])} has no {missing[0]}" if missing else None
    return f"no module {parts[0]}.{parts[1] if len(parts) > 1 else ''}"


# Paths a set-up script creates (ignored by git, absent from a fresh clone): pointers to them are real
# once the script ran (fixtures/megatron/setup_venv.sh makes the megatron-core venv).
GENERATED = ("fixtures/megatron/_venv",)


def path_problem(rel: str, name: str | None) -> str | None:
    """Why the repository path ``rel`` (and ``:name`` in it) leads nowhere, or None."""
    if any(c in rel for c in "*{}<>") or "XXXX" in rel or "NAME" in rel:
        return None  # a pattern or a placeholder, not a pointer
    if any(rel == g or rel.startswith(g + "/") for g in GENERATED):
        return None
    rel = rel.rstrip(".")
    path = ROOT / rel
    if not path.exists() and not any(path.parent.glob(path.name + ".*")):  # a file, or a dataset prefix
        return f"{rel} does not exist"
    if name is not None and path.is_file() and path.suffix == ".py" and not _defines(path, name):
        return f"{rel} defines no {name}"
    return None


def _pointers(path: Path) -> list[tuple[str, str]]:
    """(pointer, problem) for each broken pointer in the file."""
    text = _text(path)
    out = []
    for m in DOTTED.finditer(text):
        pointer = m.group(1).rstrip(".")
        problem = dotted_problem(pointer)
        if problem is not None:
            out.append((pointer, problem))
    for m in PATH.finditer(text):
        if text[m.end():m.end() + 1] in "*{<":
            continue  # the start of a pattern (fixtures/megatron/pair_*), not a path
        problem = path_problem(m.group(1), m.group(2))
        if problem is not None:
            out.append((m.group(0), problem))
    return out


SOURCES = _sources()


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_pointer_leads_somewhere(path: Path) -> None:
    broken = _pointers(path)
    assert not broken, "\n".join(f"{path.relative_to(ROOT)}: {p}: {why}" for p, why in broken)


def test_the_resolver_tells_real_pointers_from_stale_ones() -> None:
    assert dotted_problem("gtp_format.check.gate.open_gated") is None
    assert dotted_problem("gtp_format.manifest.Manifest.strict_error") is None
    assert dotted_problem("gtp_runtime.train") is None  # a module run with -m
    assert dotted_problem("ckpt_tool.reshard.megatron") is not None
    assert dotted_problem("gtp_format.manifest.bucket_size_from_manifest") is not None
    assert path_problem("gtp_format/check/gate.py", "open_gated") is None
    assert path_problem("tests/format/test_param_layout.py", None) is not None
    assert path_problem("gtp_format/check/gate.py", "no_such_name") is not None
