"""The format package imports without torch: the CLI's read-only commands and any tool may use it."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

BLOCK_TORCH = """
import importlib, pkgutil, sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is blocked in this test")
        return None
sys.meta_path.insert(0, Block())
import gtp_format
names = [m.name for m in pkgutil.walk_packages(gtp_format.__path__, "gtp_format.")]
for name in names:
    importlib.import_module(name)
assert "torch" not in sys.modules
print(len(names))
"""


def test_every_format_module_imports_with_torch_blocked():
    proc = subprocess.run([sys.executable, "-c", BLOCK_TORCH], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert int(proc.stdout.strip()) >= 20  # the probe really walked the package


def test_the_probe_can_fail():
    """The same probe on a module that imports torch fails, so a pass above means something."""
    code = BLOCK_TORCH.replace("import gtp_format\n", "import gtp_format\nimport gtp_runtime.checkpoint.io\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "torch is blocked" in proc.stderr


ADAPTER = "gtp_format/torch_adapter.py"


def torch_imports(source: str, path: str = "<source>") -> list[int]:
    """Lines that import torch (any submodule, at any depth: module level or inside a function),
    by statement or by a literal ``importlib.import_module``/``__import__`` call."""
    lines = []
    for node in ast.walk(ast.parse(source, path)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and ((isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
                   or (isinstance(node.func, ast.Name) and node.func.id in ("import_module", "__import__")))):
            names = [node.args[0].value]
        if any(n == "torch" or n.startswith("torch.") for n in names):
            lines.append(node.lineno)
    return lines


def test_only_the_adapter_imports_torch():
    """Every torch touch in gtp_format goes through gtp_format/torch_adapter.py (load_torch)."""
    found = {str(f.relative_to(REPO)): torch_imports(f.read_text(), str(f))
             for f in sorted((REPO / "gtp_format").rglob("*.py"))}
    assert found.pop(ADAPTER), "the adapter itself imports torch"
    elsewhere = [f"{f}:{line}" for f, lines in found.items() for line in lines]
    assert not elsewhere, f"torch imported outside {ADAPTER} (use gtp_format.torch_adapter.load_torch): {elsewhere}"


def test_the_torch_scan_sees_every_form():
    source = ("import os\nimport torch.distributed as dist\nfrom torch import nn\n"
              "def f():\n    import torch\n    from torch.serialization import safe_globals\n"
              "    import importlib\n    importlib.import_module('torch.nn')\n    __import__('torch')\n"
              "import torchvision\nfrom torchlike import x\n")
    assert torch_imports(source) == [2, 3, 5, 6, 8, 9]
