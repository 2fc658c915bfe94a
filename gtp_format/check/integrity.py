"""Integrity of what a copy reads, checked on the bytes it reads: ``reshard``, ``export``.

Why: a copy re-hashes what it writes, so a source that fails ``verify --data`` came out of
``reshard``/``export`` with fresh, matching checksums and exit 0 (the red team's "laundering").
A copy must therefore check its input against the checksums the input carries, and refuse to
commit when one fails. Reading everything twice (``verify --data``, then the copy) would double
the source reads; instead each range a copy reads is hashed as it arrives (:meth:`ReadLedger.record`,
called by the copy's reader on the bytes already in its buffer), and at the end
(:meth:`ReadLedger.finish`, before the output is committed) the pieces are joined in file order
with :meth:`gtp_format.hashing.Crc.combine`. Only the bytes no copy read (zip headers, byte
objects, replicas of a parameter the view reads once) are read then, so the source is read once.

What is checked, as ``verify --data`` does (:mod:`gtp_format.check.data`):

* a data file the manifest checksums (every gtp_runtime file: CRC-32C): that checksum, over the
  whole file, and its size;
* a ``torch.save`` file without one (a genuine Megatron checkpoint): the zip directory's CRC-32 of
  every tensor's storage record, and every record of every byte object;
* a raw (safetensors) file without one: nothing beyond the structure the reader already checks
  (its header and offsets): there is no checksum to compare with, which the summary cannot fix.

Pieces may arrive in any order and overlap (two target chunks reading one source row); the join
takes each byte once: a piece starting before the bytes already joined is skipped, and what it
alone covered is read as a gap.

A copy that knows it reads only some keys (a weights-only export reads the model keys, a quarter
of an fp32 Adam checkpoint) starts :meth:`ReadLedger.fill_except` first: the bytes outside those
keys' chunks are read and hashed on background threads while the copy runs, instead of one
thread after it (in a file checked by its zip records: the payloads of the records outside those
keys). Measured (4.67 GB checkpoint, page cache evicted, 2 shared cores): the sequential gap reads
were 8 of the weights-only export's 10 s in a profile (py-spy); see ``docs/performance.md``,
"ckpt export --to hf at 4.67 GB".
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from gtp_format import ranks
from gtp_format.errors import EXIT_CHECK_FAILED, ChunkError, FormatError
from gtp_format.hashing import CRCS, HASHERS, Crc, file_digests, remember
from gtp_format.model import BYTES, ENC_TORCH_SAVE, TENSOR, Checkpoint, Chunk, Entry
from gtp_format.reader.blob import parse_blob
from gtp_format.reader.chunks import check_byte_object, checked_ref
from gtp_format.reader.storage import (
    Source,
    open_regular,
    pread,
    pread_into,
    size_of,
    source_of,
    streamed,
)
from gtp_format.reader.zip_blob import BlobError, RangeReader
from gtp_format.storage.base import storage_for

BLOCK = 8 << 20  # gap reads, bounded whatever the file
FILL_TASK = 64 << 20  # background fill: ranges are cut into tasks of this size, read BLOCK at a time
FILL_THREADS = 2  # the disk, not the CRC (>10 GB/s per core), bounds them; two keep a read in flight while one hashes
# A bucket's round trip, not its bandwidth, bounds a fill: with two threads a 26.5 MB export's five gap reads
# went in three rounds after the data (24 ms of a 90 ms command); four hold at most 4 x BLOCK = 32 MiB.
BUCKET_FILL_THREADS = 4


@dataclass(frozen=True)
class _Mode:
    kind: str  # "file": the manifest's CRC over the whole file; "records": zip CRC-32s; "digest": sha256 etc.
    algorithm: str
    want: str  # the manifest's hex value ("" for records)
    size: int | None  # the manifest's size


class DamagedSource(FormatError):
    """The source's bytes fail a checksum they carry: exit 1, as ``verify --data``."""

    def __init__(self, message: str) -> None:
        super().__init__(message, EXIT_CHECK_FAILED)


class ReadLedger:
    """The checksummed ranges one copy has read, per data file; thread-safe."""

    def __init__(self, ckpt: Checkpoint) -> None:
        self.ckpt = ckpt
        self._lock = threading.Lock()
        self._pieces: dict[str, list[tuple[int, int, int]]] = {}  # file -> (offset, length, crc)
        self.modes: dict[str, _Mode] = {}
        files = ckpt.manifest.files if ckpt.manifest is not None and ckpt.manifest.files else {}
        for rel in ckpt.data_files:
            spec = files.get(rel)
            sums = {a.lower(): v.lower() for a, v in spec.checksums.items()} if spec is not None else {}
            crc = next((a for a in ("crc32c", "crc32") if a in sums), None)
            if crc is not None:
                self.modes[rel] = _Mode("file", crc, sums[crc], spec.size if spec else None)
            elif sums:
                algo = next((a for a in sums if a in HASHERS), None)
                if algo is None:  # verify's manifest check names the unknown algorithm; refuse here too
                    raise DamagedSource(f"{ckpt.root / rel}: its manifest checksum uses {sorted(sums)}, none of which "
                                        "ckpt can compute; its integrity cannot be checked, so it is not copied")
                self.modes[rel] = _Mode("digest", algo, sums[algo], spec.size if spec else None)
            elif ckpt.encoding == ENC_TORCH_SAVE:
                self.modes[rel] = _Mode("records", "crc32", "", None)
        self.bytes_checked = 0  # hashed as read
        self.bytes_filled = 0  # read by the ledger itself: bytes no copy read
        self._fill: list[Future[None]] = []
        self._fill_pool: ThreadPoolExecutor | None = None
        self._stop = threading.Event()
        self._local = threading.local()

    def _crc(self, rel: str) -> Crc | None:
        mode = self.modes.get(rel)
        return CRCS[mode.algorithm] if mode is not None and mode.kind in ("file", "records") else None

    def record(self, rel: str, offset: int, data: object, filled: bool = False) -> None:
        """``data`` (a contiguous bytes-like object, e.g. the reader's buffer) was read at ``offset`` of
        ``rel`` (by the copy; ``filled``: by the ledger's own fill)."""
        crc = self._crc(rel)
        if crc is None:
            return
        value = crc.update(data, 0)  # outside the lock: the CRCs release the GIL
        n = memoryview(data).nbytes  # type: ignore[arg-type]
        if not filled:  # the copy's writer may be handed these very bytes next (gtp_format.hashing.recall)
            remember(crc.name, data, value)
        with self._lock:
            self._pieces.setdefault(rel, []).append((offset, n, value))
            if filled:
                self.bytes_filled += n
            else:
                self.bytes_checked += n

    def fill_except(self, keys: Iterable[str], also: dict[str, list[tuple[int, int]]] | None = None) -> None:
        """Start reading, on background threads, every byte of the whole-file-checksummed files that
        lies outside the stored chunks of ``keys`` (the keys the copy will read) and outside ``also`` (ranges
        per file the copy's reader reads and records anyway: a bucket's prefetch reads through small holes), as
        pieces. A range of ``also`` that ends up not recorded is read as a gap by :meth:`finish`.

        A file without one (a genuine Megatron file, checked by the zip CRC-32 of each tensor record):
        the payload of every tensor record outside those keys and ranges, found by its zip structure, so
        that its pieces are what :meth:`finish` joins per record.
        """
        wanted = set(keys)
        taken: dict[str, list[tuple[int, int]]] = {}
        for key in wanted:
            entry = self.ckpt.entries.get(key)
            for c in entry.chunks if entry is not None else ():
                if c.storage is not None:
                    taken.setdefault(c.storage.file, []).append((c.storage.offset, c.storage.offset + c.storage.length))
        for rel, ranges in (also or {}).items():
            taken.setdefault(rel, []).extend(ranges)
        tasks: list[tuple[str, int, int]] = []
        records: list[tuple[Entry, Chunk]] = []
        merged = {rel: _merged(ranges) for rel, ranges in taken.items()}
        for entry in self.ckpt.entries.values():  # a zip-record file: the payloads of the records no copy reads
            if entry.kind != TENSOR or entry.key in wanted:
                continue
            for c in entry.chunks:
                st = c.storage
                mode = self.modes.get(st.file) if st is not None else None
                if st is not None and mode is not None and mode.kind == "records" \
                        and not _meets(merged.get(st.file, ([], [])), st.offset, st.offset + st.length):
                    records.append((entry, c))
        for rel, mode in self.modes.items():
            if mode.kind != "file" or mode.size is None:
                continue  # no size to bound the ranges by: finish() reads and checks it
            at = 0
            for a, b in sorted(taken.get(rel, ())) + [(mode.size, mode.size)]:
                for lo in range(at, min(a, mode.size), FILL_TASK):
                    tasks.append((rel, lo, min(lo + FILL_TASK, a, mode.size)))
                at = max(at, b)
        if not tasks and not records:
            return
        threads = BUCKET_FILL_THREADS if storage_for(self.ckpt.store).remote else FILL_THREADS
        self._fill_pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="ledger-fill")
        self._fill = [self._fill_pool.submit(self._fill_range, *t) for t in tasks]
        self._fill += [self._fill_pool.submit(self._fill_records, rel, run) for rel, run in record_tasks(records)]

    def _fill_records(self, rel: str, run: list[tuple[Entry, Chunk]]) -> None:
        """Read and record, as pieces, the payloads of zip records of ``rel`` no copy reads (their zip structure
        read here too: each payload's place), so that :meth:`finish` joins them instead of reading them then.

        Why: a weights-only export of a genuine megatron-core checkpoint reads a quarter of its bytes, and
        ``finish`` read the other three quarters on the main thread after the copy: 2.6 of 3.95 s of a
        3.97 GB export (HF folder 0.99 GB), page cache evicted, on the lent 16-core H100 host
        (benchmarks/cli_stages.py). Anything wrong here (a record that is not an intact blob, a file that
        shrank) is left to ``finish``, which reads it again and reports it in its own words."""
        with open_regular(self.ckpt.store, rel) as f:
            if f.sparse_message(rel) is not None:  # type: ignore[attr-defined]
                return
            src, size = source_of(f), size_of(f)
            for entry, chunk in run:
                if self._stop.is_set():
                    return
                try:
                    ref = checked_ref(self.ckpt, entry, chunk)
                    layout = parse_blob(RangeReader(src, ref.offset, ref.length))
                except (BlobError, ChunkError, FormatError):
                    continue
                start = ref.offset + layout.payload_offset
                end = start + layout.payload_bytes
                if end <= ref.offset + ref.length:
                    self._fill_range_of(src, rel, size, start, end)

    def _fill_range(self, rel: str, lo: int, hi: int) -> None:
        with open_regular(self.ckpt.store, rel) as f:
            if f.sparse_message(rel) is not None:  # type: ignore[attr-defined]
                return  # holes nobody wrote: finish() refuses the file without reading them
            self._fill_range_of(source_of(f), rel, size_of(f), lo, hi)  # a descriptor, or a bucket's object

    def _fill_range_of(self, src: Source, rel: str, size: int, lo: int, hi: int) -> None:
        buf = getattr(self._local, "buf", None)
        if buf is None:
            buf = self._local.buf = bytearray(BLOCK)
        for pos in range(lo, min(hi, size), BLOCK):
            if self._stop.is_set():
                return
            view = memoryview(buf)[:min(BLOCK, hi - pos, size - pos)]
            try:
                pread_into(src, rel, size, pos, view)
            except ChunkError:
                return  # the file shrank: finish() reads the rest itself and says so
            self.record(rel, pos, view, filled=True)

    def cancel(self) -> None:
        """Stop the background fill (a copy that failed or was interrupted); waits for its reads."""
        self._stop.set()
        self._wait_fill(raise_errors=False)

    def _wait_fill(self, raise_errors: bool = True) -> None:
        pool, self._fill_pool = self._fill_pool, None
        if pool is None:
            return
        errors = []
        for fut in self._fill:
            try:
                fut.result()
            except BaseException as e:  # an unreadable range is read again, and reported, by finish()
                errors.append(e)
        pool.shutdown(wait=True)
        self._fill = []
        if errors and raise_errors and not isinstance(errors[0], OSError):
            raise errors[0]

    def finish(self) -> None:
        """Join every file's pieces, read what no copy read, and compare; raise :class:`DamagedSource`."""
        self._wait_fill()
        rels = sorted(self.modes)
        group = ranks.current()
        if group is not None:  # under torchrun: every rank's pieces, and each file checked by one rank
            rels = self._share(group, rels)
        for rel in rels:
            mode = self.modes[rel]
            with self._lock:
                self._pieces[rel] = sorted(self._pieces.get(rel, ()))
            try:
                with streamed(open_regular(self.ckpt.store, rel)) as f:
                    sparse = f.sparse_message(rel)  # type: ignore[attr-defined]
                    if sparse is not None:
                        # reading (and hashing) the holes of a 16 TiB sparse file under a matching manifest
                        # kept export busy for hours (the hostile corpus run from a bucket found it)
                        raise DamagedSource(f"{self.ckpt.root / rel}: {sparse}; nothing was written")
                    fd, size = source_of(f), size_of(f)
                    if mode.size is not None and size != mode.size:
                        raise DamagedSource(f"{self.ckpt.root / rel}: is {size} bytes but the manifest says "
                                            f"{mode.size}; the source is damaged (nothing was written)")
                    if mode.kind == "digest":
                        got = file_digests(f, [mode.algorithm])[mode.algorithm]
                        self.bytes_filled += size
                    elif mode.kind == "file":
                        got = f"{self._join(fd, rel, 0, size):08x}"
                    else:
                        self._check_records(fd, rel, size)
                        continue
            except ChunkError as e:
                raise DamagedSource(f"{self.ckpt.root / rel}: {e.message}") from None
            if got != mode.want:
                raise DamagedSource(f"{self.ckpt.root / rel}: {mode.algorithm} is {got} but the manifest says "
                                    f"{mode.want}: the source's data is damaged, so nothing was written; run "
                                    "`ckpt verify --data` on it and copy an intact checkpoint")

    def _share(self, group: ranks.Group, rels: list[str]) -> list[str]:
        """The pieces every rank's copy read, joined into this ledger; the files this rank checks (by bytes).

        Why: each rank reads only its share of the source, so each checking every file alone read the rest
        again, N times the source's bytes over N ranks (4 ranks took 2.6 x one process's time on 2 cores).
        Joined, a file's gaps are only what no rank read, as with one process."""
        with self._lock:
            mine = {rel: list(self._pieces.get(rel, ())) for rel in rels}
        for r, share in enumerate(group.exchange(lambda: mine, "while checking its source reads")):
            if r != group.rank:
                with self._lock:
                    for rel, pieces in share.items():
                        self._pieces.setdefault(rel, []).extend(pieces)
        sizes = [self.modes[rel].size or self.ckpt.data_files.get(rel, 0) for rel in rels]
        return [rels[i] for i in group.mine(sizes)]

    def _join(self, fd: Source, rel: str, lo: int, hi: int) -> int:
        """CRC of bytes ``[lo, hi)`` of ``rel``: the recorded pieces inside, gaps read from ``fd``."""
        crc = self._crc(rel)
        assert crc is not None
        pieces = self._pieces.get(rel, [])  # sorted by finish()
        first = bisect.bisect_left(pieces, (lo, -1, -1))
        value, at = 0, lo
        for off, n, piece in pieces[first:]:
            if off >= hi:
                break
            if off < at or off + n > hi:
                continue  # overlaps what is joined, or leaves the range: its bytes come from the gap reads
            value = self._gap(fd, rel, crc, value, at, off)
            value = crc.combine(value, piece, n)
            at = off + n
        return self._gap(fd, rel, crc, value, at, hi)

    def _gap(self, fd: Source, rel: str, crc: Crc, value: int, lo: int, hi: int) -> int:
        for pos in range(lo, hi, BLOCK):
            want = min(BLOCK, hi - pos)
            block = pread(fd, want, pos)
            if len(block) != want:
                raise DamagedSource(f"{self.ckpt.root / rel}: shrank while it was copied (read {len(block)} of "
                                    f"{want} bytes at {pos}); nothing was written: copy a checkpoint nobody writes")
            value = crc.update(block, value)
            self.bytes_filled += want
        return value

    def _check_records(self, fd: Source, rel: str, size: int) -> None:
        for entry in self.ckpt.entries.values():
            for chunk in entry.chunks:
                if chunk.storage is None or chunk.storage.file != rel:
                    continue
                if entry.kind == BYTES:
                    check_byte_object(self.ckpt, entry, chunk)
                    continue
                if entry.kind != TENSOR:
                    continue
                ref = checked_ref(self.ckpt, entry, chunk)
                try:
                    layout = parse_blob(RangeReader(fd, ref.offset, ref.length))
                except BlobError as e:
                    raise DamagedSource(f"{self.ckpt.root / rel}: {entry.key} chunk {chunk.index} is not an intact "
                                        f"torch.save blob ({e}); nothing was written") from None
                start = ref.offset + layout.payload_offset
                got = self._join(fd, rel, start, start + layout.payload_bytes)
                if got != layout.payload_crc:
                    raise DamagedSource(f"{self.ckpt.root / rel}: {entry.key} chunk {chunk.index} fails its zip "
                                        f"CRC-32 (the record says {layout.payload_crc:08x}, its bytes give {got:08x}): "
                                        "the source's data is damaged, so nothing was written; run `ckpt verify "
                                        "--data` on it")


def _merged(ranges: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    """Ranges ``[a, b)`` merged where they overlap or touch, as the sorted starts and their ends."""
    starts: list[int] = []
    ends: list[int] = []
    for a, b in sorted(ranges):
        if ends and a <= ends[-1]:
            ends[-1] = max(ends[-1], b)
        else:
            starts.append(a)
            ends.append(b)
    return starts, ends


def _meets(merged: tuple[list[int], list[int]], lo: int, hi: int) -> bool:
    """Whether ``[lo, hi)`` meets any of the merged ranges."""
    starts, ends = merged
    i = bisect.bisect_right(starts, lo) - 1
    if i >= 0 and ends[i] > lo:
        return True
    return i + 1 < len(starts) and starts[i + 1] < hi


def record_tasks(records: list[tuple[Entry, Chunk]]) -> list[tuple[str, list[tuple[Entry, Chunk]]]]:
    """Records grouped per file, in file order, in runs of about :data:`FILL_TASK` stored bytes: one background
    task each (a million small records make a few tasks, not a million)."""
    by_file: dict[str, list[tuple[Entry, Chunk]]] = {}
    for entry, chunk in records:
        assert chunk.storage is not None
        by_file.setdefault(chunk.storage.file, []).append((entry, chunk))
    out: list[tuple[str, list[tuple[Entry, Chunk]]]] = []
    for rel, items in by_file.items():
        items.sort(key=lambda r: r[1].storage.offset if r[1].storage is not None else 0)
        run: list[tuple[Entry, Chunk]] = []
        acc = 0
        for item in items:
            run.append(item)
            acc += item[1].storage.length if item[1].storage is not None else 0
            if acc >= FILL_TASK:
                out.append((rel, run))
                run, acc = [], 0
        if run:
            out.append((rel, run))
    return out


def readable_bytes(ckpt: Checkpoint) -> int:
    """Bytes of the data files a copy may go through (:func:`gtp_format.reader.storage.readable_bytes`:
    each file's size, capped by a bounded multiple of what it stores on disk): a sparse file of any
    declared size stores almost nothing, so a budget from its size is no budget, while the holes a
    writer left for zero runs are read as the zeros they are."""
    total = 0
    for rel in ckpt.data_files:
        with open_regular(ckpt.store, rel) as f:  # an object in a bucket stores every byte of its size
            total += f.readable_bytes()  # type: ignore[attr-defined]
    return total
