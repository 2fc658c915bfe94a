"""The checkpoint being read by ``reshard``/``export``: opened, checked, and read per parameter box.

Refusals come first and name the fix, all from the one gate (:func:`gtp_format.check.gate.open_gated`):
a source without a manifest (not ours: export reads a genuine megatron-core checkpoint through
:mod:`gtp_format.megatron.view`), a broken manifest (the strict parser's line), an aliased source (folded
keys without ``.cp_rank_{i}``: ``ckpt migrate-aliased`` first), then every structural check of
``ckpt verify`` (a missing key the layout implies, a hole, a chunk without storage, a data file that
is gone or short, the ``param_optimizers`` owners, the canonical bucket layout, key dtypes...) with
verify's own line and exit 1, before any byte is copied: a copy trusts the manifest exactly as
``--load`` does, so it passes the same gate (reshard and export once skipped ``param_optimizers``
and wrote Muon momentum as Adam ``exp_avg``).

Data integrity rides on the reads: :class:`CheckedReader` hands every range it reads to a
:class:`gtp_format.check.integrity.ReadLedger`, and :meth:`Source.verify_reads` (called by every
copy before it commits) joins them and compares with the checksums the source carries.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ckpt_tool.copying import WEIGHT_STATE
from gtp_format.check.gate import REFUSE, open_gated
from gtp_format.check.integrity import ReadLedger
from gtp_format.errors import FormatError
from gtp_format.manifest import Manifest
from gtp_format.model import Checkpoint, Chunk
from gtp_format.names import OPTIMIZER_SHARDINGS
from gtp_format.reader.boxes import BoxReader, Buffer
from gtp_format.scan import carrier
from gtp_format.session import Session
from gtp_format.storage.base import storage_for
from gtp_format.storage.location import ObjectURL, parse_location
from gtp_format.views.ours import param_views
from gtp_format.views.records import Holder, ParamView, full_box


class Buffers(threading.local):
    """One thread's reusable buffers: ``out`` holds the box returned, ``scratch`` the rows it is
    assembled from. Reused chunk after chunk, so no 64 MiB array is allocated (and page-faulted
    in) per chunk."""

    def __init__(self) -> None:
        self.out, self.scratch = Buffer(), Buffer()


class CheckedReader(BoxReader):
    """A :class:`BoxReader` whose every range read is hashed into ``ledger`` from the buffer it landed in."""

    def __init__(self, ckpt: Checkpoint) -> None:
        super().__init__(ckpt)
        self.ledger = ReadLedger(ckpt)

    def _record(self, rel: str, offset: int, data: np.ndarray | memoryview) -> None:
        # rows read as one range, or a prefetched request, are the file's bytes in order; bytes not recorded
        # (a strided chunk's runs) are read and checked as gaps when the ledger is joined
        self.ledger.record(rel, offset, data.reshape(-1).view(np.uint8) if isinstance(data, np.ndarray) else data)

    def close(self) -> None:
        self.ledger.cancel()  # a copy that stopped early: its background fill stops too
        super().close()


@dataclass
class Source:
    ckpt: Checkpoint
    manifest: Manifest | None  # None: a genuine megatron-core checkpoint (gtp_format.megatron.view)
    views: dict[str, ParamView]
    reader: CheckedReader
    given: Path | ObjectURL | None = None  # SRC as the user named it (a run folder or prefix, or the root itself)
    # megatron-core fully_reshardable: each optimizer state is read from its own per-parameter key at the weight's
    # box (:func:`.weights.full_state_views`), not from a bucket
    full_states: bool = False

    @property
    def root(self) -> Path:
        return self.ckpt.root

    @property
    def names(self) -> tuple[Path | ObjectURL, ...]:
        """Every name of SRC, for the nesting rule of DST (``check_destination``): as given, and the root."""
        return (self.root,) if self.given is None else (self.given, self.root)

    def verify_reads(self) -> None:
        """Refuse (exit 1) a source whose bytes fail the checksums it carries: call before committing."""
        self.reader.ledger.finish()

    def read_full_box(self, view: ParamView, state: str, offsets: tuple[int, ...],
                      sizes: tuple[int, ...], bufs: Buffers | None = None) -> np.ndarray:
        """A box of parameter ``view``'s full tensor for ``state`` (weight: the model key), stored bits.

        ``bufs``: reusable buffers (one pair per thread) to read and assemble in; the result then
        lives in them until their next use.
        """
        out: np.ndarray | None = None
        covered = 0
        for h, lo, hi, fo, fs in self._pieces(view, offsets, sizes):
            whole = out is None and tuple(lo) == tuple(offsets) and [b - a for a, b in zip(lo, hi)] == list(sizes) \
                and tuple(fs[1:]) == tuple(sizes[1:])
            rows = self._rows_into(view, h, state, out, lo, hi, fo, fs, offsets, sizes, bufs) if not whole else None
            if rows is not None:  # whole rows of the box, read in place: no assembly copy
                out = rows
                covered += math.prod(b - a for a, b in zip(lo, hi))
                continue
            part = self._holder_rows(view, h, state, lo[0] - fo[0], hi[0] - fo[0],
                                     None if bufs is None else bufs.out if whole else bufs.scratch)
            if whole:
                return part  # one shard holds the whole box: no assembly copy
            part = part[(slice(None), *(slice(a - b, c - b) for a, c, b in zip(lo[1:], hi[1:], fo[1:])))]
            if out is None:
                out = self._box_out(part.dtype, sizes, bufs)
            out[tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, offsets))] = part
            covered += math.prod(b - a for a, b in zip(lo, hi))
        if out is None or covered != math.prod(sizes):
            raise FormatError(f"{self.root}: param {view.name} box {list(offsets)}+{list(sizes)} is not covered by "
                              "its shards; the manifest does not match the data")
        return out

    @staticmethod
    def _box_out(dtype: np.dtype, sizes: tuple[int, ...], bufs: Buffers | None) -> np.ndarray:
        n = math.prod(sizes) * dtype.itemsize
        return np.empty(sizes, dtype=dtype) if bufs is None else bufs.out.get(n).view(dtype).reshape(sizes)

    def _rows_into(self, view: ParamView, h: Holder, state: str, out: np.ndarray | None, lo: list[int],
                   hi: list[int], fo: tuple[int, ...], fs: tuple[int, ...], offsets: tuple[int, ...],
                   sizes: tuple[int, ...], bufs: Buffers | None) -> np.ndarray | None:
        """A holder's part of the box read straight into the box's rows, when it is whole rows of it (its shard
        spans the box's full width: the rows are one contiguous run of the result) and stored in the result's
        dtype: the box (``out``, made here for the first part). ``None``: read and copied as before.

        Why: a box split by rows across shards (a GTP or CP shard of a parameter) was read into a scratch buffer
        and copied into the result, a memory-to-memory pass over its bytes: the box assembly of an ``export --to
        hf --optimizer`` went from 0.13 CPU s/GB to nothing on the lent 16-core host (0.15 on 2 cores,
        ``benchmarks/copy_cpu_stages.py``); a box split by columns is still assembled by a copy.
        """
        if tuple(fs[1:]) != tuple(sizes[1:]) or tuple(fo[1:]) != tuple(offsets[1:]) or not sizes:
            return None
        key, bo, bs = self._holder_box(view, h, state, lo[0] - fo[0], hi[0] - fo[0])
        entry = self.ckpt.entries.get(key)
        if entry is None or entry.dtype is None:
            return None  # the read below reports it
        dtype = carrier(entry.dtype)
        if out is None:
            out = self._box_out(dtype, sizes, bufs)
        elif out.dtype != dtype:
            return None
        rows = out[lo[0] - offsets[0]:hi[0] - offsets[0]]
        if math.prod(bs) != rows.size:
            return None
        self.reader.read_box(key, bo, bs, into=rows)
        return out

    def copied_crc(self, view: ParamView, state: str, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> int | None:
        """After :meth:`read_full_box` of this box: the zip record CRC-32 of the source payload it returned
        unchanged, when the box is one stored chunk's whole payload (same bytes, shape and order) in a file the
        read ledger checks; ``None`` otherwise (the writer then hashes the bytes itself).

        Why it may stand for the bytes written: they are that payload's bytes, and before anything is committed
        :meth:`verify_reads` checks the source file's checksum over every byte, this record's CRC field
        included (with no manifest checksum, the ledger checks this very CRC against the payload's bytes).
        That is the trust ``ckpt verify --data`` puts in the field. It saves the largest CPU item of a
        reshard's writers (zlib's CRC-32, 2.3 GB/s on the 2-core machine) for 44 % of the bytes of
        benchmarks/bench_reshard.py's tp1-cp2 -> tp2-cp1 reshard.
        """
        pieces = list(self._pieces(view, offsets, sizes))
        if len(pieces) != 1:
            return None
        h, lo, hi, fo, fs = pieces[0]
        if tuple(lo) != tuple(offsets) or [b - a for a, b in zip(lo, hi)] != list(sizes) \
                or tuple(fs[1:]) != tuple(sizes[1:]):
            return None
        key, bo, bs = self._holder_box(view, h, state, lo[0] - fo[0], hi[0] - fo[0])
        chunk = self.reader.whole_chunk(key, bo, bs)
        if chunk is None or chunk.storage is None or self.reader.ledger.modes.get(chunk.storage.file) is None:
            return None
        return self.reader.payload_crc(key, chunk)

    @staticmethod
    def _pieces(view: ParamView, offsets: tuple[int, ...], sizes: tuple[int, ...]
                ) -> Iterator[tuple[Holder, list[int], list[int], tuple[int, ...], tuple[int, ...]]]:
        """The primary holders that meet the box: each with the box's part in it ``[lo, hi)`` and its own
        full-tensor box ``fo``/``fs``."""
        for h in view.primaries:
            fo, fs = full_box(h.spec)
            lo = [max(a, b) for a, b in zip(offsets, fo)]
            hi = [min(a + n, b + m) for a, n, b, m in zip(offsets, sizes, fo, fs)]
            if not any(a >= b for a, b in zip(lo, hi)):
                yield h, lo, hi, fo, fs

    def _holder_box(self, view: ParamView, h: Holder, state: str, r0: int, r1: int
                    ) -> tuple[str, tuple[int, ...], tuple[int, ...]]:
        """The stored key and box that hold rows ``[r0, r1)`` of a holder's valid rows, full width of its shard."""
        tail = h.spec.local_shape[1:]
        if state == WEIGHT_STATE or self.full_states:
            key = view.model_key if state == WEIGHT_STATE else f"optimizer.state.{state}.{view.model_key}"
            g = h.spec.global_offset
            if view.layer is None:
                return key, (g[0] + r0, *g[1:]), (r1 - r0, *tail)
            lead = view.lead
            return key, (*lead, g[0] + r0, *g[1:]), (*(1,) * len(lead), r1 - r0, *tail)
        row = math.prod(tail)
        return h.ref.key(state), (h.start + r0 * row,), ((r1 - r0) * row,)

    def _holder_rows(self, view: ParamView, h: Holder, state: str, r0: int, r1: int,
                     buf: Buffer | None = None) -> np.ndarray:
        """Rows ``[r0, r1)`` of a holder's valid rows, full width of its shard."""
        key, offsets, sizes = self._holder_box(view, h, state, r0, r1)
        return self.reader.read_box(key, offsets, sizes, buf).reshape((r1 - r0, *h.spec.local_shape[1:]))

    def chunks_read(self, view: ParamView, state: str, offsets: tuple[int, ...], sizes: tuple[int, ...]
                    ) -> list[tuple[str, Chunk]]:
        """The stored chunks :meth:`read_full_box` reads for this box, in its order, without reading: the same
        walk (:meth:`_pieces`, :meth:`_holder_box`, ``BoxReader.box_chunks``), so a plan of them is what the
        copy then asks for."""
        out: list[tuple[str, Chunk]] = []
        for h, lo, hi, fo, _ in self._pieces(view, offsets, sizes):
            key, bo, bs = self._holder_box(view, h, state, lo[0] - fo[0], hi[0] - fo[0])
            out.extend((key, c) for c in self.reader.box_chunks(key, bo, bs))
        return out


WHOLE_OBJECTS = 64 << 20  # a bucket's data objects fetched whole at the listing, at most (see open_source)
RESHARD_NEEDS = ("reshard writes this runtime's layout from the manifest's bucket layout (a genuine megatron-core "
                 "checkpoint: `ckpt export --to fully_reshardable`)")
COPY_SUFFIX = "; reshard and export copy only what verify passes"


def open_source(path: Path | ObjectURL, megatron: bool = False, weights_only: bool = False, views: bool = True,
                experts: bool = False, max_memory: int | None = None, dense_experts: bool = False,
                session: Session | None = None, full_states: bool = False) -> Source:
    """Open SRC through the one gate and refuse what cannot be resharded (see the module docstring).

    ``megatron=True`` (export) also takes a checkpoint without a manifest, through megatron-core's
    layout rules (:mod:`gtp_format.megatron.view`, which refuses what they do not cover).
    ``weights_only=True`` (an export of the model weights alone): a megatron-core checkpoint, whatever
    its optimizer sharding, is read through its model keys alone (:mod:`.weights`); ``experts=True``
    (``export --to fully_reshardable``): a megatron-core MoE checkpoint too (``dense_experts``: also one at EP 1
    with expert TP = TP, its experts in the dense buffers: the Hugging Face export); ``views=False``
    (``--to torch``, which copies keys, not parameters): no per-parameter view is built at all.
    ``max_memory`` (a copy that will read every byte): a bucket's small data objects may be fetched whole
    from its listing on, within a quarter of it (:meth:`gtp_format.storage.base.Storage.reads_everything`).
    ``session``: the command's (:class:`gtp_format.session.Session`), whose storages read it.
    ``full_states`` (``export --to hf --optimizer``): a megatron-core ``fully_reshardable`` save is read through
    its per-parameter optimizer keys (:func:`.weights.full_state_views`) instead of being refused for want of
    ``dp_reshardable`` buckets.
    """
    if max_memory is not None:
        storage_for(path, session).reads_everything(min(WHOLE_OBJECTS, max_memory // 4))
    source = _open_source(path, megatron, weights_only, views, experts, dense_experts, session, full_states)
    source.given = parse_location(path) if isinstance(path, str) else path
    return source


def _open_source(path: Path | ObjectURL, megatron: bool, weights_only: bool, views: bool, experts: bool,
                 dense_experts: bool = False, session: Session | None = None, full_states: bool = False) -> Source:
    gated = open_gated(path, needs_manifest=None if megatron else RESHARD_NEEDS, aliased=REFUSE,
                       copy=True, refusal_suffix=COPY_SUFFIX, session=session)
    ckpt, manifest = gated.ckpt, gated.manifest
    if manifest is None:
        return _open_megatron(ckpt, weights_only, views, experts, dense_experts, full_states)
    if manifest.optimizer_sharding != OPTIMIZER_SHARDINGS[0]:
        raise FormatError(f"{ckpt.root}: optimizer sharding is {manifest.optimizer_sharding!r}; reshard reads "
                          "dp_reshardable checkpoints")
    # verify's manifest_keys check (gtp_format.check.keys) has refused every missing or misshapen key
    # the layout implies, except model weights when not one is stored: the views read those.
    params = param_views(manifest)
    missing = [name for name in params if name not in ckpt.entries]
    if missing:
        raise FormatError(f"{ckpt.root}: incomplete checkpoint: {len(missing)} keys the manifest implies are "
                          f"missing, e.g. {missing[0]!r}; run `ckpt verify` and reshard a complete one")
    return Source(ckpt, manifest, params, CheckedReader(ckpt))


def _open_megatron(ckpt: Checkpoint, weights_only: bool = False, views: bool = True, experts: bool = False,
                   dense_experts: bool = False, full_states: bool = False) -> Source:
    """A checkpoint without a manifest, already through the gate: megatron-core's layout rules."""
    from ckpt_tool.copying.weights import check_tied_masters, full_state_views, weight_views
    from gtp_format.megatron.view import megatron_views

    if weights_only:
        return Source(ckpt, None, weight_views(ckpt) if views else {}, CheckedReader(ckpt))
    if full_states:
        from gtp_format.megatron.topology import key_format

        if key_format(ckpt) == "fully_reshardable":
            source = Source(ckpt, None, full_state_views(ckpt), CheckedReader(ckpt), full_states=True)
            try:
                check_tied_masters(source)
            except BaseException:
                source.reader.close()
                raise
            return source
    return Source(ckpt, None, megatron_views(ckpt, experts=experts, dense_experts=dense_experts), CheckedReader(ckpt))
