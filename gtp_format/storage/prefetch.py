"""Read-ahead for a pass that knows, before it starts, every range it will read of one object.

Why: ``verify --data`` reads each data file as a list of windows (2 MiB, cut at chunk boundaries)
planned from the metadata. On a bucket one ``GET`` per window on two worker threads ran at 0.50x
boto3's ``download_file`` of the same objects, which keeps 10 parts of 8 MiB in flight. Here the
plan's ranges are coalesced (:func:`gtp_format.storage.ranges.coalesce`: adjacent or near ranges,
requests of at most :data:`gtp_format.storage.objects.PART`) and the next requests are fetched on
:func:`gtp_format.storage.objects.pool` while the workers check the ones already in. Memory is
bounded: at most ``ahead`` requests are held per stream, and a request is dropped once every range
it serves has been taken.
"""

from __future__ import annotations

import bisect
import threading
from concurrent.futures import Future

from gtp_format.storage import objects
from gtp_format.storage.ranges import coalesce


class ObjectStream:
    """Ranges of one object, read in (about) the order given, fetched ahead; thread-safe."""

    def __init__(self, obj: objects.ObjectFile, ranges: list[tuple[int, int]], ahead: int = objects.IN_FLIGHT) -> None:
        self.obj, self.ahead = obj, max(1, ahead)
        self.requests = coalesce([r for r in ranges if r[1] > r[0]], obj.size, cap=objects.PART, gap=0)
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
            self._got[self._next] = objects.pool().submit(objects.fetch, self.obj.root, self.obj.rel, r.start,
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
