"""The import graph of the three packages, built from their source: no circle in ``gtp_format``, arrows one way.

Why from the source (``ast``) and not from ``sys.modules`` after an import: a function-level import
only runs when its function does, so importing every module shows none of them, and those were
exactly how the circles hid (``manifest.py`` read its JSON through ``reader/locate.py`` inside
``read_manifest``; ``megatron.py`` imported ``params.py`` inside ``megatron_views``). Every import
statement counts here, at module level, inside functions and under ``if TYPE_CHECKING:``, and so
does ``importlib.import_module`` with a literal name.

What must hold (``docs/architecture.md``):

* no circle among ``gtp_format``'s modules: every strongly connected component has one module;
* ``gtp_format`` imports neither ``gtp_runtime`` nor ``ckpt_tool``;
* ``gtp_runtime`` never imports ``ckpt_tool``;
* ``ckpt_tool`` imports ``gtp_runtime`` only from the ``verify-roundtrip`` command
  (``ckpt_tool/commands/roundtrip.py`` and ``ckpt_tool/roundtrip/``), and no other ``ckpt_tool``
  module reaches that command's modules, so no other command can pull the runtime in.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("gtp_format", "gtp_runtime", "ckpt_tool")
VERIFY_ROUNDTRIP = ("ckpt_tool.commands.roundtrip", "ckpt_tool.roundtrip")


def _modules(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    out: dict[str, Path] = {}
    for pkg in packages:
        for f in sorted((root / pkg).rglob("*.py")):
            parts = list(f.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = f
    return out


def _imported_names(name: str, path: Path) -> set[str]:
    """Every dotted name the module imports (``from a import b`` gives ``a.b``), relative ones resolved."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            mod = ".".join([*base, *([node.module] if node.module else [])])
            out.add(mod)
            out.update(f"{mod}.{a.name}" for a in node.names)
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and ((isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
                   or (isinstance(node.func, ast.Name) and node.func.id in ("import_module", "__import__")))):
            out.add(node.args[0].value)
    return out


def build_graph(root: Path, packages: tuple[str, ...] = PACKAGES) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(edges between the packages' modules, every imported dotted name per module)."""
    mods = _modules(root, packages)
    edges: dict[str, set[str]] = {m: set() for m in mods}
    names: dict[str, set[str]] = {}
    for m, path in mods.items():
        names[m] = _imported_names(m, path)
        for target in names[m]:
            while target and target not in mods:  # ``a.b.Name`` is module ``a.b``
                target = target.rpartition(".")[0]
            if target and target != m:
                edges[m].add(target)
    return edges, names


def strongly_connected(edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's components, iteratively (a deep import chain must not hit the recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                out.append(sorted(comp))
    return out


def _inside(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _reach(edges: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for w in edges.get(todo.pop(), ()):
            if w not in seen:
                seen.add(w)
                todo.append(w)
    return seen


@pytest.fixture(scope="module")
def graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    return build_graph(ROOT)


def test_the_graph_finds_what_it_must(tmp_path: Path):
    """A planted circle through a function-level, a relative and a TYPE_CHECKING import is found,
    and so are the upward arrows, so the checks below cannot pass by seeing nothing."""
    # made-up modules (the names are split so that tests/test_pointers.py does not chase them)
    SUB, A, X = "gtp_format" + ".sub", "gtp_format" + ".a", "gtp_runtime" + ".x"
    pkg = tmp_path / "gtp_format"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text(f"def f():\n    from {SUB} import b\n")
    (pkg / "sub" / "b.py").write_text("from . import c\n")
    (pkg / "sub" / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                      f"    from {A} import f\n")
    (pkg / "d.py").write_text(f"import importlib\nimportlib.import_module('{X}')\n")
    edges, names = build_graph(tmp_path, ("gtp_format",))
    assert edges[A] == {SUB, f"{SUB}.b"}
    assert edges[f"{SUB}.b"] == {SUB, f"{SUB}.c"}
    assert [A, f"{SUB}.b", f"{SUB}.c"] in strongly_connected(edges)
    assert X in names["gtp_format" + ".d"]


def test_no_circle_in_gtp_format(graph: tuple[dict[str, set[str]], dict[str, set[str]]]):
    edges, _ = graph
    fmt = {m: {w for w in ws if _inside(w, ("gtp_format",))} for m, ws in edges.items() if _inside(m, ("gtp_format",))}
    circles = [c for c in strongly_connected(fmt) if len(c) > 1]
    assert not circles, "import circles in gtp_format (move the shared part below both): " + "; ".join(
        " <-> ".join(c) for c in circles)


def test_arrows_point_one_way(graph: tuple[dict[str, set[str]], dict[str, set[str]]]):
    _, names = graph
    up = [f"{m} imports {n}" for m, ns in sorted(names.items()) for n in sorted(ns)
          if (_inside(m, ("gtp_format",)) and _inside(n, ("gtp_runtime", "ckpt_tool")))
          or (_inside(m, ("gtp_runtime",)) and _inside(n, ("ckpt_tool",)))]
    assert not up, "imports against the package order ckpt_tool -> gtp_runtime -> gtp_format: " + "; ".join(up)


def test_only_verify_roundtrip_imports_the_runtime(graph: tuple[dict[str, set[str]], dict[str, set[str]]]):
    edges, names = graph
    cli = [m for m in names if _inside(m, ("ckpt_tool",))]
    direct = [f"{m} imports {n}" for m in sorted(cli) for n in sorted(names[m])
              if _inside(n, ("gtp_runtime",)) and not _inside(m, VERIFY_ROUNDTRIP)]
    assert not direct, "ckpt_tool imports gtp_runtime outside verify-roundtrip: " + "; ".join(direct)
    assert any(_inside(n, ("gtp_runtime",)) for m in cli if _inside(m, VERIFY_ROUNDTRIP) for n in names[m])
    through = [f"{m} reaches {sorted(w for w in _reach(edges, m) if _inside(w, VERIFY_ROUNDTRIP))[0]}"
               for m in sorted(cli) if not _inside(m, VERIFY_ROUNDTRIP)
               and any(_inside(w, VERIFY_ROUNDTRIP) for w in _reach(edges, m))]
    assert not through, "ckpt_tool modules that pull verify-roundtrip (and so the runtime) in: " + "; ".join(through)
