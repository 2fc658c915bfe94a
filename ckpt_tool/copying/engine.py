"""The copy kernel every copy runs on (``ckpt reshard``, ``ckpt export``, ``ckpt import``): the chunk
budget and worker count, one chunk's stored bits, reads fetched ahead, files written by threads
(:func:`write_checkpoint`, :func:`run_files`; under torchrun split by bytes, :func:`share_files`),
a write failure's one line, and the atomic build through the one checkpoint writer
(:func:`build_atomically`), a new folder that never replaces anything.

Memory: the largest array a worker holds is one chunk (``max_memory / (4 * workers)``, at most
64 MiB: larger chunks bring no speed); a worker holds at most two (the source rows, the chunk
assembled from them) and its file's two staging buffers of at most half a chunk each
(:func:`gtp_format.writer.sink.stage_bytes`), so the data in flight stays under ``--max-memory`` whatever SRC's size.

Speed: SRC is read from the page cache, DST must reach the disk (fsync), so the disk's durable
write rate bounds a copy: 4.67 GB took 11-12.5 s in-process where ``dd oflag=direct conv=fsync``
of as many bytes took 8.1-11.4 s (2-core machine, one virtual disk). :mod:`gtp_format.writer.sink`
explains why the files are written with ``O_DIRECT`` (was 15-19 s through the page cache).
No torch is imported: the torch_dist files are written by :mod:`gtp_format.writer`.
"""

from __future__ import annotations

import errno
import os
import resource
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ckpt_tool.copying.plan import OutChunk, Plan, read_order, split_files
from ckpt_tool.copying.source import Buffers, Source
from ckpt_tool.copying.writers import (
    ZeroableFn,
    Zeros,
    plan_runs,
    safetensors_index,
    write_distcp,
    write_distcp_metadata,
    write_distcp_run,
    write_safetensors,
)
from gtp_format import ranks
from gtp_format.commit import write_durable
from gtp_format.errors import FormatError
from gtp_format.hashing import forget
from gtp_format.integrity.records import ChunkRecord
from gtp_format.manifest import FileEntry, Manifest
from gtp_format.names import (
    DCP_METADATA_FILE,
    GTP_INDEX_FILE,
)
from gtp_format.progress import Progress
from gtp_format.scan import carrier
from gtp_format.session import Session
from gtp_format.storage import objects
from gtp_format.storage.base import storage_for
from gtp_format.storage.location import ObjectURL
from gtp_format.writer.checkpoint import CheckpointWriter, check_destination, data_file_name, megatron_metadata
from gtp_format.writer.sink import STAGE, SharedFile

MAX_CHUNK = 64 << 20
MIN_CHUNK = 1 << 20
COPIES = "reshard and export"  # who refuses an existing DST (gtp_format.writer.checkpoint.check_destination)


@dataclass
class Result:
    src: str
    dst: str
    source_topology: str
    target_topology: str
    layout: str
    files: int
    chunks: int
    bytes_written: int
    bytes_read: int
    seconds: float
    max_memory: int
    chunk_bytes: int
    workers: int
    peak_rss_bytes: int
    baseline_rss_bytes: int  # after the imports, before any data: peak - baseline is what the data took
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return dict(vars(self))


def chunk_budget(max_memory: int, workers: int) -> int:
    return max(MIN_CHUNK, min(MAX_CHUNK, max_memory // (4 * workers)))


def cores() -> int:
    """The CPUs this process may run on: its affinity (``taskset``, a container's cpuset), at most ``os.cpu_count()``.

    Why not ``os.cpu_count()`` alone: it counts the host's CPUs, so a copy under ``taskset -c 0,1`` on the lent
    16-core host ran 8 file threads, 8 sinks and a read-ahead pool on 2 cores."""
    n = os.cpu_count() or 1
    try:
        return max(1, min(n, len(os.sched_getaffinity(0))))
    except (AttributeError, OSError):  # no affinity call on this OS
        return n


def default_workers() -> int:
    """The default ``--workers``: it sets how many files a reshard writes (so the output), from the cores of
    this process's affinity, under torchrun too (every rank's plan is one process's)."""
    return max(1, min(4, cores()))


def rank_cores() -> int:
    """The cores this process's threads may keep busy: :func:`cores`, under torchrun divided by the ranks that
    share them (:func:`gtp_format.ranks.cores_per_rank`). Thread pools are sized from this, never the output."""
    return ranks.cores_per_rank(cores())


def write_threads(workers: int, chunk_bytes: int, max_memory: int) -> int:
    """Threads that write a reshard's ``2 * workers`` files: one per file, as far as the cores and
    ``--max-memory`` (a thread's share is four chunks, as a worker's) allow, never fewer than ``workers``.

    Why: ``workers`` sets the files and the chunk size (:func:`chunk_budget`), so the output; the
    threads are free. With the default ``min(4, cores)`` workers a 16-core machine wrote its 8 files four
    at a time, each thread hashing its file's bytes (the CPU bound of a reshard whose source is in the
    page cache). On 2 cores nothing changes (2 threads, 4 files).
    """
    return max(workers, min(2 * workers, rank_cores(), max_memory // (4 * chunk_bytes)))


def chunk_data(source: Source, c: OutChunk, bufs: Buffers | None = None) -> np.ndarray:
    """The stored bits of one target chunk (in ``bufs``, this thread's reusable buffers, if given:
    valid until the thread's next call).

    The source CRC the read ledger noted last on this thread is dropped first (:func:`gtp_format.hashing.forget`):
    the writer may take a noted CRC for the bytes returned here (:func:`gtp_format.hashing.recall`) only when this
    call read them."""
    forget()
    if c.values is not None:
        return np.asarray(c.values, dtype=np.int64)
    if c.copy:
        return source.reader.read_box(c.key, c.offsets, c.sizes).reshape(c.sizes)
    if c.param is None:
        return np.zeros(c.sizes, dtype=carrier(c.dtype))
    assert c.box is not None and c.state is not None
    arr = source.read_full_box(source.views[c.param], c.state, *c.box, bufs=bufs)
    if arr.dtype != carrier(c.dtype):
        raise FormatError(f"{source.root}: {c.param} {c.state} is stored as {arr.dtype}, expected {c.dtype.name}")
    return arr.reshape(c.sizes)


def copied_crc(source: Source, c: OutChunk) -> int | None:
    """The zip CRC-32 of the bytes :func:`chunk_data` just gave for ``c``, when they are a source chunk's whole
    payload, unchanged (:meth:`.source.Source.copied_crc`, which says why that value may be written)."""
    if c.values is not None or c.param is None or c.box is None or c.state is None:
        return None
    return source.copied_crc(source.views[c.param], c.state, *c.box)


def prefetch_reads(source: Source, order: list[OutChunk], max_memory: int) -> None:
    """From a bucket, fetch the source chunks the copy of ``order`` reads, in that order, ahead of the workers:
    export's read-ahead (``BoxReader.prefetch_chunks``, :class:`gtp_format.storage.prefetch.PlanPrefetch`), with
    the chunks each target chunk's box meets (``Source.chunks_read``: the walk ``read_full_box`` takes).

    Why: reshard from a bucket read each source chunk's zip structure (64 KiB blocks) and then its rows, on
    the worker's thread, with nothing in flight ahead. Budget: the quarter of ``--max-memory`` the workers'
    chunks and staging buffers leave (module docstring, "Memory"). Not less: each worker gathers a whole
    target chunk (up to ``MAX_CHUNK``) from many source chunks before it writes it, so the extents in use at
    once are about ``workers`` target chunks, and a request dropped for the budget before its last extent
    was read is read again directly. At 304.8 MB (benchmarks/bench_s3_ckpt.py, 4 workers) a 64 MiB budget
    made 354 GETs (303 of them such direct reads, 11.9 s), 128 MiB 259 (9.2 s), the quarter 51 (2.0 s).
    Nothing on a disk.
    """
    if not storage_for(source.root).remote:
        return
    pairs = [pair for c in order if c.param is not None and c.state is not None and c.box is not None
             for pair in source.chunks_read(source.views[c.param], c.state, *c.box)]
    source.reader.prefetch_chunks(pairs, max(objects.PART, max_memory // 4))
    # the bytes the copy never reads (replicas other than the primary, alignment holes) are read by the
    # ledger beside the copy, not after it: 4 of the fixture's 25 GETs came one after another at the end
    source.reader.ledger.fill_except((), source.reader.planned_ranges())


def write_checkpoint(fill: Callable[[OutChunk], np.ndarray | Zeros], target: Manifest, plan: Plan,
                     writer: CheckpointWriter, workers: int, advance: Progress, stage: int = STAGE,
                     plan_reads: Callable[[list[OutChunk]], None] | None = None,
                     known_crc: Callable[[OutChunk], int | None] | None = None, threads: int | None = None) -> None:
    """Write every data file, the metadata and the manifest of ``target`` into ``writer.folder`` and
    finish it (the caller commits).

    ``fill(chunk)`` gives each chunk's stored bits, or for torch_dist a :class:`.writers.Zeros` of a chunk known to be
    zeros (:func:`chunk_data` for a reshard; the benchmark
    passes a generator to build synthetic checkpoints of any size); ``stage``: each file's staging
    buffers (:class:`gtp_format.writer.sink.Sink`); ``plan_reads(chunks)``: told every chunk in the order
    the workers will fill them (:func:`.plan.read_order`) before they start (a bucket's read-ahead);
    ``known_crc(chunk)``: the zip CRC-32 of what ``fill(chunk)`` just gave, where known (torch_dist,
    :func:`copied_crc`); ``threads``: how many files are written at once (default ``workers``, which sets how
    many files there are: :func:`write_threads`).
    """
    folder = writer.folder
    parts = split_files(plan.chunks, workers * 2)
    names = [data_file_name(i, 0, target.layout) for i in range(len(parts))]

    records: list[list[ChunkRecord]] = [[] for _ in parts]  # one list per file: each written by one thread

    def one(i: int, tick: Progress) -> Any:
        if target.layout == "torch_dist":
            return write_distcp(folder / names[i], parts[i], fill, tick, stage, records[i], known_crc)
        return write_safetensors(folder / names[i], parts[i], fill, tick, stage, records[i]), None

    group = ranks.current()
    if group is None:
        if plan_reads is not None:
            plan_reads(read_order(parts, threads or workers))
        results = run_files(one, len(parts), threads or workers, advance)
    else:  # under torchrun: this rank's files (the same names and bytes as one process writes), then the gather
        results = share_files(group, parts, one, records, workers, advance, plan_reads)
        if not group.root:
            return  # rank 0 writes the metadata, finishes and commits what every rank wrote
    writer.add_files({n: r[0] for n, r in zip(names, results)})
    writer.add_records([r for rs in records for r in rs])
    if target.layout == "torch_dist":
        placed = [(n, c, off, ln) for n, r in zip(names, results) for c, off, ln in r[1]]
        write_distcp_metadata(folder / DCP_METADATA_FILE, plan.shapes, placed)
        writer.add_file(DCP_METADATA_FILE)
    else:
        write_durable(folder / GTP_INDEX_FILE, safetensors_index(plan.shapes, dict(zip(names, parts))))
        writer.add_file(GTP_INDEX_FILE)
    writer.finish(target, megatron_metadata(target.layout))


def share_files(group: ranks.Group, parts: list[list[OutChunk]], one: Callable[[int, Progress], Any],
                records: list[list[ChunkRecord]], workers: int, advance: Progress,
                plan_reads: Callable[[list[OutChunk]], None] | None) -> list[Any]:
    """This rank's share of the files of :func:`write_checkpoint` (:meth:`gtp_format.ranks.Group.mine`: by
    bytes), on up to ``workers`` threads, then every file's result and records gathered from all ranks
    (``records`` filled in for every file, as one process fills it). Every rank fails together."""
    mine = group.mine([sum(c.nbytes for c in p) for p in parts])

    def local() -> list[tuple[int, Any, list[ChunkRecord]]]:
        if plan_reads is not None:
            plan_reads(read_order([parts[i] for i in mine], workers))
        # threads: this rank's share of the cores (ranks sharing an affinity each sized theirs from all of them)
        threads = max(1, min(workers, len(mine), rank_cores()))
        got = run_files(lambda k, tick: one(mine[k], tick), len(mine), threads, advance)
        ranks.fault("copy")
        # a chunk goes back as its index in the file (every rank holds the same plan), not as itself
        return [(i, (entry, None if placed is None else [(off, ln) for _, off, ln in placed]), records[i])
                for i, (entry, placed) in zip(mine, got)]

    results: list[Any] = [None] * len(parts)
    shares = group.exchange(local, "while writing its files")
    own = set(mine)
    advance(sum(sum(c.nbytes for c in p) for i, p in enumerate(parts) if i not in own))  # the others' bytes
    for share in shares:
        for i, (entry, placed), recs in share:
            results[i] = (entry, None if placed is None else [(c, off, ln) for c, (off, ln) in zip(parts[i], placed)])
            records[i] = recs
    return results


class Stopped(Exception):
    """A worker's file was abandoned because another failed or the run was interrupted."""


def run_files(one: Callable[[int, Progress], Any], n: int, workers: int, advance: Progress) -> list[Any]:
    """``one(i, tick)`` for every file ``i`` on ``workers`` threads (``tick(bytes)`` after each chunk).

    On an error or an interrupt (SIGTERM, Ctrl-C) the files not started are cancelled and the running
    ones stop at their next chunk (``tick`` raises), so nothing writes into the work folder once the
    writer removes it, and a terminated run ends within a chunk's time, not a file's.
    """
    lock, stop = threading.Lock(), threading.Event()

    def tick(nbytes: int) -> None:
        if stop.is_set():
            raise Stopped("stopped")
        with lock:
            advance(nbytes)

    pool = ThreadPoolExecutor(max_workers=workers)
    try:
        futures = [pool.submit(one, i, tick) for i in range(n)]
        return [f.result() for f in futures]
    except BaseException:
        stop.set()
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def write_distcp_files(folder: Path, names: list[str], files: list[list[OutChunk]], fill: ZeroableFn, threads: int,
                       advance: Progress, stage: int, records: list[list[ChunkRecord]], run_bytes: int,
                       ahead: Callable[[OutChunk], None] | None = None
                       ) -> list[tuple[FileEntry, list[tuple[OutChunk, int, int]]]]:
    """The ``.distcp`` files ``names`` (chunks ``files``) in ``folder``, each cut into runs of about ``run_bytes``
    (:func:`.writers.plan_runs`) written by ``threads`` threads at once, each run at its place in its file
    (:class:`gtp_format.writer.sink.SharedFile`): the same bytes, records and entries as :func:`.writers.write_distcp`
    of each file on a thread of its own, as :func:`run_files` returns them (``records[i]``: file ``i``'s, in order).

    Why: a file per thread waits on the largest file, and megatron-core's files are one per rank, whatever their
    sizes (an import's DP rank 0 holds the model weights besides its optimizer shard); runs share the work by
    bytes. Memory: each thread holds what a worker of :func:`write_checkpoint` holds (its run's chunk and staging).
    ``ahead(chunk)``: told of each run's next chunk before its current one is filled (a source's read-ahead).
    """
    blobs, sizes, runs = plan_runs(files, run_bytes)
    shared: list[SharedFile] = []
    try:
        for name, size in zip(names, sizes):
            shared.append(SharedFile(folder / name, stage, size))
        got: list[list[ChunkRecord]] = [[] for _ in runs]
        results = run_files(lambda k, tick: write_distcp_run(shared[runs[k].file], runs[k], files[runs[k].file],
                                                             blobs[runs[k].file], fill, tick, stage, got[k],
                                                             ahead),
                            len(runs), threads, advance)
        out = []
        for i, f in enumerate(shared):
            mine = [k for k, r in enumerate(runs) if r.file == i]  # in file order (plan_runs made them so)
            entry = f.finish([results[k][0] for k in mine])
            records[i].extend(r for k in mine for r in got[k])
            out.append((entry, [p for k in mine for p in results[k][1]]))
        return out
    finally:
        for f in shared:
            f.abort()


def os_cause(e: BaseException) -> OSError | None:
    """The OS error behind ``e``, if any: torch.save reports a failed write as a RuntimeError whose
    context is the OSError (EFBIG, ENOSPC) that Python's file object raised."""
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, OSError) and cur.errno is not None:
            return cur
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__
    return None


def _chain(e: BaseException) -> list[OSError]:
    out, cur = [], e
    while cur is not None and len(out) < 16:
        if isinstance(cur, OSError):
            out.append(cur)
        cur = cur.__cause__ or cur.__context__
    return out


def write_failure(dst: Path, e: OSError) -> FormatError:
    """The one-line error for a write that failed (the partial output is already removed)."""
    space = [x for x in _chain(e) if x.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)]
    if space:
        return FormatError(f"{dst}: {os.strerror(space[0].errno or 0)} while writing (nothing was left behind); "
                           "free space or write to another disk")
    return FormatError(f"{dst}: cannot write ({e.strerror or e}); nothing was left behind")


def build_atomically(dst: Path, sources: tuple[Path, ...], body: Callable[[CheckpointWriter], None],
                     inner: str | None = None, latest: str | None = None, session: Session | None = None) -> None:
    """Run ``body(writer)`` (which writes and finishes) on a new :class:`CheckpointWriter` for ``dst`` and
    commit it; the work folder is removed on any failure, and a DST that appeared meanwhile is refused.
    ``session``: the command's (:class:`gtp_format.session.Session`): the writer's storage uses its limits
    and its work folder is recorded there."""
    check_destination(dst, sources, COPIES)  # sources: every name of SRC (Source.names), for the nesting rule
    group = ranks.current()
    if group is not None:  # under torchrun: every rank writes its share into rank 0's work folder
        from ckpt_tool.copying.ranked import build_ranked

        build_ranked(group, dst, body, inner, latest, session)
        return
    try:
        with CheckpointWriter(dst, inner=inner, latest=latest, session=session) as writer:
            body(writer)
            writer.commit()
    except BaseException as e:
        cause = os_cause(e)
        if cause is None or isinstance(e, FormatError):
            raise
        raise write_failure(dst, cause) from None


def written_sizes(folder: Path | ObjectURL) -> list[int]:
    """Sizes of the files a committed output holds (a bucket's: as the store lists them)."""
    store = storage_for(folder)
    if store.remote:  # a folder's entries are stat'ed, sub-folders too
        return [n for n in store.entries().values() if n is not None]
    return [p.stat().st_size for p in folder.iterdir()]


def peak_rss() -> int:
    """This process's peak RSS in bytes: ``VmHWM`` (Linux), else ``ru_maxrss``.

    ``ru_maxrss`` survives ``exec``: a CLI started from a parent holding 700 MiB reported 700 MiB
    whatever it did itself (measured in benchmarks/bench_reshard.py); ``VmHWM`` is per process image.
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def rss_after_imports(layout: str | None) -> int:
    """Peak RSS once every module the write needs is imported (no torch: both layouts are written by
    :mod:`gtp_format.writer` and numpy), so a run can report what its data took:
    ``peak_rss_bytes - baseline_rss_bytes``."""
    return peak_rss()
