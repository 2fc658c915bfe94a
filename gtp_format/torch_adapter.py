"""The one place ``gtp_format`` touches torch: every other module asks here, and only when it must.

Why one adapter: the format package must import, and ``ckpt inspect``/``verify`` must run, where
torch is not installed (``tests/format/test_format_no_torch.py`` imports all of it with torch
blocked, and fails on a torch import in any other module). Only code that builds tensors
(``show``, ``diff``, ``migrate-aliased``, the value comparison) needs torch, so it is imported on
first use, here, the way safetensors keeps one module per framework (``safetensors/torch.py``).
Scattered lazy imports had grown to seven modules, each with its own idea of what happens first.
"""

from __future__ import annotations

import threading
import warnings
from typing import Any

import numpy as np

_LOCK = threading.Lock()
_READY = False


def load_torch() -> Any:
    """torch, imported on first use, with its once-per-process "array is not writable" warning spent.

    Payloads are often immutable ``bytes`` and the tensors made over them are only read, so the
    warning would be noise on a user's terminal. Torch emits it once, from whichever thread is
    first; it is spent here, under a lock, because ``catch_warnings`` is not thread-safe.
    """
    import torch

    global _READY
    with _LOCK:
        if not _READY:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                torch.from_numpy(np.frombuffer(b"\0", dtype=np.uint8))
            _READY = True
    return torch


def torch_attr(name: str) -> Any:
    """``torch.<name>``: a dtype (``bfloat16``), a layout (``strided``) or another constant by name."""
    return getattr(load_torch(), name)
