"""DCP's ``FileSystemWriter`` with its data files written through the format package's ``O_DIRECT`` sink.

Why: DCP writes each ``.distcp`` file through Python's buffered file object, so every byte is
copied into the page cache and written back by the kernel, and the runtime then read every file
back to compute the manifest's CRC-32C. Measured on this 2-core machine for ``ckpt reshard``
(``gtp_format/writer/sink.py``): ``dd oflag=direct`` writes 0.53 GB/s where the page-cache path
reaches 0.35-0.45 GB/s and spends a third of the CPU in copies and writeback. The sink writes from
two aligned staging buffers with ``O_DIRECT`` (the page cache is bypassed, the fsync at the end
only flushes the disk cache), computes the CRC-32C of the bytes as they pass, so nothing is read
back, and falls back to buffered writes where the file system refuses ``O_DIRECT``.

Only the byte stream's sink changes: DCP still plans, serialises every item with ``torch.save`` into
the stream, records offsets and writes ``.metadata``, so the files are byte-for-byte DCP's own
(``ckpt verify --data`` and PyTorch's ``FileSystemReader`` read them). The writer's ``thread_count``
still writes several files of a rank in parallel, each with its own sink.

Chunk hashes on the way out: DCP asks the stream for its position (``tell``) right before and right
after it serialises each item, so the stream cuts the sink's segment hash there
(:meth:`gtp_format.writer.sink.Sink.cut`) and every item's bytes get their xxh3-128 on the writer thread
that already holds them (xxhash releases the GIL for large buffers). The save then matches those
segments to DCP's storage metadata (:func:`chunk_records.records_from_segments`) instead of reading each
file back. With a ``watch`` (:class:`chunk_records.SinkStats`), a write that is a CPU chunk's elements
also gets its statistics piece by piece, from the same cached pieces. What the read-back also checked,
the file's CRC-32C read from disk against the one computed as written, caught only a sink that wrote
other bytes than it was handed (its staging, padding and fallback logic;
``tests/cli/test_reshard_sink.py`` checks those against brute force) or a file cut short; the sink now
checks the size on disk after its fsync (one ``fstat``). A disk that loses acknowledged writes is beyond
any check at save time: ``verify --data`` finds it by the chunk hashes. Measured in
``benchmarks/bench_save_integrity.py`` (docs/performance.md).
"""

from __future__ import annotations

import io
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemWriter

from gtp_format.manifest import FileEntry
from gtp_format.writer.sink import STAGE, Sink


class Watch(Protocol):
    """Which writes are a chunk's elements, whose statistics the sink takes piece by piece as it writes them
    (:class:`gtp_runtime.checkpoint.chunk_records.SinkStats`)."""

    def start(self, data: memoryview) -> Any:
        """A handle whose ``update`` takes each piece of ``data``'s bytes (its statistics), or None."""

    def finish(self, handle: Any) -> None:
        """``handle`` has had every byte of its chunk."""


class _SinkStream(io.RawIOBase):
    """A write-only stream over a :class:`Sink`: ``tell`` is the bytes handed in (DCP's offsets)."""

    def __init__(self, sink: Sink, watch: Watch | None = None) -> None:
        super().__init__()
        self.sink = sink
        self.watch = watch
        # the first write error: torch.save's zip writer, closing after it, raises its own "unexpected pos"
        # error over it (a full disk), which :meth:`DirectFileSystem.create_stream` replaces with this one
        self.error: OSError | None = None

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        v = memoryview(b)
        n = v.nbytes
        if n:
            handle = self.watch.start(v) if self.watch is not None else None
            try:
                self.sink.write([b], on_piece=None if handle is None else handle.update)
            except OSError as e:
                self.error = self.error or e
                raise
            if handle is not None:
                self.watch.finish(handle)  # type: ignore[union-attr]
        return n

    def tell(self) -> int:
        return self.sink.cut()  # DCP asks at both ends of every item: a chunk hash per item


class DirectFileSystem(FileSystem):
    """DCP's local file system, except that data files (``.distcp``) are written through a sink.

    ``entries`` collects each data file's size and CRC-32C, computed while it was written; with
    ``segments``, :attr:`segments` each file's ``(start, stop) -> xxh3-128`` of the bytes between
    two ``tell`` calls.
    """

    def __init__(self, stage: int = STAGE, segments: bool = False, watch: Watch | None = None) -> None:
        super().__init__()
        self.stage = stage
        self.hash_segments = segments
        self.watch = watch
        self.entries: dict[str, FileEntry] = {}
        self.segments: dict[str, dict[tuple[int, int], str]] = {}
        self._lock = threading.Lock()

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        path = Path(path)
        if mode != "wb" or path.suffix != ".distcp":
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        sink = Sink(path, self.stage, segments=self.hash_segments)
        stream = _SinkStream(sink, self.watch)
        try:
            yield stream
        except BaseException as e:
            sink.abort()
            if stream.error is not None and e is not stream.error and not isinstance(e, KeyboardInterrupt):
                raise stream.error from e  # the disk's own error, not the zip writer's after it
            raise
        entry = sink.close()  # writes the tail, cuts the padding, fsyncs
        with self._lock:
            self.entries[path.name] = entry
            self.segments[path.name] = sink.segments


def direct_writer(folder: Path, threads: int, segments: bool = False,
                  watch: Watch | None = None) -> tuple[FileSystemWriter, DirectFileSystem]:
    """A DCP writer for ``folder`` whose data files go through :class:`DirectFileSystem` (``watch``: the
    chunks whose statistics the sinks take as they write them).

    ``sync_files=False``: each sink fsyncs its own file when it closes (DCP's own fsync would come
    before the sink's last buffer is written); ``.metadata`` is fsynced by the commit.
    """
    writer = FileSystemWriter(folder, sync_files=False, thread_count=threads)
    fs = DirectFileSystem(segments=segments, watch=watch)
    writer.fs = fs
    return writer, fs
