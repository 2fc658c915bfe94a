"""Read-ahead for a pass that knows, before it starts, every range it will read of one object.

Why: ``verify --data`` reads each data file as a list of windows (2 MiB, cut at chunk boundaries)
planned from the metadata. On a bucket one ``GET`` per window on two worker threads ran at 0.50x
boto3's ``download_file`` of the same objects, which keeps 10 parts of 8 MiB in flight. Here the
plan's ranges are coalesced (:func:`gtp_format.storage.ranges.coalesce`: adjacent or near ranges,
requests of at most :data:`gtp_format.storage.objects.PART`) and the next requests are fetched on
:meth:`gtp_format.storage.objects.BucketState.pool` while the workers check the ones already in. Memory is
bounded: at most ``ahead`` requests are held per stream, and a request is dropped once every range
it serves has been taken.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable
from concurrent.futures import Future

from gtp_format.storage import objects
from gtp_format.storage.ranges import GAP, Request, coalesce


def aligned_requests(ranges: list[tuple[int, int]], size: int, part: int) -> list[Request]:
    """Requests of whole ``part``-aligned pieces of the object (the last one shorter) that meet any of ``ranges``,
    each with the ranges it serves, in file order.

    Why, for ``verify --data`` of a bucket: its windows end at chunk boundaries, so they average under a request's
    size (5.9 MB of 8 MiB at 304.8 MB), and each window its own request was 25 % more requests than the bytes
    need; on moto each costs a copy of its whole object. A window across a piece boundary is served by both.
    """
    pieces: dict[int, Request] = {}
    for i, (start, stop) in enumerate(ranges):
        if not 0 <= start < stop <= size:
            raise ValueError(f"range [{start}, {stop}) is empty or outside the object's {size} bytes")
        for k in range(start // part, (stop - 1) // part + 1):
            pieces.setdefault(k, Request(k * part, min(size, (k + 1) * part))).members.append(i)
    return [pieces[k] for k in sorted(pieces)]


class ObjectStream:
    """Ranges of one object, read in (about) the order given, fetched ahead; thread-safe."""

    def __init__(self, obj: objects.ObjectFile, ranges: list[tuple[int, int]], ahead: int = objects.IN_FLIGHT,
                 aligned: bool = False) -> None:
        self.obj, self.ahead = obj, max(1, ahead)
        kept = [r for r in ranges if r[1] > r[0]]
        self.requests = aligned_requests(kept, obj.size, objects.PART) if aligned else \
            coalesce(kept, obj.size, cap=objects.PART, gap=0)
        self._starts = [r.start for r in self.requests]
        self._left = [len(r.members) for r in self.requests]  # ranges each request still serves
        self._got: dict[int, Future[memoryview]] = {}
        self._next = 0  # the first request not submitted yet
        self._lock = threading.Lock()
        self._closed = False

    def _submit_to(self, last: int) -> None:
        """Submit every request up to ``last`` (inclusive), and keep ``ahead`` in flight past it; under the lock."""
        stop = min(len(self.requests), max(last + 1, self._next) + self.ahead - 1)
        while self._next < stop:
            r = self.requests[self._next]
            self._got[self._next] = self.obj.state.pool().submit(objects.fetch, self.obj.root, self.obj.rel, r.start,
                                                          r.stop - r.start)
            self._next += 1

    def read(self, start: int, stop: int) -> bytes:
        """Exactly the bytes ``[start, stop)``, one of the planned ranges (another range is read directly)."""
        first = bisect.bisect_right(self._starts, start) - 1
        last = bisect.bisect_left(self._starts, stop) - 1
        if first < 0 or stop <= start or start >= self.requests[first].stop or stop > self.requests[last].stop \
                or self._closed:
            return self.obj.pread(stop - start, start)
        with self._lock:
            if any(i not in self._got and i < self._next for i in range(first, last + 1)):
                futures = None  # already dropped: read again (a plan read twice)
            else:
                self._submit_to(last)
                futures = [(i, self._got[i]) for i in range(first, last + 1)]
        if futures is None:
            return self.obj.pread(stop - start, start)
        parts = []
        for i, fut in futures:
            r = self.requests[i]
            data = fut.result()
            parts.append(data[max(start, r.start) - r.start:min(stop, r.stop) - r.start])
        with self._lock:
            for i, _ in futures:
                self._left[i] -= 1
                if self._left[i] <= 0:
                    self._got.pop(i, None)
        out = bytes(parts[0]) if len(parts) == 1 else b"".join(parts)
        return out if len(out) == stop - start else self.obj.pread(stop - start, start)  # it spans a hole

    def close(self) -> None:
        """Stop fetching ahead and drop what was fetched (a pass that ended early or failed)."""
        with self._lock:
            self._closed = True
            got, self._got = self._got, {}
        for fut in got.values():
            fut.cancel()


class PlanPrefetch:
    """Whole extents (a chunk's blob: its zip structure and its payload) of several objects, fetched ahead in the
    order a copy will read them, at most ``budget`` bytes held or in flight; thread-safe.

    Why: ``export`` read each chunk as two 64 KiB structure blocks and then its payload, one request after
    another, with nothing in flight ahead (``export --to hf`` at 0.32x boto3's ``download_file``, ``--to torch``
    at 0.10x; benchmarks/bench_s3_ckpt.py). Here one request serves a chunk's structure and payload together,
    extents that follow each other in one object share a request of up to
    :data:`gtp_format.storage.objects.PART`, and the
    next requests are in flight while the copy decodes and writes the ones already in.

    Memory: a request is dropped once every extent it holds was :meth:`done`; when the next request would pass
    ``budget``, the oldest held ones are dropped first (an extent the copy never reads, e.g. a replica the
    per-parameter view skips, cannot pin memory). An extent dropped before it was read, or never planned, is
    :meth:`get`'s ``None``: the caller reads it directly, so the plan only changes the speed, never the bytes.
    ``on_served(obj, offset, data)`` is called once per request, the first time one of its extents is served
    (the copy's integrity ledger hashes what the copy used, as it arrives). An extent that starts at most ``gap``
    bytes after the previous one of its object joins its request, the hole read through (on moto every request
    costs a copy of its whole object; anywhere, a round trip): the hole is hashed with it, so the ledger does not
    read it again (:meth:`ranges`).
    """

    def __init__(self, extents: list[tuple[objects.ObjectFile, int, int, object]], budget: int,
                 on_served: Callable[[objects.ObjectFile, int, memoryview], None] | None = None,
                 gap: int = GAP) -> None:
        self.budget = max(budget, objects.PART)
        # an extent larger than a request of PART is one request of its own, up to a quarter of the budget:
        # a 2048 x 1024 fp32 chunk is 8 MiB of payload and 1.5 KiB of zip, just over PART; left unplanned, 96
        # such chunks of a 1.2 GB checkpoint were read on the workers' threads and by the ledger's fill too
        self.max_extent = max(objects.PART, self.budget // 4)
        self.on_served = on_served
        self.requests: list[tuple[objects.ObjectFile, int, int]] = []
        self._where: dict[object, tuple[int, int, int]] = {}  # extent id -> (request, start, stop)
        by_object: dict[int, list[tuple[int, int, int, object]]] = {}  # id(obj) -> (start, stop, plan index, id)
        objs: dict[int, objects.ObjectFile] = {}
        for n, (obj, start, stop, ident) in enumerate(extents):
            if ident in self._where or not 0 <= start < stop <= obj.size or stop - start > self.max_extent:
                continue  # read directly: planned twice, empty, outside the object, or larger than max_extent
            self._where[ident] = (-1, start, stop)
            by_object.setdefault(id(obj), []).append((start, stop, n, ident))
            objs[id(obj)] = obj
        planned: list[tuple[int, objects.ObjectFile, int, int, list[object]]] = []  # (first plan index, request)
        for key, items in by_object.items():  # each object in file order: neighbours share a request
            items.sort(key=lambda t: (t[0], t[1]))
            run: list[object] = []
            for start, stop, n, ident in items:
                # a run grows to PART, or to one larger extent that starts where the run does (so two requests
                # never start at one offset: each is hashed once, by its start, in the ledger)
                if run and start <= planned[-1][3] + gap and \
                        max(stop, planned[-1][3]) - planned[-1][2] <= max(objects.PART, stop - start):
                    first, obj, a, b, run = planned[-1]
                    planned[-1] = (min(first, n), obj, a, max(b, stop), [*run, ident])
                    continue
                run = [ident]
                planned.append((n, objs[key], start, stop, run))
        planned.sort(key=lambda r: r[0])  # requests in the order the copy first needs them
        members: list[int] = []
        for k, (_, obj, a, b, run) in enumerate(planned):
            self.requests.append((obj, a, b))
            members.append(len(run))
            for ident in run:
                _, start, stop = self._where[ident]
                self._where[ident] = (k, start, stop)
        self._left = members
        self._got: dict[int, Future[memoryview]] = {}
        self._served: set[int] = set()
        self._held = 0
        self._next = 0
        self._lock = threading.Lock()
        self._closed = False

    def ranges(self) -> dict[str, list[tuple[int, int]]]:
        """The planned requests' byte ranges, by object name (what a served request hands to ``on_served``)."""
        out: dict[str, list[tuple[int, int]]] = {}
        for obj, a, b in self.requests:
            out.setdefault(obj.rel, []).append((a, b))
        return out

    def _size(self, i: int) -> int:
        _, a, b = self.requests[i]
        return b - a

    def _drop(self, i: int) -> None:
        fut = self._got.pop(i, None)
        if fut is not None:
            fut.cancel()
            self._held -= self._size(i)

    def _submit(self, i: int) -> None:
        obj, a, b = self.requests[i]
        self._got[i] = obj.state.pool().submit(objects.fetch, obj.root, obj.rel, a, b - a)
        self._held += b - a

    def _submit_to(self, want: int) -> None:
        """Submit every request up to ``want``, dropping the oldest held ones past the budget, then the next ones
        while they fit; under the lock."""
        while self._next <= want:
            while self._got and self._held + self._size(self._next) > self.budget:
                self._drop(min(self._got))
            self._submit(self._next)
            self._next += 1
        while self._next < len(self.requests) and self._held + self._size(self._next) <= self.budget:
            self._submit(self._next)
            self._next += 1

    def get(self, ident: object) -> memoryview | None:
        """The bytes of extent ``ident``, or None where it is not (or no longer) held: read it directly."""
        where = self._where.get(ident)
        if where is None:
            return None
        i, start, stop = where
        with self._lock:
            if self._closed or (i < self._next and i not in self._got):
                return None
            self._submit_to(i)
            fut = self._got[i]
        try:
            data = fut.result()
        except Exception:  # noqa: BLE001 - the direct read that follows reports it in its own words
            return None
        first = False
        with self._lock:
            if i not in self._served:
                self._served.add(i)
                first = True
        obj, a, _ = self.requests[i]
        if first and self.on_served is not None:
            self.on_served(obj, a, data)
        return data[start - a:stop - a]

    def done(self, ident: object) -> None:
        """Extent ``ident`` has been read whole: its request is dropped once all of its extents are."""
        where = self._where.get(ident)
        if where is None:
            return
        with self._lock:
            i = where[0]
            self._left[i] -= 1
            if self._left[i] <= 0:
                self._drop(i)

    def close(self) -> None:
        """Stop fetching and drop what is held (the copy ended or failed)."""
        with self._lock:
            self._closed = True
            for i in list(self._got):
                self._drop(i)
