"""Read and decode one stored chunk, checking it against its metadata on the way.

The declared size is checked before any byte is read (a chunk declaring 10**15 elements is an
error message, not an allocation); the byte range is checked against the real file size before
it is read; only that range is read; the decoded tensor's dtype and shape must equal the
declared ones. Tensor blobs are decoded by :mod:`gtp_format.reader.blob` (no ``torch.load``, no
copy of the elements). Byte objects go through ``torch.load(weights_only=True)``, and only when
all zip records are stored uncompressed: torch inflates a deflated record into a buffer sized by
the pickle's claim, so a 100 KB blob could otherwise ask for gigabytes.

Two views of the same decode: ``*_elements`` give numpy arrays of the stored bits and never import
torch (``inspect`` and ``verify`` run without it: importing torch costs seconds per process);
``decode_chunk``/``load_chunk``/``load_object`` give torch tensors and objects for ``show``,
``diff`` and ``migrate-aliased``.
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np

from gtp_format.errors import ChunkError
from gtp_format.hashing import crc32
from gtp_format.model import BYTES, ENC_RAW, Checkpoint, Chunk, Entry, StorageRef
from gtp_format.reader.blob import BlobLayout, as_tensor, check_payload_crc, element_view, parse_blob
from gtp_format.reader.object_blob import MAX_OBJECT_PICKLE, load_plain_object
from gtp_format.reader.pickle_scan import PickleScanError, check_pickle
from gtp_format.reader.pickle_shape import check_shape
from gtp_format.reader.storage import (
    Into,
    open_regular,
    past_end_message,
    pread,
    read_range,
    size_of,
    source_of,
    streamed,
)
from gtp_format.reader.zip_blob import BlobError, RangeReader, ViewReader, record_bytes, small_record, zip_records
from gtp_format.scan import carrier
from gtp_format.torch_adapter import load_torch


def declared_size_problem(ckpt: Checkpoint, entry: Entry, chunk: Chunk) -> str | None:
    """Why a chunk's declared element count cannot fit its stored byte length, or ``None``.

    A ``torch.save`` blob holds the raw elements plus a zip wrapper, so it is at least as long as
    the elements; a raw (safetensors) chunk is exactly as long.
    """
    if entry.kind == BYTES or chunk.storage is None:
        return None
    need = chunk.numel * entry.itemsize
    have = chunk.storage.length
    if ckpt.encoding == ENC_RAW and need != have:
        return f"declares {chunk.numel} elements ({need} bytes) but stores {have} bytes"
    if need > have:
        return f"declares {chunk.numel} elements ({need} bytes) but its stored blob is only {have} bytes"
    return None


def _require_stored_zip(buf: bytes, where: str, key: str, chunk: int, file: str | None) -> None:
    """Refuse a torch.save blob with compressed records or records larger than the blob itself.

    The same zip-structure parser as every other blob read (:func:`zip_blob.zip_records`), before
    torch ever sees the bytes.
    """
    try:
        records = zip_records(ViewReader(memoryview(buf)))
        _prescan_data_pkl(ViewReader(memoryview(buf)), records)
    except BlobError as e:
        raise ChunkError(f"{where} is not a torch.save blob torch would write ({e}); refusing to load it",
                         key=key, chunk=chunk, file=file) from None


def _prescan_data_pkl(reader: ViewReader, records: dict[str, Any]) -> None:
    """Bound the blob's ``data.pkl`` before ``torch.load`` unpickles it: at most
    :data:`MAX_OBJECT_PICKLE` bytes, memo indices behind their opcode, nesting and container count
    bounded (the pre-scan ``.metadata`` goes through). Why: torch's weights_only unpickler is pure
    Python and builds what the opcodes ask for; a 5 MB ``data.pkl`` of small containers reached
    1.37 GB in ``ckpt show``. Genuine ShardedObjects pickle a few KB: tensors sit in
    records of their own.
    """
    pkl = [r for n, r in records.items() if n.endswith("/data.pkl") and n.count("/") == 1]
    if len(pkl) != 1:
        raise BlobError(f"expected one <archive>/data.pkl record, found {len(pkl)}")
    if pkl[0].size > MAX_OBJECT_PICKLE:
        raise BlobError(f"its data.pkl is {pkl[0].size} bytes, over the {MAX_OBJECT_PICKLE}-byte limit for a byte "
                        "object (genuine ones pickle a few KB)")
    data = small_record(reader, pkl[0])
    try:
        check_pickle(data)
        check_shape(data)
    except PickleScanError as e:
        raise BlobError(f"data.pkl: {e}") from None


def checked_ref(ckpt: Checkpoint, entry: Entry, chunk: Chunk) -> StorageRef:
    """A chunk's storage after the metadata-level checks (present, no transforms, size plausible)."""
    where = f"{entry.key} chunk {chunk.index}"
    if chunk.storage is None:
        raise ChunkError(f"{where} has no storage entry: its data was never written or cannot be located",
                         key=entry.key, chunk=chunk.index)
    ref = chunk.storage
    if ref.transforms:
        raise ChunkError(f"{where} in {ref.file} uses storage transforms {list(ref.transforms)}, which ckpt "
                         "cannot decode", key=entry.key, chunk=chunk.index, file=ref.file)
    problem = declared_size_problem(ckpt, entry, chunk)
    if problem is not None:
        raise ChunkError(f"{where} in {ref.file} {problem}", key=entry.key, chunk=chunk.index, file=ref.file)
    return ref


def chunk_bytes(ckpt: Checkpoint, entry: Entry, chunk: Chunk, into: Into | None = None) -> bytearray | memoryview:
    """The stored bytes of one chunk, after the metadata-level checks (into the buffer ``into`` gives:
    see :func:`gtp_format.reader.storage.read_range`)."""
    ref = checked_ref(ckpt, entry, chunk)
    try:
        return read_range(ckpt.store, ref.file, ref.offset, ref.length, into)
    except ChunkError as e:
        raise ChunkError(f"{entry.key} chunk {chunk.index}: {e.message}", key=entry.key, chunk=chunk.index,
                         file=ref.file) from None


def check_byte_object(ckpt: Checkpoint, entry: Entry, chunk: Chunk) -> None:
    """A byte object's blob has the zip structure torch.save writes and every record passes its CRC-32.

    Streamed from the file in blocks, never held whole: a byte object's declared range can be as
    large as its file (a 64 MiB hole nobody wrote was read into memory at once, then passed).
    Raw (safetensors) layouts store byte objects as they are and are only read for presence.
    From a bucket the structure's small reads come from the block cache (:func:`streamed`): each was a
    request of its own, about 40 per byte object (530 requests, 3.6 s, for one ``verify --data`` of a
    fixture with 13 byte objects, where the local folder took 0.4 s).
    """
    ref = checked_ref(ckpt, entry, chunk)
    if ckpt.encoding == ENC_RAW:
        chunk_bytes(ckpt, entry, chunk)
        return
    with streamed(open_regular(ckpt.store, ref.file)) as f:
        fd, size = source_of(f), size_of(f)
        if ref.offset + ref.length > size:
            raise ChunkError(f"{entry.key}: {past_end_message(ref.file, ref.offset, ref.length, size)}", key=entry.key,
                             chunk=chunk.index, file=ref.file)
        reader = RangeReader(fd, ref.offset, ref.length)
        try:
            for rec in zip_records(reader).values():
                start, stop = record_bytes(reader, rec)
                crc = 0
                for pos in range(start, stop, _CRC_BLOCK):
                    crc = crc32(pread(fd, min(_CRC_BLOCK, stop - pos), ref.offset + pos), crc)
                if crc != rec.crc:
                    raise BlobError(f"record {rec.name} fails its CRC-32 check (damaged)")
        except BlobError as e:
            raise ChunkError(f"byte object {entry.key} in {ref.file} is not an intact torch.save blob: {e}",
                             key=entry.key, chunk=chunk.index, file=ref.file) from None


_CRC_BLOCK = 1 << 20


def decode_elements(ckpt: Checkpoint, entry: Entry, chunk: Chunk, buf: bytes | bytearray | memoryview,
                    check_crc: bool = True) -> np.ndarray:
    """A tensor chunk's elements as a numpy array of their stored bits (no copy, no torch), checked
    against the metadata's dtype and shape and (unless ``check_crc`` is false: the caller checks the
    whole file's checksum instead) against the storage record's CRC-32."""
    assert entry.dtype is not None
    view = memoryview(buf)
    if ckpt.encoding == ENC_RAW:
        return np.frombuffer(view, dtype=carrier(entry.dtype)).reshape(chunk.sizes)
    try:
        layout = _checked_layout(view, entry, chunk)
        payload = view[layout.payload_offset:layout.payload_offset + layout.payload_bytes]
        if check_crc:
            check_payload_crc(layout, payload)
        return element_view(layout, payload)
    except BlobError as e:
        raise blob_error(entry, chunk, e) from None


def decode_chunk(ckpt: Checkpoint, entry: Entry, chunk: Chunk, buf: bytes | bytearray | memoryview) -> Any:
    """:func:`decode_elements` as a ``torch.Tensor`` over the same bytes (imports torch)."""
    assert entry.dtype is not None
    return as_tensor(decode_elements(ckpt, entry, chunk, buf), entry.dtype)


def _checked_layout(view: memoryview, entry: Entry, chunk: Chunk) -> BlobLayout:
    layout = parse_blob(ViewReader(view))
    check_layout(layout, entry, chunk)
    return layout


def blob_error(entry: Entry, chunk: Chunk, e: BlobError) -> ChunkError:
    """The one-line error for a chunk whose blob does not decode to the declared tensor."""
    file = chunk.storage.file if chunk.storage else None
    return ChunkError(f"{entry.key} chunk {chunk.index} in {file or '?'} does not decode as a torch.save blob of "
                      f"the declared tensor: {e}", key=entry.key, chunk=chunk.index, file=file)


def check_layout(layout: BlobLayout, entry: Entry, chunk: Chunk) -> None:
    """The blob holds the declared dtype and shape."""
    if layout.dtype != entry.dtype or layout.size != chunk.sizes:
        raise BlobError(f"it holds {layout.dtype} {layout.size} but the metadata declares {entry.dtype} {chunk.sizes}")


def load_chunk(ckpt: Checkpoint, entry: Entry, chunk: Chunk, into: Into | None = None) -> Any:
    """Read, decode and check one tensor chunk, as a ``torch.Tensor`` (over ``into``'s buffer if given)."""
    return decode_chunk(ckpt, entry, chunk, chunk_bytes(ckpt, entry, chunk, into))


def load_elements(ckpt: Checkpoint, entry: Entry, chunk: Chunk) -> np.ndarray:
    """Read, decode and check one tensor chunk, as a numpy array of its stored bits (no torch)."""
    return decode_elements(ckpt, entry, chunk, chunk_bytes(ckpt, entry, chunk))


def load_plain(ckpt: Checkpoint, entry: Entry, unpickler: Any = None) -> Any:
    """A byte object made only of containers, numbers and dtypes, decoded without torch.

    :mod:`gtp_format.reader.object_blob` explains what is accepted; anything else is a
    :class:`ChunkError` naming the key (``load_object`` decodes more, with torch). ``unpickler``:
    another subclass of its unpickler (the inert records of ``ckpt show``).
    """
    first = entry.chunks[0]
    file = first.storage.file if first.storage else None
    buf = chunk_bytes(ckpt, entry, first)
    try:
        return load_plain_object(ViewReader(memoryview(buf)), unpickler=unpickler)
    except BlobError as e:
        what = "plain " if unpickler is None else ""
        raise ChunkError(f"byte object {entry.key} in {file or '?'} does not decode as a {what}torch.save object: "
                         f"{e}", key=entry.key, chunk=0, file=file) from None


def load_object(ckpt: Checkpoint, entry: Entry) -> Any:
    """A byte object decoded with ``torch.load(weights_only=True)`` (Megatron's ShardedObjects).

    Megatron's planner stores the ``torch.save`` blob it was given; DCP's default planner
    ``torch.save``-s the ``io.BytesIO`` holding it once more. ``io.BytesIO`` is therefore allowed
    (it only carries bytes) and one level of such wrapping is undone. Objects needing more than
    tensors and plain containers (numpy RNG state, for instance) are refused by weights_only.
    """
    first = entry.chunks[0]
    file = first.storage.file if first.storage else None
    buf = chunk_bytes(ckpt, entry, first)
    torch = load_torch()

    try:
        _require_stored_zip(buf, f"byte object {entry.key}", entry.key, 0, file)
        with torch.serialization.safe_globals([io.BytesIO]):
            obj = torch.load(io.BytesIO(buf), map_location="cpu", weights_only=True)
            if isinstance(obj, io.BytesIO):
                buf = obj.getvalue()
                _require_stored_zip(buf, f"byte object {entry.key}", entry.key, 0, file)
                obj = torch.load(io.BytesIO(buf), map_location="cpu", weights_only=True)
        return obj
    except ChunkError:
        raise
    except Exception as e:
        raise ChunkError(f"byte object {entry.key} does not load with weights_only=True ({type(e).__name__}: "
                         f"{str(e)[:200]})", key=entry.key, chunk=0, file=file) from None
