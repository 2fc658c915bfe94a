"""Confined, bounded reads of a checkpoint in an object store (``s3://bucket/prefix``), through obstore.

The local rules of :mod:`gtp_format.reader.storage` carry over, in the store's terms:

* A recorded path is checked by the same :func:`unsafe_reason` (plain relative, no ``..``) and its
  key is the prefix joined with it, so no key outside the checkpoint's prefix is ever asked for;
  listing a "folder" asks for ``prefix/`` with a delimiter, so ``iter_1`` never lists ``iter_10``.
* Every size a check or an allocation uses comes from the store (``HEAD`` or the listing), never from
  a file: a byte range is checked against the object's real size before it is requested, a whole
  small object is read only if the store says it is under its limit, and what comes back must be as
  long as what was asked for. An object stores every byte it reports (there are no holes), so the
  store's size is also the bound on what a read may allocate.
* Memory per request is bounded: a range is fetched in pieces of at most :data:`PIECE` bytes into
  the caller's one buffer.
* Faults are one line naming the key: a missing object, refused credentials, and a server that
  stops answering (connect and request timeouts, :data:`RETRIES` retries with backoff for the
  transient errors obstore retries: 5xx, dropped connections, timeouts of read-only requests).

Why obstore: ``benchmarks/bench_s3.py`` measured it against s3fs (fsspec) and boto3's transfer
manager on the same objects in the same run (docs/performance.md, "Object-store clients"); it was
the fastest at writes, whole reads and ranged reads. Endpoint and credentials come from the standard
AWS environment (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ``AWS_REGION``...) and, below it, the
AWS profile of the shared files (:mod:`gtp_format.storage.profiles`), passed to obstore explicitly.
"""

from __future__ import annotations

import functools
import itertools
import os
import re
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, wait
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from gtp_format.errors import ChunkError, FormatError
from gtp_format.storage import object_cache
from gtp_format.storage.limits import TIMEOUT_ENV, Limits
from gtp_format.storage.location import ObjectURL
from gtp_format.storage.paths import addressable, past_end_message, unsafe_reason
from gtp_format.storage.ranges import pieces

if TYPE_CHECKING:  # imported where a bucket is used: the stack (http.client, ssl, email) costs a local command 0.1 s
    from gtp_format.storage import credentials

PIECE = 64 << 20  # largest single ranged GET: bounds the memory one request holds in flight
RETRIES = 3  # transient errors retried with exponential backoff, within RETRY_TIMEOUT_S
CONNECT_TIMEOUT_S = 5.0
RETRY_TIMEOUT_S = 30.0
# Streaming reads (verify --data, show, diff, export): why these sizes, measured by
# benchmarks/bench_s3_ckpt.py --count-requests (docs/performance.md, "Checkpoints on a bucket"):
PART = 8 << 20  # a large read is cut into parts of this size, fetched concurrently (boto3's default part too)
IN_FLIGHT = 8  # parts fetched at once, by all readers together: bounds the bytes in flight (64 MiB)
BLOCK = 64 << 10  # a small read of a streamed object is served from the aligned block around it
SMALL = 64 << 10  # reads up to this size go through the block cache (zip headers, pickles: 4-33 per chunk)
CACHE_BYTES = 32 << 20  # every streamed object's cached blocks together


# Where the keys may come from besides the access-key pair, without sending anything yet: web identity (EKS,
# CI OIDC), the container credential endpoints (ECS, EKS Pod Identity), the instance metadata service where
# asked for (:mod:`gtp_format.storage.credentials`, which fetches them).
_OTHER_CREDENTIALS = ("AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
                      "AWS_CONTAINER_CREDENTIALS_FULL_URI")


def credentials_problem(bucket: str) -> str | None:
    """Why no request may be sent for ``bucket`` (no credentials configured), or None; sends nothing."""
    from gtp_format.storage import credentials, profiles  # the object-store stack only where a bucket is used

    env = os.environ
    if credentials.flag("AWS_SKIP_SIGNATURE"):
        return None  # a public bucket, read unsigned
    if env.get("AWS_ACCESS_KEY_ID") and env.get("AWS_SECRET_ACCESS_KEY"):
        return None
    if (env.get("AWS_WEB_IDENTITY_TOKEN_FILE") and env.get("AWS_ROLE_ARN")) or \
            any(env.get(k) for k in _OTHER_CREDENTIALS[1:]) or credentials.metadata_asked():
        return None
    found = profiles.settings()  # a named profile that is absent, or a file that does not parse: one line
    if found.access_key_id is not None:
        return None
    try:
        credentials.resolve(bucket)
    except FormatError as e:
        return e.message
    return None


def _store_for(bucket: str, endpoint: str | None, timeout: float, region: str | None = None,
               *credentials: str | None) -> Any:
    """A new client of ``bucket`` in this configuration (kept by the session: :meth:`BucketState.client`).
    ``region`` as :func:`profiles.settings` resolved it and ``credentials`` (key, secret, token) as
    :func:`credentials.resolve` did (the environment, the AWS profile, then the temporary sources, each answer
    bounded), passed explicitly where set, so that obstore never asks a credential endpoint itself; it reads the
    rest of the environment itself."""
    try:
        from obstore.store import S3Store
    except ImportError:
        raise FormatError("s3:// needs the obstore package: pip install 'gtp-ckpt[s3]'") from None
    client: dict[str, Any] = {"connect_timeout": timedelta(seconds=CONNECT_TIMEOUT_S),
                              "timeout": timedelta(seconds=timeout)}
    if endpoint is not None and endpoint.startswith("http://"):
        client["allow_http"] = True  # a local or private endpoint the user named
    retry = {"max_retries": RETRIES, "retry_timeout": timedelta(seconds=RETRY_TIMEOUT_S),
             "backoff": {"init_backoff": timedelta(milliseconds=100), "max_backoff": timedelta(seconds=4),
                         "base": 2}}
    kwargs: dict[str, Any] = {"client_options": client, "retry_config": retry}
    if endpoint is not None:
        kwargs["endpoint"] = endpoint
    if region is not None:
        kwargs["region"] = region
    for name, value in zip(("access_key_id", "secret_access_key", "session_token"), credentials):
        if value is not None:
            kwargs[name] = value
    try:
        return S3Store(bucket, **kwargs)
    except Exception as e:  # noqa: BLE001 - obstore raises its own configuration errors
        raise FormatError(f"s3://{bucket}: cannot configure the S3 client: {_first_line(e)}") from None


def store(url: ObjectURL) -> Any:
    """The obstore client of ``url``'s bucket, kept by the session ``url`` is bound to (one per bucket, endpoint,
    credentials and timeout)."""
    from gtp_format.storage import credentials, profiles  # the object-store stack only where a bucket is used

    problem = credentials_problem(url.bucket)
    if problem is not None:
        raise FormatError(problem)
    state = state_of(url)
    found, keys = profiles.settings(), credentials.resolve(url.bucket, state.keys)
    args = (url.bucket, found.endpoint, state.limits.s3_timeout_s, found.region, keys.key, keys.secret, keys.token)
    return state.client(args)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return " ".join(text[0].split())[:300] if text else type(e).__name__


def describe_error(e: BaseException, where: str) -> FormatError:
    """One line for an obstore error at ``where`` (a URL): what happened and the fix."""
    from obstore import exceptions as ox

    text = str(e)
    if isinstance(e, ox.NotFoundError | FileNotFoundError):  # obstore raises the builtin for a 404
        return ChunkError(f"{where} is missing from the bucket", file=where)
    if isinstance(e, ox.UnauthenticatedError | ox.PermissionDeniedError) or "InvalidAccessKeyId" in text \
            or "SignatureDoesNotMatch" in text or "AccessDenied" in text or re.search(r"(?<![\d.])403(?![\d.])", text):
        return FormatError(f"{where}: the store refused the credentials ({_first_line(e)}); check "
                           "AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY and AWS_ENDPOINT_URL")
    if "NoSuchBucket" in text:
        return FormatError(f"{where}: the bucket does not exist; check the URL and AWS_ENDPOINT_URL")
    if "timed out" in text.lower() or "timeout" in text.lower() or "connect" in text.lower():
        return FormatError(f"{where}: the store did not answer ({_first_line(e)}) after {RETRIES} retries; check "
                           f"AWS_ENDPOINT_URL and the network, or raise {TIMEOUT_ENV}")
    return FormatError(f"{where}: the store failed: {_first_line(e)}")


def _call(where: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
    try:
        return fn(*args, **kwargs)
    except FormatError:
        raise
    except Exception as e:  # noqa: BLE001 - every obstore error becomes one line naming the key
        raise describe_error(e, where) from None


def _key(root: ObjectURL, rel: str) -> str:

    reason = unsafe_reason(rel)
    if reason is not None or any(p in ("", ".") for p in rel.split("/")):
        raise ChunkError(f"{reason or f'storage path {rel!r} has an empty component'}: refusing to read outside "
                         f"{root}", file=str(rel))
    return root.key(rel)


class BucketState:
    """What one command (or one save or load of the runtime) keeps of the buckets it reads: the sizes its
    listings returned, the listings themselves, the warmed side files, the small-read blocks, its S3 clients
    and its fetch threads. Owned by
    :class:`gtp_format.session.Session`; a location bound to a session
    (:meth:`gtp_format.storage.location.ObjectURL.bound`) carries it to every read below it.

    ``scoped``: an object's size is taken from the listing that named it, when one did. Why: one ``verify`` or
    ``export`` asked for the same few sizes 25-40 times (``HEAD`` s from the manifest check, the storage check,
    the data-file sizes, each open), one round trip each; a listing returns every size of the folder in one.
    The scope is one ``ckpt`` command, so a later command sees the store as it is then. Within it, an object
    replaced or deleted after the listing is still caught: every read's answer must be exactly as long as
    asked, and a missing object's ``GET`` is named as missing. An unscoped state (a location bound to no
    session) asks the store each time.
    """

    def __init__(self, scoped: bool = True, limits: Limits | None = None, made: Any = None) -> None:
        self.scoped = scoped
        self.limits = limits or Limits()  # the session's (its request timeout)
        self.made = made  # the session's work folders (gtp_format.work.WorkFolders): a bucket output's staging
        self.lock = threading.Lock()
        self.sizes: dict[tuple[str, str], int] | None = {} if scoped else None  # (bucket, key) -> size
        self.listings: dict[tuple[str, str], dict[str, int | None]] = {}  # (bucket, prefix) -> listing
        self.whole = 0  # budget for data objects fetched whole at the listings (reads_everything)
        self.side = object_cache.SideFiles()  # side files, fetched as a listing names them
        self.blocks = object_cache.Blocks(CACHE_BYTES)
        self.serial = itertools.count()
        self.clients: dict[tuple[Any, ...], Any] = {}  # configuration -> obstore client
        self.building = threading.Lock()  # held while a client is built (not self.lock: listings wait on it)
        self.pools: dict[str, ThreadPoolExecutor] = {}  # name -> threads, started at their first task
        self.keys: dict[tuple[Any, ...], credentials.Credentials] = {}  # temporary keys (credentials.resolve)

    def client(self, args: tuple[Any, ...]) -> Any:
        """The client of configuration ``args`` (:func:`_store_for`'s), built once a session: a client is a
        connection pool, and building one took 28 ms (obstore's ``S3Store``, on the shared 2-core test
        machine). Once a session costs a ``ckpt`` command (one a process) nothing; the runtime's save pays it
        once a save."""
        with self.building:  # one build, however many fetch threads ask at once
            got = self.clients.get(args)
            if got is None:
                got = self.clients[args] = _store_for(*args)  # a refused setting raises here
        return got

    def _threads(self, name: str) -> ThreadPoolExecutor:
        with self.lock:
            pool = self.pools.get(name)
            if pool is None:
                pool = self.pools[name] = ThreadPoolExecutor(IN_FLIGHT, thread_name_prefix=name)
        return pool

    def warm_pool(self) -> ThreadPoolExecutor:
        """Threads of their own for a listing's whole objects (:class:`object_cache.SideFiles`): their tasks wait
        on nothing, so a :meth:`pool` task may wait for a copy."""
        return self._threads("s3-warm")

    def pool(self) -> ThreadPoolExecutor:
        """The threads that fetch parts and prefetched requests (:data:`IN_FLIGHT` of them, shared by every
        reader of the session, so the bytes in flight stay bounded however many threads read). Their tasks are
        leaves: a task never waits on another, so the pool cannot deadlock."""
        return self._threads("s3-fetch")

    def reads_everything(self, budget: int) -> None:
        """The command reads every byte it opens (``reshard``, ``export``, ``verify --data``): its listings fetch
        up to ``budget`` bytes of small data objects whole (:class:`object_cache.SideFiles`)."""
        with self.lock:
            if self.scoped:
                self.whole = max(0, budget)

    def forget_listings(self) -> None:
        """A write into a bucket: the later listings ask the store again."""
        with self.lock:
            self.listings.clear()

    def close(self) -> None:
        """The end of the command: the next one reads the store as it is then. Its threads end once the
        fetches still in flight have finished (into nothing); its clients are dropped."""
        with self.lock:
            if self.sizes is not None:
                self.sizes = {}
            self.whole = 0
            self.listings.clear()
            pools, self.pools = list(self.pools.values()), {}
            self.clients.clear()
        for pool in pools:
            pool.shutdown(wait=False)
        self.blocks.drop()
        self.side.drop()


def state_of(root: ObjectURL) -> BucketState:
    """The bucket state ``root`` is bound to, or a fresh unscoped one (a location bound to no session)."""
    state = root.state
    return state if isinstance(state, BucketState) else BucketState(scoped=False)


def reads_everything(root: ObjectURL, budget: int) -> None:
    """:meth:`BucketState.reads_everything` of the state ``root`` is bound to."""
    state_of(root).reads_everything(budget)


def forget_listings(root: ObjectURL) -> None:
    """:meth:`BucketState.forget_listings` of the state ``root`` is bound to."""
    state_of(root).forget_listings()


def head_size(root: ObjectURL, rel: str) -> int | None:
    """The size the store reports for ``rel`` below ``root``, or None if there is no such object."""
    import obstore
    from obstore import exceptions as ox

    key = _key(root, rel)
    if not addressable(key):
        return None
    listed = state_of(root).sizes
    if listed is not None and (root.bucket, key) in listed:
        return listed[(root.bucket, key)]
    try:
        meta = obstore.head(store(root), key)
    except (ox.NotFoundError, FileNotFoundError):
        return None
    except Exception as e:  # noqa: BLE001
        raise describe_error(e, str(root / rel)) from None
    return int(meta["size"])


def object_size(root: ObjectURL, rel: str, what: str = "data file") -> int:
    """:func:`head_size`, a missing object a :class:`ChunkError` naming it (as a missing local file); a name that
    is a prefix holding objects (a "folder") in the words a folder in place of a file gets on disk."""
    size = head_size(root, rel)
    if size is None:
        if addressable(root.key(rel)) and is_prefix(root, rel):
            raise ChunkError(f"{what} {root / rel} is not a regular file", file=rel)
        raise ChunkError(f"{what} {rel} is missing from {root}", file=rel)
    return size


# A listing is bounded by what one folder of a checkpoint (or a run: its iterations) can hold: one data
# file per rank of the largest world this tool plans (2^20, layout.config.MAX_TARGET_WORLD) and its side
# files. Keys are streamed a page at a time (:mod:`listing`; obstore's list_with_delimiter gathered every page
# of a listing that never ended, past 3 GB); a sub-folder is skipped by listing again after its last key.
MAX_LISTED = (1 << 20) + 4096  # keys one listing may return, kept or skipped
LIST_SECONDS = 600.0  # one listing, all its pages


def _listing_refused(where: str, why: str) -> FormatError:
    return FormatError(f"{where}: the store's listing {why}, more than a checkpoint folder can hold; check "
                       "AWS_ENDPOINT_URL (a store that does not end its listing) and the URL")


def listing_client(bucket: str, state: BucketState | None = None) -> Any:
    """How :mod:`gtp_format.storage.listing` sends this configuration's listing requests of ``bucket``: the keys
    :func:`credentials.resolve` found (every source obstore would use), path- or virtual-hosted-style as
    obstore (``AWS_VIRTUAL_HOSTED_STYLE_REQUEST``: the endpoint names the bucket)."""
    from gtp_format.storage import credentials, listing, profiles  # the object-store stack only where a bucket is used

    problem = credentials_problem(bucket)
    if problem is not None:
        raise FormatError(problem)
    state = state or BucketState(scoped=False)
    found, keys = profiles.settings(), credentials.resolve(bucket, state.keys)
    hosted = bool(credentials.flag("AWS_VIRTUAL_HOSTED_STYLE_REQUEST"))
    region = found.region or "us-east-1"  # obstore's default region too
    default = f"https://{bucket}.s3.{region}.amazonaws.com" if hosted else f"https://s3.{region}.amazonaws.com"
    return listing.Client((found.endpoint or default).rstrip("/"), region, keys.key, keys.secret, keys.token,
                          state.limits.s3_timeout_s, RETRIES, RETRY_TIMEOUT_S, hosted)


def _batches(root: ObjectURL, want: str, offset: str | None) -> Iterator[list[tuple[str, int]]]:
    """The keys (with sizes) below ``want`` after ``offset``, a page at a time: one page's cost is bounded by
    :data:`listing.PAGE_BYTES`."""
    from gtp_format.storage import listing  # the object-store stack only where a bucket is used

    client = listing_client(root.bucket, state_of(root))
    token: str | None = None
    while True:
        entries, token = listing.page(client, root.bucket, want, offset, token, str(root), TIMEOUT_ENV)
        yield entries
        if token is None:
            return


def _list_folder(root: ObjectURL, want: str, first: bool = False) -> dict[str, int | None]:
    """The direct entries of the prefix ``want`` (objects with sizes, sub-prefixes with None), bounded:
    at most :data:`MAX_LISTED` keys and :data:`LIST_SECONDS` in all, else one line naming the endpoint's
    listing; one page at most :data:`listing.PAGE_BYTES`. ``first``: stop at the first entry (whether the
    prefix holds anything)."""
    where = str(root)
    out: dict[str, int | None] = {}
    seen, offset, deadline = 0, None, time.monotonic() + LIST_SECONDS
    while True:
        restart = None
        try:
            for batch in _batches(root, want, offset):
                for path, size in batch:
                    seen += 1
                    name = path[len(want):] if path.startswith(want) else ""
                    head, slash, _ = name.partition("/")
                    if slash and head:
                        if head in out:  # listed again after its last key: the store ignores the offset
                            raise _listing_refused(where, f"returns {head}/ again out of order")
                        out[head] = None
                        restart = want + head + "/\U0010ffff"  # after every key below head/
                        break
                    if name:
                        out[name] = size
                if seen > MAX_LISTED:
                    raise _listing_refused(where, f"goes past {MAX_LISTED:,} keys")
                if time.monotonic() > deadline:
                    raise _listing_refused(where, f"was still going after {LIST_SECONDS:.0f} s ({seen:,} keys)")
                if restart is not None or (first and out):
                    break
        except FormatError:
            raise
        except Exception as e:  # noqa: BLE001 - every obstore error becomes one line naming the folder
            raise describe_error(e, where) from None
        if restart is None or (first and out):
            return out
        offset = restart


def is_prefix(root: ObjectURL, rel: str = "") -> bool:
    """Whether any object lies below ``root/rel/`` (a "folder" of the store)."""
    prefix = (root / rel).key() if rel else root.key()
    return bool(_list_folder(root / rel if rel else root, prefix + "/" if prefix else "", first=True))


def list_names(root: ObjectURL) -> dict[str, int | None]:
    """The entries of the "folder" ``root``: object names with their sizes, sub-prefixes with None. Listed once
    a command (:class:`BucketState`; resolving SRC and opening it listed it twice: 6.5 ms of a 26.5 MB reshard
    from moto), until a write into a bucket (:meth:`BucketState.forget_listings`)."""

    prefix = root.key()
    want = prefix + "/" if prefix else ""
    state = state_of(root)
    listed = state.sizes
    with state.lock:
        seen = state.listings.get((root.bucket, want)) if listed is not None else None
    out: dict[str, int | None] = {} if seen is None else dict(seen)
    if seen is None:
        out = _list_folder(root, want)
        if listed is not None:
            for name, size in out.items():
                if size is not None:
                    listed[(root.bucket, want + name)] = size
    if listed is not None:  # a command's listing: its side files are read next, so fetch them together now
        with state.lock:
            state.listings[(root.bucket, want)] = dict(out)
        state.side.warm(root.bucket, [(n, root.key(n), size) for n, size in out.items() if size is not None],
                        state.warm_pool().submit, lambda rel, n: bytes(_get(root, rel, 0, n)), state.whole)
    return out


def fetch(root: ObjectURL, rel: str, offset: int, n: int) -> memoryview:
    """One ranged ``GET`` of exactly ``n`` (at most :data:`PIECE`) bytes at ``offset`` of ``rel``; the caller has
    checked the range against the store's size. A short answer is a :class:`ChunkError`. An object the
    command's listing warmed (:mod:`gtp_format.storage.object_cache`) is served from its copy, waited for
    (its fetch runs on :func:`warm_pool`, whose tasks wait on nothing)."""
    key = _key(root, rel)
    held = state_of(root).side.take(root.bucket, key, offset, n,
                                    not threading.current_thread().name.startswith("s3-warm"))
    return held if held is not None else _get(root, rel, offset, n)


def _get(root: ObjectURL, rel: str, offset: int, n: int) -> memoryview:
    import obstore

    assert 0 < n <= PIECE
    key, where = _key(root, rel), str(root / rel)
    got = memoryview(_call(where, obstore.get_range, store(root), key, start=offset, length=n)).cast("B")
    if got.nbytes != n:
        raise ChunkError(f"{where}: asked for {n} bytes at {offset}, the store sent {got.nbytes} (the "
                         "object changed while it was read?)", file=rel)
    return got


def read_into(root: ObjectURL, rel: str, size: int, offset: int, out: memoryview) -> None:
    """Fill ``out`` from ``offset`` of the object ``rel`` whose store-reported size is ``size``; a short answer
    is a :class:`ChunkError`, never a short read.

    A read over :data:`PART` is cut into parts fetched concurrently on :func:`pool` (a single stream of
    ranged ``GET`` s waits one round trip per part; boto3's ``download_file`` runs 10 at once).
    """
    length = out.nbytes
    if type(offset) is not int or offset < 0 or offset + length > size:
        raise ChunkError(past_end_message(rel, offset, length, size), file=rel)
    if length == 0:
        return
    parts = pieces(offset, offset + length, PART)

    def one(a: int, b: int) -> None:
        out[a - offset:b - offset] = fetch(root, rel, a, b - a)

    if len(parts) == 1 or threading.current_thread().name.startswith("s3-fetch"):
        for a, b in parts:
            one(a, b)
        return
    futures = [state_of(root).pool().submit(one, a, b) for a, b in parts]
    wait(futures)  # every part has stopped writing into ``out`` before anything is raised
    for f in futures:
        f.result()


def read_range(root: ObjectURL, rel: str, offset: int, length: int) -> bytearray:
    """Exactly ``length`` bytes at ``offset`` of ``rel``, after checking the range against the store's size."""
    if not (type(offset) is int and type(length) is int) or offset < 0 or length < 0:
        raise ChunkError(f"byte range offset={offset!r} length={length!r} in {rel} is invalid", file=rel)
    size = object_size(root, rel)
    if offset + length > size:

        raise ChunkError(past_end_message(rel, offset, length, size), file=rel)
    buf = bytearray(length)
    read_into(root, rel, size, offset, memoryview(buf))
    return buf


def read_small(path: ObjectURL, limit: int, what: str, fix: str) -> bytes:
    """A whole metadata-like object, refused if the store reports it over ``limit`` bytes."""
    try:
        size = object_size(path.parent, path.name, what)
    except ChunkError as e:
        raise FormatError(f"{e.message}; {fix}") from None
    if size > limit:
        raise FormatError(f"{path} is {size} bytes, over the {limit}-byte limit for {what}; {fix}")
    buf = bytearray(size)
    read_into(path.parent, path.name, size, 0, memoryview(buf))
    return bytes(buf)


class ObjectFile:
    """An object opened for ranged reads: what :func:`gtp_format.reader.storage.open_regular` gives for a
    bucket. Its size is the store's, taken once when opened; :meth:`pread` is one bounded ranged read.

    :meth:`stream_small_reads` (a streaming pass: ``verify --data``, ``show``, ``diff``, ``export``) serves
    reads of at most :data:`SMALL` bytes from aligned :data:`BLOCK` s: a ``torch.save`` blob's structure is
    4-33 reads of a few bytes to a few KB near its two ends, which were one round trip each (0.01x boto3 for
    ``export --to torch``). ``inspect`` and ``verify`` do not stream: they read only the blobs they parse
    (structure in 4 KiB windows).
    """

    remote = True  # every read is a round trip: worth planning and fetching ahead (gtp_format.storage.prefetch)

    def __init__(self, root: ObjectURL, rel: str, what: str = "data file") -> None:
        self.state = state_of(root)
        self.root, self.rel = root.bound(self.state), rel  # every read of this open shares its state
        self.size = object_size(self.root, rel, what)
        self._pos = 0
        self._serial = next(self.state.serial)
        # one command's view of the object (see object_cache.Blocks); outside a command, this open alone
        self._owner: object = (root.bucket, root.key(rel), self.size) if self.state.scoped else self._serial
        self._cached = False

    def stream_small_reads(self) -> None:
        """Serve small reads from the block cache from now on (see the class docstring)."""
        self._cached = True

    def _load(self, offset: int, n: int) -> bytes:
        return bytes(fetch(self.root, self.rel, offset, n))

    def _small(self, n: int, offset: int) -> bytes:
        first, last = offset // BLOCK, (offset + n - 1) // BLOCK
        parts = []
        for i in range(first, last + 1):
            lo, hi = i * BLOCK, min(self.size, (i + 1) * BLOCK)
            load = functools.partial(self._load, lo, hi - lo)
            parts.append(self.state.blocks.get(self._owner, i, load))
        joined = parts[0] if len(parts) == 1 else b"".join(parts)
        at = offset - first * BLOCK
        return joined[at:at + n]

    def pread(self, n: int, offset: int) -> bytes:
        """Up to ``n`` bytes at ``offset`` (fewer only at the end), like ``os.pread``."""
        n = max(0, min(n, self.size - offset))
        if n == 0:
            return b""
        if self._cached and n <= SMALL and type(offset) is int and offset >= 0:
            return self._small(n, offset)
        buf = bytearray(n)
        read_into(self.root, self.rel, self.size, offset, memoryview(buf))
        return bytes(buf)

    def read_into(self, rel: str, size: int, offset: int, out: memoryview) -> None:
        """Fill ``out`` from ``offset`` (:func:`read_into`; ``rel``, ``size``: this object's, as opened)."""
        read_into(self.root, self.rel, size, offset, out)

    def sparse_message(self, rel: str) -> str | None:
        """None: an object stores every byte it reports (no holes)."""
        return None

    def readable_bytes(self) -> int:
        """The whole object: it stores every byte the store reports."""
        return self.size

    def read(self, n: int = -1) -> bytes:
        data = self.pread(self.size - self._pos if n < 0 else n, self._pos)
        self._pos += len(data)
        return data

    def readinto(self, out: Any) -> int:
        view = memoryview(out).cast("B")
        n = max(0, min(view.nbytes, self.size - self._pos))
        read_into(self.root, self.rel, self.size, self._pos, view[:n])
        self._pos += n
        return n

    def seek(self, pos: int, whence: int = 0) -> int:
        self._pos = pos if whence == 0 else self._pos + pos if whence == 1 else self.size + pos
        return self._pos

    def tell(self) -> int:
        return self._pos

    def fileno(self) -> int:
        raise OSError(f"{self.root / self.rel} is an object in a bucket, not a local file")

    def close(self) -> None:
        if self._owner == self._serial:
            self.state.blocks.drop(self._serial)

    def __enter__(self) -> ObjectFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def pieces(self, block: int) -> Iterator[bytes]:
        """The whole object front to back, ``block`` bytes per request (hashing a file as it streams)."""
        for at in range(0, self.size, block):
            yield self.pread(block, at)
