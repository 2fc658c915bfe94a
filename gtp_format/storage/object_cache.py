"""What one ``ckpt`` command keeps of a bucket's bytes: the small-read blocks of streamed objects, and the
small side files of a checkpoint folder, fetched together as soon as a listing names them.

Why the side files: a warm ``export`` of a 26.5 MB checkpoint from a bucket (moto on 127.0.0.1) read
``metadata.json``, the manifest, ``.metadata`` and ``gtp_chunks.json`` one after another, a round trip
each with the parsing between them, and ``verify --data`` read two of them again at its end: 9-12 ms of
an 83 ms command that no data request overlapped. :func:`warm` starts them all, concurrently, right
after the listing; a later read of any byte range of one is served from its copy.

Both caches live within one command (its session's :class:`gtp_format.storage.objects.BucketState`) and are dropped
at its end, so a later command reads the store as it is then. A warmed copy is the object as the
listing saw it: the same key and the listed size, every byte of it (a short answer is refused as any
read's is). A warm request that failed is forgotten and the read asks the store itself, so its error
is the one that read would have given, in the same words.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import Future

from gtp_format.names import (
    CHUNK_RECORDS_FILE,
    DCP_METADATA_FILE,
    GTP_INDEX_FILE,
    MANIFEST_FILE,
    MEGATRON_INTEGRITY_FILE,
    MEGATRON_METADATA_FILE,
)

# The files every reader of a checkpoint folder opens first; never data files, so ``inspect`` and
# ``verify`` still read no data object whole.
SIDE_FILES = frozenset({MEGATRON_METADATA_FILE, MANIFEST_FILE, DCP_METADATA_FILE, CHUNK_RECORDS_FILE,
                        GTP_INDEX_FILE, MEGATRON_INTEGRITY_FILE})
MAX_SIDE_FILE = 4 << 20  # larger ones (the .metadata of a model of thousands of chunks) are read as before
MAX_WARM_BYTES = 16 << 20  # every warmed side file of one command together
MAX_DATA_OBJECT = 8 << 20  # a data object warmed whole is at most one request (objects.PART)
MAX_DATA_OBJECTS = 64  # more data objects than this (a listing of many tiny ones) are read through the plan
DATA_SUFFIXES = (".distcp", ".safetensors")  # data files (DCP's, ours, Hugging Face's); a run folder's logs are not


class SideFiles:
    """Warmed copies of whole objects: (bucket, key) -> (listed size, the future of its bytes).

    The side files of every listing; and, for a command that will read every byte of the checkpoint
    (``reshard``, ``export``, ``verify --data``: :meth:`gtp_format.storage.objects.BucketState.reads_everything`), its
    data objects too when each is at most one request (:data:`MAX_DATA_OBJECT`) and all of them together fit
    the command's budget. Why: a small checkpoint's data requests otherwise start only after the gate has
    read and checked the metadata; a 26.5 MB ``reshard`` from a bucket spent 38 ms in the gate and then
    28 ms on its four data ``GET`` s, which a fetch started at the listing overlaps with the gate. The
    copies are bytes, checked like any read's (the listed size, every byte), and nothing is interpreted
    before the gate has passed the metadata.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._copies: dict[tuple[str, str], tuple[int, Future[bytes]]] = {}
        self._bytes = 0
        self._data_bytes = 0

    def warm(self, bucket: str, listed: Iterable[tuple[str, str, int]],
             submit: Callable[[Callable[[], bytes]], Future[bytes]],
             load: Callable[[str, int], bytes], data_budget: int = 0) -> None:
        """Start fetching (``load(name, size)`` on ``submit``'s threads) each listed ``(name, key, size)`` that
        is a side file of at most :data:`MAX_SIDE_FILE` bytes, within :data:`MAX_WARM_BYTES`, unless one is
        held already; with ``data_budget``, every listed data file too (:data:`DATA_SUFFIXES`) if there are at
        most :data:`MAX_DATA_OBJECTS`, each is at most :data:`MAX_DATA_OBJECT` and they add up to at most
        ``data_budget`` bytes (else none of them)."""
        listed = list(listed)
        side = [(n, k, s) for n, k, s in listed if n in SIDE_FILES and 0 < s <= MAX_SIDE_FILE]
        data = [(n, k, s) for n, k, s in listed if n.endswith(DATA_SUFFIXES) and s > 0]
        with self._lock:
            room = data_budget - self._data_bytes
        if not (data and len(data) <= MAX_DATA_OBJECTS and all(s <= MAX_DATA_OBJECT for _, _, s in data)
                and sum(s for _, _, s in data) <= room):
            data = []
        # largest first: they take longest, and the side files are small
        for name, key, size in side + sorted(data, key=lambda x: -x[2]):
            is_side = name in SIDE_FILES
            with self._lock:
                if (bucket, key) in self._copies:
                    continue
                if is_side and self._bytes + size > MAX_WARM_BYTES:
                    continue
                if not is_side and self._data_bytes + size > data_budget:
                    continue
                if is_side:
                    self._bytes += size
                else:
                    self._data_bytes += size
                self._copies[(bucket, key)] = (size, submit(lambda r=name, n=size: load(r, n)))

    def take(self, bucket: str, key: str, offset: int, n: int, may_wait: bool) -> memoryview | None:
        """Bytes ``offset:offset+n`` of the warmed copy of ``key`` (a view of it: no copy), or None (none held,
        the range is past it, its fetch failed, or it is still in flight and the caller ``may_wait`` not)."""
        with self._lock:
            held = self._copies.get((bucket, key))
        if held is None or offset + n > held[0]:
            return None
        size, future = held
        if not future.done() and not may_wait:
            return None
        try:
            data = future.result()
        except Exception:  # noqa: BLE001 - the read asks the store itself and reports its own error
            with self._lock:
                if self._copies.get((bucket, key)) is held:
                    del self._copies[(bucket, key)]
            return None
        return memoryview(data)[offset:offset + n] if len(data) == size else None

    def drop(self) -> None:
        """Forget every copy (the end of a command); fetches still in flight finish into nothing."""
        with self._lock:
            self._copies.clear()
            self._bytes = self._data_bytes = 0


class Blocks:
    """The small-read cache of every streamed object: aligned :data:`BLOCK` s, least recently used first out,
    at most ``limit`` bytes together (:data:`~gtp_format.storage.objects.CACHE_BYTES`).

    Keyed by the object as one ``ckpt`` command sees it (bucket, key and listed size, inside
    :class:`~gtp_format.storage.objects.BucketState`: the copy's reader and its integrity ledger then share
    the blocks of a blob's
    headers) and otherwise by the open object (a serial number), so nothing read before an object was
    reopened outside a command is served after. A block two threads want at once is fetched once.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._blocks: OrderedDict[tuple[object, int], bytes] = OrderedDict()
        self._fetching: dict[tuple[object, int], Future[bytes]] = {}
        self._bytes = 0

    def get(self, owner: object, index: int, load: Callable[[], bytes]) -> bytes:
        key = (owner, index)
        with self._lock:
            got = self._blocks.get(key)
            if got is not None:
                self._blocks.move_to_end(key)
                return got
            waiting = self._fetching.get(key)
            if waiting is None:
                mine: Future[bytes] = Future()
                self._fetching[key] = mine
        if waiting is not None:
            return waiting.result()
        try:
            block = load()
        except BaseException as e:
            with self._lock:
                self._fetching.pop(key, None)
            mine.set_exception(e)
            raise
        with self._lock:
            self._fetching.pop(key, None)
            self._blocks[key] = block
            self._bytes += len(block)
            while self._bytes > self.limit:
                _, old = self._blocks.popitem(last=False)
                self._bytes -= len(old)
        mine.set_result(block)
        return block

    def drop(self, owner: object | None = None) -> None:
        """Forget ``owner``'s blocks, or every block (the end of a command)."""
        with self._lock:
            for k in [k for k in self._blocks if owner is None or k[0] == owner]:
                self._bytes -= len(self._blocks.pop(k))
