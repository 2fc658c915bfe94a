"""Read any box of a stored tensor, touching only the bytes it needs: the streaming read of reshard.

A chunk is stored row-major, so rows ``[a, b)`` of a chunk are one contiguous byte range: a box
read intersects the key's chunks and reads, for each, the row range it needs (then slices the
other dimensions in memory). A chunk stored in another dimension order (a transposed tensor that
DCP saved as it was) is read as the runs its rows occupy (:meth:`BoxReader._permuted_rows`), so
it too costs its own bytes once, however many row blocks ask for it. Nothing ever reads a whole
chunk it only needs part of, which is what keeps ``ckpt reshard --max-memory`` true for a
parameter larger than the budget.

``torch.save`` blobs (torch_dist) are located by parsing the blob's zip structure and its small
``data.pkl`` through :func:`gtp_format.reader.blob.parse_blob` over a bounded range reader (the
elements are never read for that); the layout is cached per chunk. Raw chunks (safetensors) need
no parse. Each data file is opened once, confined to the folder (:func:`gtp_format.reader.
storage.open_regular`), and every range is checked against its real size before it is read
(:func:`gtp_format.reader.storage.pread_into`), straight into the caller's buffer. Elements come
back as numpy arrays of the stored bits (:func:`gtp_format.scan.carrier`), so copies are
bit-exact whatever the dtype. No torch.
"""

from __future__ import annotations

import bisect
import contextlib
import math
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from gtp_format.errors import ChunkError
from gtp_format.layout.boxes import intersection
from gtp_format.model import ENC_RAW, TENSOR, Checkpoint, Chunk, Entry
from gtp_format.reader.blob import parse_blob
from gtp_format.reader.chunks import blob_error, check_layout, checked_ref
from gtp_format.reader.storage import Source, open_regular, pread_into, size_of, source_of, streamed
from gtp_format.reader.zip_blob import BlobError, RangeReader, ViewReader
from gtp_format.scan import carrier
from gtp_format.storage import objects
from gtp_format.storage.base import storage_for
from gtp_format.storage.prefetch import PlanPrefetch

PREFETCH_BUDGET = objects.IN_FLIGHT * objects.PART  # a bucket's chunks held or in flight ahead of a copy (64 MiB)


def dense_order(sizes: tuple[int, ...], strides: tuple[int, ...]) -> list[int] | None:
    """The dimensions (of size > 1) from outermost to innermost in storage, when the strides are a
    dense, gapless permutation of the sizes (what ``torch.clone`` keeps of a transposed tensor);
    ``None`` for any other strides (gaps, overlaps, broadcasting)."""
    dims = sorted((d for d in range(len(sizes)) if sizes[d] > 1), key=lambda d: -strides[d])
    expected = 1
    for d in reversed(dims):
        if strides[d] != expected:
            return None
        expected *= sizes[d]
    return dims


class Buffer:
    """A reusable byte buffer, grown on demand: :meth:`get` hands out its first ``n`` bytes.

    What it returns is overwritten by the next :meth:`get`; one per thread and purpose.
    """

    def __init__(self) -> None:
        self._arr = np.empty(0, dtype=np.uint8)

    def get(self, n: int) -> np.ndarray:
        if self._arr.nbytes < n:
            self._arr = np.empty(n, dtype=np.uint8)
        return self._arr[:n]


class BoxReader:
    """Box reads on one checkpoint; thread-safe (the layout cache is guarded)."""

    def __init__(self, ckpt: Checkpoint) -> None:
        self.ckpt = ckpt
        self._layouts: dict[tuple[str, int], tuple[int, tuple[int, ...] | None]] = {}
        self._crcs: dict[tuple[str, int], int] = {}  # zip record CRC-32 of chunks whose payload is their whole view
        self._lock = threading.Lock()
        self._index: dict[str, tuple[list[Chunk], list[int], list[int]]] = {}
        self._files: dict[str, tuple[Any, int]] = {}  # open data files and their sizes, opened once
        self.bytes_read = 0
        self._prefetch: ThreadPoolExecutor | None = None
        self._plan: PlanPrefetch | None = None  # a bucket's chunks, fetched whole ahead of the copy
        self._consumed: dict[tuple[str, int], int] = {}  # payload bytes read per planned chunk
        self._uses: dict[tuple[str, int], int] = {}  # reads still to come per chunk, when the plan counted them
        self._stop = threading.Event()

    def _file(self, rel: str) -> tuple[Source, int]:
        """Descriptor and size of a data file, opened (confined to the folder) on first use."""
        with self._lock:
            got = self._files.get(rel)
            if got is None:
                f = streamed(open_regular(self.ckpt.store, rel))
                got = self._files[rel] = (f, size_of(f))
        return source_of(got[0]), got[1]

    def close(self) -> None:
        """Close the data files this reader keeps open (reading again reopens them); stop a prefetch."""
        self._stop.set()
        if self._prefetch is not None:
            self._prefetch.shutdown(wait=True, cancel_futures=True)
            self._prefetch = None
        if self._plan is not None:
            self._plan.close()
            self._plan = None
        with self._lock:
            files, self._files = self._files, {}
        for f, _ in files.values():
            f.close()

    def prefetch_layouts(self, keys: list[str], threads: int = 4, budget: int = PREFETCH_BUDGET) -> None:
        """Parse, on background threads, the ``torch.save`` structure of every chunk of ``keys`` in
        that order, ahead of the copy that will read them (the parse is cached per chunk). From a bucket,
        fetch every chunk of at most one request whole instead, in that order, at most ``budget`` bytes
        ahead (:class:`gtp_format.storage.prefetch.PlanPrefetch`): structure and payload come from the
        same request.

        Why: each blob's structure is four or five small reads far apart (end record, central
        directory, local headers, ``data.pkl``); from a cold page cache each waits for the disk, and
        a profile (py-spy) of a weights-only 4.67 GB export put 30 % of its one writer's time there.
        On a bucket each was a round trip of its own, and each payload one more with nothing ahead.
        Errors are left to the copy's own read, which reports them in its words.
        """
        entries = [self.ckpt.entries[k] for k in keys if k in self.ckpt.entries]
        ordered = [(e, c) for e in entries if e.kind == TENSOR
                   for c in sorted(e.chunks, key=lambda c: c.offsets[0] if c.offsets else 0) if c.storage is not None]
        if storage_for(self.ckpt.store).remote:
            self.prefetch_chunks([(e.key, c) for e, c in ordered], budget)
            return
        if self.ckpt.encoding == ENC_RAW or self._prefetch is not None:
            return
        self._stop.clear()
        chunks = ordered

        def one(i: int) -> None:
            if not self._stop.is_set():
                with contextlib.suppress(Exception):
                    self._payload_start(*chunks[i])

        self._prefetch = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="layouts")
        for i in range(len(chunks)):
            self._prefetch.submit(one, i)

    def prefetch_chunks(self, order: list[tuple[str, Chunk]], budget: int = PREFETCH_BUDGET) -> None:
        """From a bucket, fetch these chunks (of keys, in the order a copy will read them) whole, ahead of the
        copy, at most ``budget`` bytes ahead: the plan of :meth:`prefetch_layouts` for a copy that reads parts
        of keys in an order of its own (``ckpt reshard``: each target chunk's box, from the chunks it meets,
        :meth:`box_chunks`). One item per :meth:`chunk_rows` call to come: a chunk named twice is fetched
        where it first comes and held until its last read. Nothing on a disk, and nothing once a plan was
        made (one plan per reader)."""
        if self._plan is not None or not storage_for(self.ckpt.store).remote:
            return
        ordered: list[tuple[Entry, Chunk]] = []
        for key, c in order:
            e = self.ckpt.entries.get(key)
            if e is not None and e.kind == TENSOR and c.storage is not None:
                if (key, c.index) not in self._uses:
                    ordered.append((e, c))
                self._uses[(key, c.index)] = self._uses.get((key, c.index), 0) + 1  # one chunk_rows call each
        self._plan_bucket(ordered, budget)

    def _plan_bucket(self, ordered: list[tuple[Entry, Chunk]], budget: int) -> None:
        extents = []
        for e, c in ordered:
            try:
                ref = checked_ref(self.ckpt, e, c)
                obj, _ = self._file(ref.file)
            except ChunkError:
                continue  # the copy's own read reports it
            if obj.remote:  # type: ignore[union-attr]
                extents.append((obj, ref.offset, ref.offset + ref.length, (e.key, c.index)))
        self._plan = PlanPrefetch(extents, budget, self._served)

    def planned_ranges(self) -> dict[str, list[tuple[int, int]]]:
        """Byte ranges of each data file the bucket prefetch reads (and hands to :meth:`_record`); none on a disk."""
        return self._plan.ranges() if self._plan is not None else {}

    def _served(self, obj: objects.ObjectFile, offset: int, data: memoryview) -> None:
        """A prefetched request's bytes, the first time the copy uses them (see :meth:`_record`)."""
        self._record(obj.rel, offset, data)

    def _record(self, rel: str, offset: int, data: np.ndarray | memoryview) -> None:
        """Bytes at ``offset`` of ``rel`` that the copy read and uses; :class:`CheckedReader` hashes them."""

    def _held(self, entry: Entry, chunk: Chunk) -> memoryview | None:
        """A planned chunk's whole extent, when the bucket prefetch holds it."""
        return self._plan.get((entry.key, chunk.index)) if self._plan is not None else None

    def _chunks_near(self, entry: Entry, lo: int, hi: int) -> list[Chunk]:
        """Chunks whose dim-0 range may meet ``[lo, hi)``: bisection, not a scan of every chunk."""
        idx = self._index.get(entry.key)
        if idx is None:
            ordered = sorted(entry.chunks, key=lambda c: c.offsets[0] if c.offsets else 0)
            starts = [c.offsets[0] if c.offsets else 0 for c in ordered]
            run, ends = 0, []
            for c in ordered:
                run = max(run, (c.offsets[0] + c.sizes[0]) if c.offsets else 1)
                ends.append(run)
            idx = self._index[entry.key] = (ordered, starts, ends)
        ordered, starts, ends = idx
        return ordered[bisect.bisect_right(ends, lo):bisect.bisect_left(starts, hi)]

    def _payload_start(self, entry: Entry, chunk: Chunk) -> tuple[int, tuple[int, ...] | None]:
        """Absolute file offset of a chunk's first element, and its element strides when they are
        not row-major (``None``: row-major, rows are one byte range)."""
        ref = checked_ref(self.ckpt, entry, chunk)
        if self.ckpt.encoding == ENC_RAW:
            return ref.offset, None
        cache_key = (entry.key, chunk.index)
        with self._lock:
            if cache_key in self._layouts:
                return self._layouts[cache_key]
        held = self._held(entry, chunk)
        fd, _ = self._file(ref.file)  # opened once per file: on a bucket, one HEAD per object, not per chunk
        try:
            layout = parse_blob(ViewReader(held) if held is not None else RangeReader(fd, ref.offset, ref.length))
            check_layout(layout, entry, chunk)
        except BlobError as e:
            raise blob_error(entry, chunk, e) from None
        row_major = tuple(math.prod(chunk.sizes[i + 1:]) for i in range(len(chunk.sizes)))
        strides: tuple[int, ...] | None = None
        if layout.stride != row_major and math.prod(chunk.sizes) > 1:
            if dense_order(chunk.sizes, layout.stride) is None:
                raise ChunkError(f"{entry.key} chunk {chunk.index} in {ref.file} is a strided view with gaps or "
                                 f"overlaps (sizes {list(chunk.sizes)}, strides {list(layout.stride)}), which "
                                 "torch.distributed.checkpoint never writes; re-save the tensor contiguous",
                                 key=entry.key, chunk=chunk.index, file=ref.file)
            strides = tuple(layout.stride)
        got = (ref.offset + layout.payload_offset + layout.storage_offset * layout.dtype.itemsize, strides)
        with self._lock:
            self._layouts[cache_key] = got
            if layout.contiguous_whole:
                self._crcs[cache_key] = layout.payload_crc
        return got

    def whole_chunk(self, key: str, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> Chunk | None:
        """The one stored chunk that is exactly the box ``offsets``/``sizes`` of tensor ``key``, if one is."""
        got = self.box_chunks(key, offsets, sizes)
        if len(got) != 1 or tuple(got[0].offsets) != tuple(offsets) or tuple(got[0].sizes) != tuple(sizes):
            return None
        return got[0]

    def payload_crc(self, key: str, chunk: Chunk) -> int | None:
        """The CRC-32 its zip record gives for the payload of a ``torch.save`` chunk already read whose view is
        its whole storage, row-major (so the rows :meth:`chunk_rows` read are exactly that payload); ``None``
        for any other chunk, or one not read yet."""
        with self._lock:
            return self._crcs.get((key, chunk.index))

    def chunk_rows(self, entry: Entry, chunk: Chunk, r0: int, r1: int, buf: Buffer | None = None,
                   into: np.ndarray | None = None) -> np.ndarray:
        """Rows ``[r0, r1)`` (dim 0, chunk-relative) of a chunk, as stored bits.

        With ``buf`` the rows are read into that reusable buffer (valid until its next use), not a
        new array: a fresh 64 MiB array costs a page fault per 4 KiB on first touch, which
        profiling showed cost more than the read itself. With ``into`` (a C-contiguous array of
        exactly the rows' bytes, e.g. rows of the caller's own output) they are read there.
        """
        assert entry.dtype is not None
        dt = carrier(entry.dtype)
        row = math.prod(chunk.sizes[1:]) if len(chunk.sizes) > 1 else 1
        start, strides = self._payload_start(entry, chunk)
        n = (r1 - r0) * row
        ref = chunk.storage
        assert ref is not None
        out = into.reshape(-1).view(np.uint8) if into is not None else (buf or Buffer()).get(n * dt.itemsize)
        if out.nbytes != n * dt.itemsize:
            raise ValueError(f"{entry.key}: a {out.nbytes}-byte destination for {n * dt.itemsize} bytes of rows")
        at = start + r0 * row * dt.itemsize
        held = self._held(entry, chunk) if strides is None and out.nbytes else None
        try:
            fd, size = self._file(ref.file)
            if held is not None and ref.offset <= at and at + out.nbytes <= ref.offset + held.nbytes:
                out[:] = np.frombuffer(held, np.uint8, out.nbytes, at - ref.offset)  # hashed when it was served
                self._consume(entry, chunk, out.nbytes)
            elif strides is None:
                pread_into(fd, ref.file, size, at, memoryview(out))
                if out.nbytes:
                    self._record(ref.file, at, out)
                    self._consume(entry, chunk, out.nbytes)
            else:
                self._permuted_rows(fd, ref.file, size, start, chunk.sizes, strides, r0, r1, dt, out)
        except ChunkError as e:
            raise ChunkError(f"{entry.key} chunk {chunk.index}: {e.message}", key=entry.key, chunk=chunk.index,
                             file=ref.file) from None
        self.bytes_read += out.nbytes
        return out.view(dt).reshape((r1 - r0, *chunk.sizes[1:]))

    def _consume(self, entry: Entry, chunk: Chunk, n: int) -> None:
        """``n`` more payload bytes of a planned chunk were read: once all were (or, for a plan that counted its
        reads, once the last planned read came), the prefetch may drop it; told once per chunk.

        Why the count: a reshard reads some chunks whole more than once (a replicated parameter's state goes
        into every target rank's buffer), so "every byte read" came at the first of those reads; each later
        ``done`` of the same chunk dropped its request under the chunks that still needed it (22 chunks of a
        fixture read again by 2 requests each)."""
        if self._plan is None or entry.dtype is None:
            return
        key = (entry.key, chunk.index)
        with self._lock:
            if key in self._uses:
                self._uses[key] -= 1
                last = self._uses[key] == 0
            else:
                got = self._consumed[key] = self._consumed.get(key, 0) + n
                last = got - n < math.prod(chunk.sizes) * carrier(entry.dtype).itemsize <= got
        if last:
            self._plan.done(key)

    @staticmethod
    def _permuted_rows(fd: int, rel: str, size: int, start: int, sizes: tuple[int, ...], strides: tuple[int, ...],
                       r0: int, r1: int, dt: np.dtype, out: np.ndarray) -> None:
        """Rows ``[r0, r1)`` of a dense chunk stored in another dimension order (a transposed weight),
        read as the runs they occupy and rearranged into ``out`` (row-major).

        Why not decode the whole chunk: that cost the whole chunk's bytes per row block, so a
        transposed chunk read in B blocks read it B times (quadratic) and held it whole, beyond
        ``--max-memory``. In storage order the chunk is row-major over its dimensions
        sorted by stride; rows of dim 0 are, for each index of the dimensions stored outside it,
        one contiguous run of ``(r1 - r0) * stride[0]`` elements. So a block reads exactly its
        own bytes, in one ``pread`` per outer index, into one temporary of the block's size.
        """
        order = dense_order(sizes, strides)
        assert order is not None
        if r1 <= r0:
            return
        isz = dt.itemsize
        if sizes[0] == 1 or 0 not in order:  # one row: the block is the whole chunk, one range
            outer, inner = [], [d for d in order if d != 0]
        else:
            p = order.index(0)
            outer, inner = order[:p], order[p + 1:]
        run = (r1 - r0) * (strides[0] if sizes[0] > 1 else math.prod(sizes[d] for d in inner))
        shape = [sizes[d] for d in outer] + [r1 - r0] + [sizes[d] for d in inner]
        tmp = np.empty(math.prod(shape) * isz, dtype=np.uint8)
        view = memoryview(tmp)
        for k, idx in enumerate(np.ndindex(*[sizes[d] for d in outer])):
            at = start + (sum(i * strides[d] for i, d in zip(idx, outer)) + r0 * strides[0]) * isz
            pread_into(fd, rel, size, at, view[k * run * isz:(k + 1) * run * isz])
        axes = [*outer, 0, *inner]
        arranged = tmp.view(dt).reshape(shape).transpose(np.argsort(axes))
        out.view(dt).reshape(r1 - r0, *sizes[1:])[...] = arranged.reshape(r1 - r0, *sizes[1:])

    def _near_and_whole(self, entry: Entry, offsets: tuple[int, ...], sizes: tuple[int, ...]
                        ) -> tuple[list[Chunk], Chunk | None]:
        """The chunks that may meet the box, and the one that holds it as whole rows (None: it is assembled)."""
        near = self._chunks_near(entry, offsets[0], offsets[0] + sizes[0]) if sizes else list(entry.chunks)
        whole = [c for c in near if all(co <= o and o + s <= co + cs and (i == 0 or (co, cs) == (o, s))
                                        for i, (o, s, co, cs) in enumerate(zip(offsets, sizes, c.offsets, c.sizes)))]
        return near, whole[0] if whole and sizes else None

    def box_chunks(self, key: str, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> list[Chunk]:
        """The chunks :meth:`read_box` reads for this box, in its order, without reading (none for a key or box
        it would refuse: that read reports it)."""
        entry = self.ckpt.entries.get(key)
        if entry is None or entry.kind != TENSOR or entry.shape is None or len(offsets) != len(entry.shape):
            return []
        near, whole = self._near_and_whole(entry, offsets, sizes)
        if whole is not None:
            return [whole]
        return [c for c in near if intersection((offsets, sizes), (c.offsets, c.sizes)) is not None]

    def read_box(self, key: str, offsets: tuple[int, ...], sizes: tuple[int, ...],
                 buf: Buffer | None = None, into: np.ndarray | None = None) -> np.ndarray:
        """The box ``offsets``/``sizes`` of tensor ``key``; every element must be in some chunk.

        ``buf``: the result is read or assembled in this reusable buffer (see :meth:`chunk_rows`); ``into``: in
        this C-contiguous array of exactly the box's bytes instead (rows of the caller's own result).
        Chunks that hold whole rows of the box are read straight into the result's rows.
        """
        entry = self.ckpt.entries.get(key)
        if entry is None or entry.kind != TENSOR or entry.shape is None or entry.dtype is None:
            raise ChunkError(f"{self.ckpt.root}: tensor {key!r} is missing; the checkpoint is incomplete", key=key)
        if len(offsets) != len(entry.shape) or any(o < 0 or o + s > d for o, s, d in zip(offsets, sizes, entry.shape)):
            raise ChunkError(f"{key}: box {list(offsets)}+{list(sizes)} leaves its shape {list(entry.shape)}", key=key)
        near, whole = self._near_and_whole(entry, offsets, sizes)
        if whole is not None:  # one chunk holds the box as whole rows: its bytes are the answer, no copy
            c = whole
            return self.chunk_rows(entry, c, offsets[0] - c.offsets[0], offsets[0] + sizes[0] - c.offsets[0], buf,
                                   into)
        dt = carrier(entry.dtype)
        if into is not None:
            if into.nbytes != math.prod(sizes) * dt.itemsize:
                raise ValueError(f"{key}: a {into.nbytes}-byte destination for box {list(sizes)} of {dt}")
            out = into.reshape(-1).view(np.uint8).view(dt).reshape(sizes)
        else:
            out = np.empty(sizes, dtype=dt) if buf is None else \
                buf.get(math.prod(sizes) * dt.itemsize).view(dt).reshape(sizes)
        covered = 0
        for c in near:
            cut = intersection((offsets, sizes), (c.offsets, c.sizes))
            if cut is None:
                continue
            lo, hi = cut
            if sizes and all((co, cs) == (o, s) for o, s, co, cs in zip(offsets[1:], sizes[1:], c.offsets[1:],
                                                                           c.sizes[1:])):
                self.chunk_rows(entry, c, lo[0] - c.offsets[0], hi[0] - c.offsets[0],
                                into=out[lo[0] - offsets[0]:hi[0] - offsets[0]])  # whole rows: read in place
                covered += math.prod(b - a for a, b in zip(lo, hi))
                continue
            rows = self.chunk_rows(entry, c, lo[0] - c.offsets[0], hi[0] - c.offsets[0])
            src = rows[(slice(None), *(slice(a - co, b - co) for a, b, co in zip(lo[1:], hi[1:], c.offsets[1:])))]
            out[tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, offsets))] = src
            covered += math.prod(b - a for a, b in zip(lo, hi))
        if covered != math.prod(sizes):
            raise ChunkError(f"{key}: {math.prod(sizes) - covered} elements of box {list(offsets)}+{list(sizes)} are "
                             "in no chunk (or in several); the checkpoint is incomplete", key=key)
        return out
