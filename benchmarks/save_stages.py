"""Per-stage CPU timers inside a real save, for ``bench_save_integrity.py``'s "where the time goes" table.

Why timers inside the save and not each part timed alone: on a shared 2-core machine a part timed
alone says what it costs with the machine to itself, not what it adds while DCP's writer threads,
the other rank and the sink's threads compete for the same cores. Each timer adds the CPU seconds
(``time.thread_time``: user + system of the thread that ran it) of every call, on whatever thread,
so the table says how much CPU each stage took inside the saves being compared. Installed by
wrapping the functions the save calls (nothing in the runtime knows about it); the wrappers cost one
clock read per call, a few hundred calls per save.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

_LOCK = threading.Lock()
CPU: dict[str, float] = {}  # stage -> CPU seconds since the last reset()


def _add(stage: str, seconds: float) -> None:
    with _LOCK:
        CPU[stage] = CPU.get(stage, 0.0) + seconds


def reset() -> dict[str, float]:
    """The stages' CPU seconds so far, and start again from zero."""
    with _LOCK:
        out = dict(CPU)
        CPU.clear()
    return out


def _timed(stage: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        t = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            _add(stage, time.thread_time() - t)

    return run


class _TimedHasher:
    """A streaming hasher whose ``update`` calls are timed as ``stage``."""

    def __init__(self, inner: Any, stage: str) -> None:
        self._inner, self._stage = inner, stage

    def update(self, data: Any) -> None:
        t = time.thread_time()
        self._inner.update(data)
        _add(self._stage, time.thread_time() - t)

    def hexdigest(self) -> str:
        return self._inner.hexdigest()

    def reset(self) -> None:
        self._inner.reset()


class _TimedCrc:
    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def update(self, data: Any, value: int) -> int:
        t = time.thread_time()
        out = self._inner.update(data, value)
        _add("sink crc32c", time.thread_time() - t)
        return out


def install() -> None:
    """Wrap the save's stages (in this process; call once per rank before the saves)."""
    import torch.distributed.checkpoint.filesystem as dcp_fs

    import gtp_format.integrity.records as records_mod
    import gtp_format.writer.checkpoint as writer_mod
    import gtp_format.writer.sink as sink_mod
    import gtp_runtime.checkpoint.chunk_records as chunk_records
    import gtp_runtime.checkpoint.io as io_mod
    from gtp_format.manifest import HASH_ALGORITHM

    # DCP's writer threads: each item's torch.save serialisation plus the sink's write (timed apart below)
    dcp_fs._write_item = _timed("dcp item incl. sink.write", dcp_fs._write_item)
    sink_mod.Sink.write = _timed("sink.write incl. hashes", sink_mod.Sink.write)  # type: ignore[method-assign]
    sink_mod.Sink._put = _timed("sink pwrite (its thread)", sink_mod.Sink._put)  # type: ignore[method-assign]
    sink_mod.Sink.close = _timed("sink close (tail, fsync)", sink_mod.Sink.close)  # type: ignore[method-assign]
    sink_mod.CRCS = {**sink_mod.CRCS, HASH_ALGORITHM: _TimedCrc(sink_mod.CRCS[HASH_ALGORITHM])}
    hasher = sink_mod.chunk_hasher
    sink_mod.chunk_hasher = lambda: _TimedHasher(hasher(), "sink xxh3-128")
    chunk_records.state_stats = _timed("statistics (its thread)", chunk_records.state_stats)
    import gtp_format.integrity.stats as stats_mod

    stats_mod.StatsStream.update = _timed("statistics (in the sink)", stats_mod.StatsStream.update)  # type: ignore[method-assign]
    io_mod.records_from_segments = _timed("records from segments", io_mod.records_from_segments)
    io_mod.check_replicas = _timed("replica cross-check", io_mod.check_replicas)
    records_mod.write_records = _timed("side file JSON (rank 0)", records_mod.write_records)
    writer_mod.write_records = records_mod.write_records


def table_row(stages: dict[str, float], saves: int) -> dict[str, float]:
    """CPU seconds per save of each stage, with the nested ones taken apart: ``torch.save`` without the
    sink's write, the sink's write without its hashes and statistics (what is left is the copy into
    staging)."""
    s = {k: v / saves for k, v in stages.items()}
    hashes = s.get("sink crc32c", 0.0) + s.get("sink xxh3-128", 0.0) + s.get("statistics (in the sink)", 0.0)
    sink_write = s.pop("sink.write incl. hashes", 0.0)
    s["torch.save serialisation"] = s.pop("dcp item incl. sink.write", 0.0) - sink_write
    s["sink copy into staging"] = sink_write - hashes
    return {k: round(v, 3) for k, v in sorted(s.items())}
