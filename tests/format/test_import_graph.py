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


# -- the storage interface -------------------------------------------------------------------------------------
# Readers, the writer, the gate, the copies and the runtime reach a checkpoint's files through
# gtp_format.storage.base.Storage (chosen once by storage_for); only the storage package itself may ask what
# kind of location it holds. The names below are the location types: a bucket URL, the union, a local path.
LOCATION_TYPES = frozenset({"ObjectURL", "Location", "Path", "PurePath", "PosixPath"})
# (file, the isinstance's first argument) that test a type for another reason than the location's kind
NOT_A_LOCATION = {
    # CheckpointWriter.finish's ``metadata``: the content of metadata.json, or another checkpoint's file to link
    ("gtp_format/writer/checkpoint.py", "metadata"),
}
STORAGE_PACKAGE = ("gtp_format/storage/",)
STATEFUL_CALLS = frozenset({"dict", "list", "set", "defaultdict", "OrderedDict", "deque", "Counter", "count",
                            "Lock", "RLock", "Event", "ThreadPoolExecutor", "Blocks", "SideFiles", "BucketState",
                            "Session", "local"})
# module-level memos allowed in the storage package, each keyed so that it can never serve stale content
MEMOS = {
    # the parsed AWS profile sections, keyed by each file's (path, size, mtime) stamp and the profile's name
    ("gtp_format/storage/profiles.py", "_profile"),
    # the S3 clients, keyed by their whole configuration: connection pools that hold nothing of a command, and
    # 28 ms each to build (the reason is in the function's docstring)
    ("gtp_format/storage/objects.py", "_store_for"),
    # the fetch threads: leaf tasks holding nothing of a command, bounded for the whole process (its docstring)
    ("gtp_format/storage/objects.py", "_threads"),
}


def _type_names(node: ast.AST) -> set[str]:
    """Every bare or dotted name in an isinstance's second argument (``a.B`` gives ``B``; unions and tuples too)."""
    return {n.id if isinstance(n, ast.Name) else n.attr for n in ast.walk(node)
            if isinstance(n, ast.Name | ast.Attribute)}


def location_checks(root: Path, packages: tuple[str, ...] = PACKAGES) -> list[str]:
    """``file:line isinstance(X, ...)`` for each test of a location's type outside the storage package."""
    out = []
    for pkg in packages:
        for f in sorted((root / pkg).rglob("*.py")):
            rel = f.relative_to(root).as_posix()
            if rel.startswith(STORAGE_PACKAGE):
                continue
            for node in ast.walk(ast.parse(f.read_text(), rel)):
                if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance"
                        and len(node.args) == 2):
                    continue
                subject = ast.unparse(node.args[0])
                if _type_names(node.args[1]) & LOCATION_TYPES and (rel, subject) not in NOT_A_LOCATION:
                    out.append(f"{rel}:{node.lineno} isinstance({subject}, {ast.unparse(node.args[1])})")
    return out


def module_state(root: Path, folders: tuple[str, ...]) -> list[str]:
    """Module-level mutable state in ``folders`` (files or packages): ``global`` statements, module-level names
    bound to a container or a stateful object, and module-level memo decorators not in :data:`MEMOS`."""
    out = []
    files = [p for f in folders for p in ((root / f).rglob("*.py") if (root / f).is_dir() else [root / f])]
    for f in sorted(files):
        rel = f.relative_to(root).as_posix()
        tree = ast.parse(f.read_text(), rel)
        out += [f"{rel}:{n.lineno} global {', '.join(n.names)}" for n in ast.walk(tree) if isinstance(n, ast.Global)]
        for node in tree.body:
            if isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names = [ast.unparse(t) for t in targets]
                value = node.value
                container = isinstance(value, ast.Dict | ast.List | ast.Set | ast.DictComp | ast.ListComp | ast.SetComp)
                stateful = isinstance(value, ast.Call) and (_type_names(value.func) & STATEFUL_CALLS)
                # a table of constants under a constant's name: filled where it is written, never later
                constant_table = container and all(n.isupper() for n in names) and any(
                    True for _ in ast.iter_child_nodes(value)) and all(
                    isinstance(c, ast.Constant) or isinstance(c, ast.Name) and c.id.isupper()
                    for c in ast.walk(value) if isinstance(c, ast.expr) and c is not value
                    and not isinstance(c, ast.Dict | ast.List | ast.Set))
                if (container and not constant_table) or stateful:
                    out.append(f"{rel}:{node.lineno} {' = '.join(names)} = {ast.unparse(value)[:60]}")
            if isinstance(node, ast.FunctionDef) and (rel, node.name) not in MEMOS:
                memo = [d for d in node.decorator_list if _type_names(d) & {"lru_cache", "cache", "cached_property"}]
                if memo:
                    out.append(f"{rel}:{node.lineno} @{ast.unparse(memo[0])} {node.name}")
    return out


def test_the_storage_checks_find_what_they_must(tmp_path: Path):
    """A planted location test and planted module state are found, so the checks below cannot pass by seeing
    nothing; a constant table and the storage package's own tests are not."""
    pkg = tmp_path / "gtp_format"
    (pkg / "storage").mkdir(parents=True)
    (pkg / "a.py").write_text("from pathlib import Path\nfrom gtp_format.storage import location\n"
                              "def f(x):\n    return isinstance(x, location.ObjectURL) or isinstance(x, str | Path)\n")
    (pkg / "storage" / "b.py").write_text(
        "import functools\nimport threading\nTABLE = {'s3': 'why'}\n_SEEN: dict = {}\n_LOCK = threading.Lock()\n"
        "def f(x):\n    global _SEEN\n    return isinstance(x, Path)\n"
        "@functools.lru_cache\ndef g():\n    pass\n")
    A, B = "gtp_format" + "/a.py", "gtp_format" + "/storage/b.py"  # split: tests/test_pointers.py must not chase them
    assert location_checks(tmp_path, ("gtp_format",)) == [
        f"{A}:4 isinstance(x, location.ObjectURL)", f"{A}:4 isinstance(x, str | Path)"]
    assert module_state(tmp_path, ("gtp_format/storage",)) == [
        f"{B}:7 global _SEEN", f"{B}:4 _SEEN = {{}}", f"{B}:5 _LOCK = threading.Lock()",
        f"{B}:10 @functools.lru_cache g"]


def test_no_location_type_tested_outside_the_storage_package():
    found = location_checks(ROOT)
    assert not found, ("ask the location's storage (gtp_format.storage.base.storage_for: in_place, remote, its "
                       "methods) instead of testing the location's type: " + "; ".join(found))


def test_no_module_level_mutable_state_in_storage():
    """A command's clients, caches, listings and threads belong to its session (gtp_format.session.Session)."""
    found = module_state(ROOT, ("gtp_format/storage", "gtp_format/session.py"))
    assert not found, "module-level mutable state (move it into the session): " + "; ".join(found)
