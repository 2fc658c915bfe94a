"""Count the chunk bytes every rank of a ``gtp_runtime`` load reads (``tests/cli/test_plan.py``).

Put this folder first on ``PYTHONPATH`` and set ``READ_COUNTER_OUT`` to a folder: every process
then wraps :func:`gtp_format.reader.chunks.load_chunk` (the one function through which the
runtime's verified reader reads a stored chunk) before the runtime imports it, and appends one line
``rank key chunk length`` per chunk read to ``<pid>.txt``. Nothing else changes.
"""

from __future__ import annotations

import os

_OUT = os.environ.get("READ_COUNTER_OUT")
if _OUT:
    import gtp_format.reader.chunks as _chunks

    _orig = _chunks.load_chunk

    def _counting(ckpt, entry, chunk, into=None):  # type: ignore[no-untyped-def]
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else -1
        length = chunk.storage.length if chunk.storage is not None else 0
        with open(os.path.join(_OUT, f"{os.getpid()}.txt"), "a") as f:
            f.write(f"{rank}\t{entry.key}\t{chunk.index}\t{length}\n")
        return _orig(ckpt, entry, chunk, into)

    _chunks.load_chunk = _counting
