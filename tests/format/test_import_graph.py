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
  module reaches that command's modules, so no other command can pull the runtime in;
* inside ``gtp_format`` arrows point down through :data:`LAYERS`, the list the doc states;
* no private name is imported (or reached as ``module._name``) across the packages' modules;
* the copy kernel ``ckpt_tool/copying/`` imports none of ``reshard/``, ``export/`` and ``hf/``, and
  ``reshard/`` and ``hf/`` do not import each other.
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


# --- The import rules of docs/architecture.md ("Import rules"): layers inside gtp_format, no private
# name across modules, the copy kernel under reshard, export and hf.

LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    # (name, module prefixes), bottom first; a module belongs to the layer of its longest matching prefix
    ("base", ("gtp_format", "gtp_format.errors", "gtp_format.names", "gtp_format.numbers", "gtp_format.sizes",
              "gtp_format.text", "gtp_format.hashing", "gtp_format.progress", "gtp_format.torch_adapter",
              "gtp_format.dtypes", "gtp_format.scan", "gtp_format.ranks", "gtp_format.work", "gtp_format.commit",
              "gtp_format.layout", "gtp_format.megatron.layout")),
    ("storage", ("gtp_format.storage", "gtp_format.session", "gtp_format.reader.preads", "gtp_format.reader.storage",
                 "gtp_format.safe_json")),
    ("manifest", ("gtp_format.manifest", "gtp_format.model", "gtp_format.integrity")),
    ("reader", ("gtp_format.reader", "gtp_format.lineage")),
    ("megatron", ("gtp_format.megatron",)),
    ("views", ("gtp_format.views", "gtp_format.load_plan", "gtp_format.compare", "gtp_format.megatron.view",
               "gtp_format.megatron.moe", "gtp_format.megatron.padding", "gtp_format.megatron.glu")),
    ("check", ("gtp_format.check",)),
    ("writer", ("gtp_format.writer",)),
    ("report", ("gtp_format.report",)),
)

UPWARD_ALLOWED: set[tuple[str, str]] = set()
PRIVATE_ALLOWED: set[tuple[str, str, str]] = set()
COPY_PACKAGES = ("ckpt_tool.copying", "ckpt_tool.reshard", "ckpt_tool.export", "ckpt_tool.hf")


def layer_of(module: str) -> int | None:
    best: tuple[int, int] | None = None  # (prefix length, layer)
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if _inside(module, (p,)) and (best is None or len(p) > best[0]):
                best = (len(p), i)
    return None if best is None else best[1]


def upward_imports(edges: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Every (importer, imported) pair inside gtp_format whose target sits in a higher layer."""
    out = []
    for m, ws in sorted(edges.items()):
        if not _inside(m, ("gtp_format",)):
            continue
        for w in sorted(ws):
            lm, lw = layer_of(m), layer_of(w)
            if _inside(w, ("gtp_format",)) and lm is not None and lw is not None and lw > lm:
                out.append((m, w))
    return out


def private_imports(root: Path, packages: tuple[str, ...] = PACKAGES) -> list[tuple[str, str, str]]:
    """(importer, module, name) for every ``from module import _name`` and ``module._name`` of another of
    the packages' modules (a dunder is no private name; other libraries' private names are theirs)."""
    mods = _modules(root, packages)
    out = []
    for m, path in mods.items():
        package = m.split(".") if path.name == "__init__.py" else m.split(".")[:-1]
        tree = ast.parse(path.read_text(), str(path))
        aliases: dict[str, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = package[:len(package) - node.level + 1] if node.level else []
                mod = ".".join([*base, *([node.module] if node.module else [])])
                for a in node.names:
                    if f"{mod}.{a.name}" in mods:
                        aliases[a.asname or a.name] = f"{mod}.{a.name}"
                    elif mod in mods and mod != m and a.name.startswith("_") and not a.name.startswith("__"):
                        out.append((m, mod, a.name))
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.asname and a.name in mods:
                        aliases[a.asname] = a.name
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and aliases[node.value.id] != m and node.attr.startswith("_")
                    and not node.attr.startswith("__")):
                out.append((m, aliases[node.value.id], node.attr))
    return sorted(set(out))


def test_the_rules_find_what_they_must(tmp_path: Path):
    """A planted upward arrow and planted private imports (by name and by attribute) are found."""
    # made-up modules (the names are split so that tests/test_pointers.py does not chase them)
    W, NAMES, ERRORS = "gtp_format" + ".writer.w", "gtp_format" + ".names", "gtp_format" + ".errors"
    pkg = tmp_path / "gtp_format"
    (pkg / "writer").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "writer" / "__init__.py").write_text("")
    (pkg / "writer" / "w.py").write_text("_made = 1\n")
    (pkg / "names.py").write_text(f"from {W} import _made\n")
    (pkg / "errors.py").write_text(f"from {W.rpartition('.')[0]} import w\nx = w._made\n")
    edges, _ = build_graph(tmp_path, ("gtp_format",))
    assert (NAMES, W) in upward_imports(edges)
    found = private_imports(tmp_path, ("gtp_format",))
    assert (NAMES, W, "_made") in found
    assert (ERRORS, W, "_made") in found


def test_every_gtp_format_module_has_a_layer(graph: tuple[dict[str, set[str]], dict[str, set[str]]]):
    edges, _ = graph
    lost = [m for m in sorted(edges) if _inside(m, ("gtp_format",)) and layer_of(m) is None]
    assert not lost, "modules in no layer of LAYERS (add them where they belong): " + ", ".join(lost)


def test_arrows_point_down_inside_gtp_format(graph: tuple[dict[str, set[str]], dict[str, set[str]]]):
    edges, _ = graph
    names = [n for n, _ in LAYERS]
    up = [f"{m} ({names[layer_of(m) or 0]}) imports {w} ({names[layer_of(w) or 0]})"
          for m, w in upward_imports(edges) if (m, w) not in UPWARD_ALLOWED]
    assert not up, "upward imports in gtp_format (move the shared part down): " + "; ".join(up)
    stale = [p for p in UPWARD_ALLOWED if p not in upward_imports(edges)]
    assert not stale, f"allowed upward imports that no longer exist (drop them from UPWARD_ALLOWED): {stale}"


def test_no_private_name_imported_across_modules():
    found = private_imports(ROOT)
    bad = [f"{m} uses {mod}.{n}" for m, mod, n in found if (m, mod, n) not in PRIVATE_ALLOWED]
    assert not bad, ("private names used across modules (make the name public where it is shared knowledge, "
                     "or move it to the module that owns the job): " + "; ".join(bad))
    stale = [p for p in PRIVATE_ALLOWED if p not in found]
    assert not stale, f"allowed private imports that no longer exist (drop them from PRIVATE_ALLOWED): {stale}"


def test_copy_kernel_is_below_reshard_export_and_hf(graph: tuple[dict[str, set[str]], dict[str, set[str]]]):
    edges, _ = graph

    def package(m: str) -> str | None:
        return next((p for p in COPY_PACKAGES if _inside(m, (p,))), None)

    kernel_up = [f"{m} imports {w}" for m, ws in sorted(edges.items()) if package(m) == "ckpt_tool.copying"
                 for w in sorted(ws) if package(w) not in (None, "ckpt_tool.copying")]
    assert not kernel_up, "the copy kernel imports a command's package: " + "; ".join(kernel_up)
    across = [f"{m} imports {w}" for m, ws in sorted(edges.items())
              for w in sorted(ws) if {package(m), package(w)} == {"ckpt_tool.reshard", "ckpt_tool.hf"}]
    assert not across, "reshard and hf import each other (share it through ckpt_tool.copying): " + "; ".join(across)
    pkgs = {p: {package(w) for m, ws in edges.items() if package(m) == p for w in ws} - {p, None}
            for p in COPY_PACKAGES}
    circles = [c for c in strongly_connected(pkgs) if len(c) > 1]  # type: ignore[arg-type]
    assert not circles, f"import circles among {COPY_PACKAGES}: {circles}"


def test_architecture_states_these_layers():
    """docs/architecture.md lists the layers this test enforces, in the same order and words."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = text.split("<!-- layers -->", 2)
    assert len(block) == 3, "docs/architecture.md: the layer list between two <!-- layers --> markers is missing"
    stated = [line.strip("` ").split(":", 1) for line in block[1].strip().strip("`").strip().splitlines()]
    want = [[name, " " + ", ".join(p.removeprefix("gtp_format.") if p != "gtp_format" else "gtp_format"
                                   for p in prefixes)] for name, prefixes in reversed(LAYERS)]
    assert stated == want, "the doc's layer list and LAYERS differ; change both together"

# -- the storage interface -------------------------------------------------------------------------------------
# Readers, the writer, the gate, the copies and the runtime reach a checkpoint's files through
# gtp_format.storage.base.Storage (chosen once by storage_for); only the storage package itself may ask what
# kind of location it holds. The names below are the location types: a bucket URL, the union, a local path.
LOCATION_TYPES = frozenset({"ObjectURL", "Location", "Path", "PurePath", "PosixPath",
                            # an opened file: its methods (size, pread, read_into, sparse_message, remote) answer
                            "ObjectFile", "LocalFile"})
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
    (pkg / "a.py").write_text("from pathlib import Path\nfrom gtp_format.storage import location, objects\n"
                              "def f(x):\n    return isinstance(x, location.ObjectURL) or isinstance(x, str | Path)\n"
                              "def g(f):\n    return isinstance(f, objects.ObjectFile)\n")
    (pkg / "storage" / "b.py").write_text(
        "import functools\nimport threading\nTABLE = {'s3': 'why'}\n_SEEN: dict = {}\n_LOCK = threading.Lock()\n"
        "def f(x):\n    global _SEEN\n    return isinstance(x, Path)\n"
        "@functools.lru_cache\ndef g():\n    pass\n")
    A, B = "gtp_format" + "/a.py", "gtp_format" + "/storage/b.py"  # split: tests/test_pointers.py must not chase them
    assert sorted(location_checks(tmp_path, ("gtp_format",))) == [
        f"{A}:4 isinstance(x, location.ObjectURL)", f"{A}:4 isinstance(x, str | Path)",
        f"{A}:6 isinstance(f, objects.ObjectFile)"]
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


# Where a reader or writer still asks its storage (or opened file) what kind it is (``.remote``, ``.in_place``)
# instead of calling a method: each file's count, and why the two kinds must differ there. A new branch fails
# the test below until it is a method of the storage or is counted here with its reason.
STORE_BRANCHES: dict[str, tuple[int, str]] = {
    "gtp_format/report.py": (1, "inspect lists a folder's hidden work folders; a bucket's writer leaves none"),
    "gtp_format/reader/locate.py": (3, "a folder's hidden copies are recovered and a bucket's are not (it commits "
                                       "last); a local path names a folder or a file, a prefix names neither"),
    "gtp_format/reader/boxes.py": (3, "remote: reads are round trips, planned and fetched ahead whole; a disk's "
                                      "page cache reads ahead already (a plan there only costs memory)"),
    "gtp_format/check/integrity.py": (1, "remote: more fill threads, each waits on a round trip"),
    "gtp_format/check/data.py": (2, "remote: windows of one request (PART) fetched by a plan; a local file is "
                                    "read through a descriptor in WINDOWs"),
    "gtp_format/writer/checkpoint.py": (3, "in_place: only a folder can replace an iteration (an exchange) and "
                                           "keep hidden copies for recovery; its work folder is named beside it"),
    "gtp_runtime/checkpoint/async_save.py": (1, "in_place: a folder's save ends at its rename; a bucket's "
                                                "starts its upload in the background"),
    "gtp_runtime/checkpoint/io.py": (2, "in_place: a folder's iteration is replaced, a bucket's never; the "
                                        "latest marker of a folder is read through its own open"),
    "ckpt_tool/copying/engine.py": (2, "remote: a bucket source's reads are prefetched by plan; the sizes shown "
                                       "are the listing's"),
    "ckpt_tool/copying/ranked.py": (3, "in_place: a bucket output is staged on each node (rank 0's folder is "
                                       "no other node's), its staged files read in full by the ranks before the "
                                       "upload, and its gate waits for the other nodes' verdicts"),
    "ckpt_tool/export/engine.py": (5, "remote: planned prefetch instead of read-ahead threads; sizes from the "
                                      "listing; a bucket's top level has no name for one object; in_place: an hf "
                                      "export staged for a bucket under torchrun hashes its weights files as "
                                      "written, for the ranks' read-back before the upload"),
    "ckpt_tool/hf/folder.py": (5, "a local folder refuses symlinks by name, in its own words; a store has none; "
                                  "the read-ahead hint is page-cache advice, which a store has none of"),
    "ckpt_tool/migrate/commit.py": (1, "DCP records a bucket output's URL as text, a folder's absolute path"),
    "ckpt_tool/migrate/plan.py": (1, "a local path is compared absolute; a URL as written"),
    "ckpt_tool/migrate/run.py": (1, "in_place: --in-place needs an atomic rename, which a bucket lacks"),
    "ckpt_tool/migrate/write.py": (2, "a folder's files are hard-linked; a bucket's objects are downloaded"),
}


def store_branches(root: Path, packages: tuple[str, ...] = PACKAGES) -> dict[str, int]:
    """``.remote`` and ``.in_place`` reads per file outside the storage package."""
    out: dict[str, int] = {}
    for pkg in packages:
        for f in sorted((root / pkg).rglob("*.py")):
            rel = f.relative_to(root).as_posix()
            if rel.startswith(STORAGE_PACKAGE):
                continue
            n = sum(1 for node in ast.walk(ast.parse(f.read_text(), rel))
                    if isinstance(node, ast.Attribute) and node.attr in ("remote", "in_place"))
            if n:
                out[rel] = n
    return out


def test_every_branch_on_the_kind_of_store_is_counted_with_its_reason():
    found = store_branches(ROOT)
    want = {f: n for f, (n, _) in STORE_BRANCHES.items()}
    assert found == want, ("branches on .remote/.in_place changed (move the difference behind a Storage or "
                           f"opened-file method, or count it in STORE_BRANCHES with its reason): {found} != {want}")
