"""``ckpt export --to torch``: one ``torch.save`` file of every tensor, streamed, without torch.

Why streamed: the export once read every tensor into memory and then called ``torch.save``; its
serialisation (and ``import torch``) came after the whole read, and no state larger than
``--max-memory`` could be exported. Here :class:`gtp_format.writer.torch_file.TorchStateFile` writes
``data.pkl`` from the keys, dtypes and shapes first, then each tensor's record in the order the
source stores its bytes (a bucket's prefetch joins neighbouring chunks into large requests), read in
row slices on :data:`READERS` threads and written in order while the next slices are read. Memory:
the slices in flight and the prefetch, within ``--max-memory``. The file loads with
``torch.load(weights_only=True)``, and its tensors equal those of PyTorch's own ``dcp_to_torch_save``
of the same checkpoint (``tests/cli/test_export.py``).

The checkpoint's non-tensor objects (DCP's ``BytesStorageMetadata`` entries: megatron-core's
``common_state``, ``rng_state``, the optimizer's param groups and ``_extra_state``) come along as
``dcp_to_torch_save`` writes them where ``torch.load(weights_only=True)`` decodes them; what it refuses
is left out and named (``left_out``), and a blob that is not data stops the export
(:mod:`ckpt_tool.export.torch_objects`). torch is imported only for those objects.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from ckpt_tool.copying.engine import MIN_CHUNK, write_failure
from ckpt_tool.copying.source import Source
from ckpt_tool.export.torch_objects import decode_objects
from gtp_format.check.integrity import readable_bytes
from gtp_format.errors import FormatError
from gtp_format.hashing import crc32
from gtp_format.reader.boxes import PREFETCH_BUDGET
from gtp_format.session import Session
from gtp_format.storage.base import storage_for
from gtp_format.storage.location import ObjectURL
from gtp_format.work import clean_stale, remove_owned, sigterm_raises
from gtp_format.writer.checkpoint import DestinationTaken
from gtp_format.writer.sink import Sink, stage_bytes
from gtp_format.writer.torch_file import TorchStateFile

READERS = 8  # slices read at once (from a bucket they wait on round trips, not on the cores)
SLICE = 16 << 20  # bytes per slice at most: finer than the prefetch's budget, so the window stays full

Piece = tuple[str, tuple[int, ...], tuple[int, ...], bool, bool, int]  # key, offsets, sizes, first, last, bytes


def _pieces(key: str, shape: tuple[int, ...], itemsize: int, slice_bytes: int) -> Iterator[Piece]:
    """``key``'s boxes of whole rows (dim 0), at most ``slice_bytes`` each unless one row is larger:
    in C order one after another, so their bytes are the tensor's bytes in order."""
    if not shape or shape[0] == 0:
        yield key, (0,) * len(shape), shape, True, True, math.prod(shape) * itemsize
        return
    row = math.prod(shape[1:]) * itemsize
    step = max(1, slice_bytes // max(row, 1))
    for at in range(0, shape[0], step):
        n = min(step, shape[0] - at)
        yield key, (at,) + (0,) * (len(shape) - 1), (n, *shape[1:]), at == 0, at + n == shape[0], n * row


def export_torch(source: Source, dst: Path | ObjectURL, max_memory: int,
                 advance_of: Callable[[int], Callable[[int], None]] | None = None,
                 session: Session | None = None) -> dict[str, Any]:
    entries = {k: e for k, e in source.ckpt.entries.items() if e.shape is not None and e.dtype is not None}
    objects = sorted(k for k in source.ckpt.entries if k not in entries)  # byte objects: see the module docstring
    total = sum(e.numel * e.itemsize for e in entries.values())
    readable = readable_bytes(source.ckpt)
    if total > readable:  # the output's size is bounded by what the files hold on disk, not their (sparse) st_size
        raise FormatError(f"{source.root}: --to torch would write {total} bytes of tensors, but the data "
                          f"files hold only {readable} readable bytes (sparse or truncated files: reads are bounded "
                          "by a multiple of what a file stores on disk); run `ckpt verify --data` on it and export "
                          "an intact checkpoint")
    fragments, left_out = decode_objects(source.ckpt, objects, max_memory, str(source.root)) if objects else ([], {})
    keys = list(entries)
    # in the order the keys' bytes lie in the files: a bucket's prefetch then joins neighbouring chunks into
    # requests of up to 8 MiB (in key-name order they alternate between files and offsets)
    order = sorted(keys, key=lambda k: min(((c.storage.file, c.storage.offset) for c in entries[k].chunks
                                            if c.storage is not None), default=("", 0)))
    slice_bytes = max(MIN_CHUNK, min(SLICE, max_memory // (4 * READERS)))
    # the prefetch of a bucket's chunks: READERS slices at once each want a request of every rank's file, so it
    # needs more than a streamed copy's 64 MiB (8 requests thrashed: 180 GETs for a 304.8 MB checkpoint)
    budget = max(PREFETCH_BUDGET, min(READERS * PREFETCH_BUDGET // 2, max_memory // 4))
    source.reader.prefetch_layouts(order, budget=budget)
    # slices in flight: at most 2 * READERS, and no more bytes than half the prefetch holds: slices wanted
    # further ahead made it drop requests before they were read (279 GETs at 1.2 GB where --to hf sends 220)
    window = max(slice_bytes, min(max_memory // 2, budget // 2))
    advance = advance_of(total) if advance_of is not None else (lambda n: None)

    def read(p: Piece) -> tuple[np.ndarray, int]:
        """A slice and its CRC-32, on a reader thread (in parallel, and beside the requests a bucket waits on)."""
        key, offsets, sizes = p[:3]
        if 0 in sizes:
            return np.empty(0, np.uint8), 0
        arr = np.ascontiguousarray(source.reader.read_box(key, offsets, sizes))
        return arr, crc32(arr.reshape(-1).view(np.uint8))

    store = storage_for(dst, session)  # a bucket's: built in local staging, then uploaded as one object
    local = store.work_target(store.work_parent())
    clean_stale(local.parent)  # what killed exports left beside DST
    # the file is built inside a work folder of this writer's (its ownership token inside), so a killed
    # export's partial file is removed by the next writer there, and only one this tool provably made
    work = store.new_work(local, "tmp")
    tmp = work / local.name
    index = {k: i for i, k in enumerate(keys)}
    spec = [(k, entries[k].dtype, tuple(entries[k].shape)) for k in keys]
    try:
        with sigterm_raises():  # a terminated export removes its partial file, as on an error
            with Sink(tmp, stage_bytes(2 * slice_bytes), checksum=False) as sink:
                out = TorchStateFile(sink.write, spec, [index[k] for k in order],  # type: ignore[misc]
                                     objects=fragments)
                out.begin()
                pieces = (p for k in order for p in _pieces(k, tuple(entries[k].shape), entries[k].itemsize,
                                                            slice_bytes))
                with ThreadPoolExecutor(READERS, thread_name_prefix="export-torch") as pool:
                    pending: deque[tuple[Piece, Future[tuple[np.ndarray, int]]]] = deque()
                    held = 0
                    for p in pieces:
                        while pending and (len(pending) >= 2 * READERS or held + p[5] > window):
                            held -= pending[0][0][5]
                            _write_piece(out, *pending.popleft(), advance)
                        pending.append((p, pool.submit(read, p)))
                        held += p[5]
                    while pending:
                        _write_piece(out, *pending.popleft(), advance)
                out.finish()
                sink.close()
            source.verify_reads()  # a damaged SRC is refused here, before anything is committed
            store.put(tmp)
    except FileExistsError:
        raise DestinationTaken(dst) from None
    except OSError as e:
        raise write_failure(local, e) from None
    finally:
        remove_owned(work)  # the partial file on a failure; the token (and nothing else) after the commit
    return {"files": 1, "keys": len(keys) + len(fragments), "bytes": total, "byte_objects": len(fragments),
            "left_out": sorted(left_out), "left_out_why": left_out, "equals_dcp_to_torch_save": not left_out}


def _write_piece(out: TorchStateFile, p: Piece, fut: Future[tuple[np.ndarray, int]],
                 advance: Callable[[int], None]) -> None:
    arr, crc = fut.result()
    if p[3]:
        out.start()
    if arr.size:
        out.data([arr.reshape(-1).view(np.uint8)], crc)
    if p[4]:
        out.end()
    advance(arr.nbytes)
