"""Read-ahead within one output file: the next chunks are read (and hashed by the read ledger, and
assembled) on other threads while the file's own thread stages and writes the current one, in order.

Why: ``export --to hf`` writes one safetensors file per shard (5 GB by default), each on one thread that
reads, hashes, assembles and stages every byte in turn: a 15.8 GB export made 4 files, the largest
about 5 GB on one thread, so a 16-core machine idled behind it whatever ``--workers`` said (the files are set
by the shard size). The bytes written and their order are the same; only who reads them, and when, changes.

Memory: each chunk in flight has its own pair of buffers (the rows read, the box assembled from them),
reused chunk after chunk in turn (:class:`SlotBuffers`), so a file with ``depth`` chunks ahead holds
``2 * (depth + 1)`` chunk buffers and its staging (one chunk): :func:`ahead_depth` keeps that within the
worker's share of ``--max-memory`` and reads nothing ahead where the share has no room (small budgets).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ckpt_tool.copying.plan import OutChunk
from gtp_format.reader.boxes import Buffer

MAX_AHEAD = 1  # chunks read ahead per file: one read in flight beside each write; a slot is two more buffers


class SlotBuffers:
    """One chunk's reusable buffers (``out``: the box returned, ``scratch``: rows it is assembled from), the
    attributes :func:`ckpt_tool.copying.engine.chunk_data` uses; not thread-local: one chunk at a time."""

    def __init__(self) -> None:
        self.out, self.scratch = Buffer(), Buffer()


def ahead_depth(max_memory: int, workers: int, chunk_bytes: int, cores: int) -> int:
    """Chunks each file may read ahead within ``--max-memory``: a worker's share is ``max_memory / workers``;
    without read-ahead it holds three chunks (two read buffers and its staging), with ``d`` chunks ahead
    ``2 * (d + 1) + 1``. None where the ``cores`` are taken already (each file written has two threads, its
    own and its sink's): on 2 cores with 2 workers a read-ahead measured no faster (2.25 GB export, 3 rounds)
    and its fresh buffers' page faults cost 0.3-0.7 CPU s more."""
    if cores <= 2 * workers:
        return 0
    share = max_memory // (workers * chunk_bytes)
    return max(0, min(MAX_AHEAD, (share - 3) // 2))


class ReadAhead:
    """``fill(chunk, bufs)`` of one file's ``chunks``, asked for in that order, up to ``depth`` ahead on ``pool``.

    Chunk ``i`` goes into slot ``i % (depth + 1)``; asking for chunk ``i`` starts the read of chunk
    ``i + depth`` into the slot chunk ``i - 1`` used, which the file's thread has handed to its sink by then
    (the sink copies or writes what it is given before it returns). An error of a read is raised where its
    chunk is asked for, as the file's own read raised it.
    """

    def __init__(self, pool: ThreadPoolExecutor, fill: Callable[[OutChunk, Any], Any], chunks: list[OutChunk],
                 depth: int) -> None:
        self.pool, self.fill, self.chunks, self.depth = pool, fill, chunks, depth
        self.slots = [SlotBuffers() for _ in range(depth + 1)]
        self.pending: deque[Future[Any]] = deque()
        self.started = 0  # chunks whose read was submitted
        self.taken = 0  # chunks handed to the file's thread

    def __call__(self, c: OutChunk) -> Any:
        i = self.taken
        if i >= len(self.chunks) or self.chunks[i] is not c:
            raise AssertionError(f"{c.key}: chunks asked for out of the file's order")
        while self.started <= min(i + self.depth, len(self.chunks) - 1):
            k = self.started
            self.pending.append(self.pool.submit(self.fill, self.chunks[k], self.slots[k % len(self.slots)]))
            self.started += 1
        self.taken += 1
        return self.pending.popleft().result()
