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
thread after it. Measured (4.67 GB checkpoint, page cache evicted, 2 shared cores): the
sequential gap reads were 8 of the weights-only export's 10 s in a profile (py-spy); see
``docs/performance.md``, "ckpt export --to hf at 4.67 GB".
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from gtp_format import ranks
from gtp_format.errors import EXIT_CHECK_FAILED, ChunkError, FormatError
from gtp_format.hashing import CRCS, HASHERS, Crc, file_digests
from gtp_format.model import BYTES, ENC_TORCH_SAVE, TENSOR, Checkpoint
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

        Only files with a manifest checksum over the whole file: a zip-record check (a genuine
        Megatron file) joins per tensor payload, which these ranges do not follow.
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
        for rel, mode in self.modes.items():
            if mode.kind != "file" or mode.size is None:
                continue  # no size to bound the ranges by: finish() reads and checks it
            at = 0
            for a, b in sorted(taken.get(rel, ())) + [(mode.size, mode.size)]:
                for lo in range(at, min(a, mode.size), FILL_TASK):
                    tasks.append((rel, lo, min(lo + FILL_TASK, a, mode.size)))
                at = max(at, b)
        if not tasks:
            return
        threads = BUCKET_FILL_THREADS if storage_for(self.ckpt.root).remote else FILL_THREADS
        self._fill_pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="ledger-fill")
        self._fill = [self._fill_pool.submit(self._fill_range, *t) for t in tasks]

    def _fill_range(self, rel: str, lo: int, hi: int) -> None:
        buf = getattr(self._local, "buf", None)
        if buf is None:
            buf = self._local.buf = bytearray(BLOCK)
        with open_regular(self.ckpt.root, rel) as f:
            if f.sparse_message(rel) is not None:  # type: ignore[attr-defined]
                return  # holes nobody wrote: finish() refuses the file without reading them
            src, size = source_of(f), size_of(f)  # a descriptor, or a bucket's object (no fileno)
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
                with streamed(open_regular(self.ckpt.root, rel)) as f:
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


def readable_bytes(ckpt: Checkpoint) -> int:
    """Bytes of the data files a copy may go through (:func:`gtp_format.reader.storage.readable_bytes`:
    each file's size, capped by a bounded multiple of what it stores on disk): a sparse file of any
    declared size stores almost nothing, so a budget from its size is no budget, while the holes a
    writer left for zero runs are read as the zeros they are."""
    total = 0
    for rel in ckpt.data_files:
        with open_regular(ckpt.root, rel) as f:  # an object in a bucket stores every byte of its size
            total += f.readable_bytes()  # type: ignore[attr-defined]
    return total
