"""Compile a loop with numba, cached on disk wherever a cache can be written.

Why: numba keeps compiled loops beside their source (``__pycache__``) and, where that is read-only
(an install owned by root, run by a user), in the user's cache folder. Where neither can be written
(no home, a read-only home), ``njit(cache=True)`` raises and each process compiled its loops anew:
the metadata pre-walk alone took 1.6 s to compile on the 16-core H100 host, a tenth of a 1M-chunk
``inspect``. :func:`njit_cached` then points numba at a private folder of this user's in the
temporary directory (created mode 0700 and used only if this user owns it and no one else may
write to it: numba's cache files are pickles, and loading one planted by another user would run
its code), and compiles without a cache only where even that fails.

:func:`compiled_on_disk` says whether a loop's compiled code is already in that cache for this machine, so
a caller can take a compiled path only where it pays: compiling the DCP metadata scan costs 14-18 s (the
2-core machine, the 16-core host), far more than it saves on one file of a few hundred MB.

The folder is numba's process-wide setting (``numba.config.CACHE_DIR``), set only in that last
case and only where the user set none (``NUMBA_CACHE_DIR``): every cached loop of the process then
shares it.
"""

from __future__ import annotations

import os
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


def njit_cached(fn: Callable[..., Any], **options: Any) -> Any:
    """``numba.njit(cache=True, **options)(fn)``, with a private cache folder where numba finds none."""
    from numba import config, njit

    try:
        return njit(cache=True, **options)(fn)
    except RuntimeError:  # no locator could write beside the source or in the user's cache folder
        pass
    folder = None if getattr(config, "CACHE_DIR", "") else private_cache_dir()
    if folder is not None:
        config.CACHE_DIR = str(folder)
        try:
            return njit(cache=True, **options)(fn)
        except RuntimeError:
            pass
    return njit(cache=False, **options)(fn)


def private_cache_dir() -> Path | None:
    """``$TMPDIR/gtp-ckpt-numba-<uid>``, made if missing; ``None`` unless this user owns it, it is a real
    folder (not a link) and only its owner may write to it."""
    folder = Path(tempfile.gettempdir()) / f"gtp-ckpt-numba-{os.getuid()}"
    try:
        folder.mkdir(mode=0o700, exist_ok=True)
        st = os.lstat(folder)
    except OSError:
        return None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return None
    return folder


def compiled_on_disk(dispatcher: Any) -> bool:
    """Whether numba's disk cache holds ``dispatcher``'s loop compiled for this machine's CPU, fresh for its
    source (numba drops an index whose source file changed). Reads numba's cache index, which is not a
    public interface: anything unexpected there answers ``False`` (the caller then treats the loop as
    not compiled), never an error."""
    try:
        index = dispatcher._cache._cache_file._load_index()
        magic = dispatcher.targetctx.codegen().magic_tuple()
    except Exception:  # noqa: BLE001 - another numba, no cache, an unreadable index: not compiled
        return False
    return any(isinstance(key, tuple) and len(key) >= 2 and key[1] == magic for key in index)
