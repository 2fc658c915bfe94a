"""The format package imports without torch: the CLI's read-only commands and any tool may use it."""

from __future__ import annotations

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
