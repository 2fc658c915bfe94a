"""Writing a migrated iteration folder: links, the one new data file, ``.metadata``, the manifest.

SRC's data files are hard-linked (copied where links fail), so a migration writes only what is
new: the rebuilt and zeroed chunks, and two small files. The new chunks go to one new data file
``__{world}_{k}.distcp``: a DCP-shaped name (readers that parse ranks accept it) whose "rank" is
outside the world, so it can never be taken for a rank's file. Each chunk in it is a complete
``torch.save`` blob, exactly as DCP's FileSystemWriter writes, and the file's checksum is computed
as it is written (a zeroed chunk's CRC is combined, not recomputed; its zero run becomes a hole).
Every file is made durable through :mod:`gtp_format.commit`; the folder is the one checkpoint
writer's (:class:`gtp_format.writer.checkpoint.CheckpointWriter`), which writes the manifest and then
``metadata.json`` last (its presence says the folder is finished) and is committed by
:mod:`ckpt_tool.migrate.commit`.
"""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ckpt_tool.migrate.chunk_records import migrated_records
from ckpt_tool.migrate.metadata import build_metadata, encode, source_records
from ckpt_tool.migrate.plan import REBUILD, RESET, Plan
from ckpt_tool.migrate.record import migrated_manifest
from ckpt_tool.migrate.weights import ShardCache, rebuild_master
from gtp_format.commit import fsync_file, write_durable
from gtp_format.errors import FormatError
from gtp_format.hashing import CRCS, Crc, gf2_times
from gtp_format.lineage import LINEAGE_KEY, derived
from gtp_format.manifest import HASH_ALGORITHM
from gtp_format.names import CHUNK_RECORDS_FILE, DCP_METADATA_FILE, MANIFEST_FILE, MEGATRON_METADATA_FILE
from gtp_format.progress import Progress
from gtp_format.reader.safe_pickle import MetadataRecord
from gtp_format.reader.storage import is_regular_inside, list_dir, open_regular, read_small_file
from gtp_format.storage import objects
from gtp_format.storage.base import storage_for
from gtp_format.storage.location import ObjectURL
from gtp_format.writer.checkpoint import CheckpointWriter, data_file_name, link_or_copy

MAX_MEGATRON_JSON = 1 << 20  # Megatron's metadata.json is a few hundred bytes


@dataclass(frozen=True)
class Blob:
    """A prepared ``torch.save`` blob with its checksum and the operator that shifts a CRC past it."""

    data: bytes
    crc: int
    shift: list[int]
    zeros: tuple[int, int]  # the longest run of zero bytes: the tensor's data


class ZeroBlobs:
    """``torch.save`` blobs of fp32 zero tensors, one per shape (they are byte-identical), bounded."""

    def __init__(self, crc: Crc, budget: int = 512 << 20) -> None:
        self.crc, self.budget = crc, budget
        self.items: OrderedDict[tuple[int, ...], Blob] = OrderedDict()

    def get(self, sizes: tuple[int, ...]) -> Blob:
        import io

        import numpy as np

        blob = self.items.get(sizes)
        if blob is None:
            buf = io.BytesIO()
            torch.save(torch.zeros(sizes, dtype=torch.float32), buf)
            data = buf.getvalue()
            nz = np.flatnonzero(np.frombuffer(data, dtype=np.uint8))
            zeros = (0, 0)
            if len(nz) > 1:
                i = int(np.argmax(np.diff(nz)))
                zeros = (int(nz[i]) + 1, int(nz[i + 1]))
            blob = Blob(data, self.crc.update(data, 0), self.crc.shift(len(data)), zeros)
            self.items[sizes] = blob
            while sum(len(b.data) for b in self.items.values()) > self.budget and len(self.items) > 1:
                self.items.popitem(last=False)
        self.items.move_to_end(sizes)
        return blob


HOLE_MIN = 64 << 10  # zero runs at least this long are left as holes (sparse file), not written


class CountingWriter:
    """A write-only stream for ``torch.save`` that tracks the position and the CRC of its bytes."""

    def __init__(self, f: Any, crc: Crc) -> None:
        self.f, self.pos, self.crc, self._update = f, 0, 0, crc.update

    def write(self, b: Any) -> int:
        mv = memoryview(b)
        self.f.write(mv)
        self.crc = self._update(mv, self.crc)
        self.pos += mv.nbytes
        return mv.nbytes

    def write_blob(self, blob: Blob) -> None:
        """Append a prepared blob: its zero run becomes a hole (reads back as the same zeros)."""
        a, z = blob.zeros
        if z - a >= HOLE_MIN:
            self.f.write(blob.data[:a])
            self.f.seek(z - a, os.SEEK_CUR)
            self.f.write(blob.data[z:])
        else:
            self.f.write(blob.data)
        self.crc = gf2_times(blob.shift, self.crc) ^ blob.crc
        self.pos += len(blob.data)

    def flush(self) -> None:
        self.f.flush()

    def close_out(self) -> None:
        """Make the file exactly ``pos`` bytes long (a trailing hole leaves it short); the caller fsyncs it."""
        self.f.flush()
        if os.fstat(self.f.fileno()).st_size != self.pos:
            self.f.truncate(self.pos)


def new_data_file_name(names: set[str], world: int) -> str:
    """``__{world}_{k}.distcp`` with the first ``k`` not taken: a rank outside the world never clashes."""
    k = 0
    while data_file_name(world, k, "torch_dist") in names:
        k += 1
    return data_file_name(world, k, "torch_dist")


@dataclass
class Outcome:
    """What a migration wrote, for the report (and the benchmark's phase timings)."""

    destination: Path | ObjectURL
    new_data_file: str | None
    new_bytes: int
    linked: int
    copied: int
    backup: Path | None = None
    notes: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)  # seconds per phase (benchmarks read them)


def _download(src: ObjectURL, name: str, dst: Path) -> None:
    """Copy the object ``name`` of a bucket's SRC into the new local file ``dst``, in bounded ranged reads."""
    with open_regular(src, name) as f, open(dst, "xb") as out:
        for piece in f.pieces(objects.PART):  # type: ignore[attr-defined]
            out.write(piece)
    fsync_file(dst)


def _carry_files_over(src: Path | ObjectURL, names: list[str], out: Path, outcome: Outcome,
                      progress: Progress) -> None:
    """Every file of SRC but the two rewritten ones, linked (or copied) into ``out``; from a bucket, copied in
    ranged reads (the upload of the migrated copy puts them back, under the new prefix)."""
    for name in names:
        p = src / name
        if name in (DCP_METADATA_FILE, MANIFEST_FILE, CHUNK_RECORDS_FILE):  # rewritten (never through a link)
            continue
        bucket = storage_for(src).remote  # a store has no symlinks; its objects are downloaded, not linked
        if (is_regular_inside(src, name) is None) if bucket else (p.is_symlink() or not p.is_file()):
            raise FormatError(f"{p} is not a regular file; migrate-aliased only carries the files of a checkpoint "
                            "folder over; move it out of the folder first")
        if name == MEGATRON_METADATA_FILE:  # the writer's finish() links it, last
            progress(1)
            continue
        if bucket:
            _download(src, name, out / name)
            outcome.copied += 1
        elif link_or_copy(p, out / name):
            outcome.linked += 1
        else:
            outcome.copied += 1
        progress(1)


def _write_lost_state(plan: Plan, md: MetadataRecord, path: Path, stream: Crc,
                      progress: Progress) -> tuple[dict[tuple[str, tuple[int, ...]], tuple[int, int]], int, int]:
    """Rebuilt masters and zeroed moments, one ``torch.save`` blob each, into the new data file ``path``.

    Chunks go in the order of SRC's keys, then CP rank, then offset. Returns where each landed
    (``(new key, offsets) -> (start, length)``), the file's length and its checksum under ``stream``.
    """
    written = [c for c in plan.lost if c.action in (REBUILD, RESET)]
    shards, zeros = ShardCache(plan.ckpt), ZeroBlobs(stream)
    order = {k: i for i, k in enumerate(md.get("state_dict_metadata"))}
    written.sort(key=lambda c: (order[c.source_key], c.cp_rank, c.offsets))
    where: dict[tuple[str, tuple[int, ...]], tuple[int, int]] = {}
    try:
        with open(path, "wb") as f:
            w = CountingWriter(f, stream)
            for c in written:
                start = w.pos
                if c.action == REBUILD:
                    torch.save(rebuild_master(plan, c, shards), w)
                else:
                    w.write_blob(zeros.get(c.sizes))
                where[(c.new_key, c.offsets)] = (start, w.pos - start)
                progress(1)
            w.close_out()
        fsync_file(path)
    except OSError as e:  # write() names no file: a full disk must name the one being written
        if e.filename is None:
            e.filename = str(path)
        raise
    return where, w.pos, w.crc


def build_migrated(plan: Plan, writer: CheckpointWriter, checkpoint_id: Path | str, progress: Progress) -> Outcome:
    """Write the migrated iteration into the writer's (new, empty) folder and finish it. Reads SRC,
    never writes it.

    ``checkpoint_id`` is where the folder will be once committed (DCP records it in ``.metadata``).
    """
    assert plan.par is not None and plan.manifest is not None
    src, out = plan.ckpt.root, writer.folder
    names = list_dir(src)  # sorted; a bucket's prefix lists its objects (and sub-prefixes, refused below)
    clock = time.perf_counter()
    md = source_records(plan.ckpt)
    outcome = Outcome(out, None, 0, 0, 0)

    def lap(name: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        outcome.timings[name] = now - clock
        clock = now

    _carry_files_over(src, names, out, outcome, progress)
    lap("link")

    new_file = new_data_file_name(set(names), plan.par.world_size)
    stream = CRCS.get(plan.manifest.hash_algorithm, CRCS[HASH_ALGORITHM])  # the new file's CRC, as written
    lost_storage: dict[tuple[str, tuple[int, ...]], tuple[int, int]] = {}
    crc = None
    if any(c.action in (REBUILD, RESET) for c in plan.lost):
        lost_storage, outcome.new_bytes, value = _write_lost_state(plan, md, out / new_file, stream, progress)
        crc = (stream.name, value)
        outcome.new_data_file = new_file
    lap("lost_state")

    metadata = build_metadata(plan, md, new_file, lost_storage, checkpoint_id)
    write_durable(out / DCP_METADATA_FILE, encode(metadata))
    manifest = migrated_manifest(plan, out, outcome.new_data_file, crc)
    manifest.extra[LINEAGE_KEY] = derived(plan.ckpt, "migrate")[0]  # the source as parent, its run id kept
    writer.add_files(manifest.files)
    records = migrated_records(plan.ckpt, out, metadata, manifest.files, outcome.new_data_file)
    if records is not None:
        writer.add_records(records)
    lap("chunk_records")
    megatron: Path | ObjectURL | bytes | None = None
    if MEGATRON_METADATA_FILE in names:
        megatron = src / MEGATRON_METADATA_FILE
        if storage_for(megatron).remote:  # no local file to link: its bytes
            megatron = read_small_file(megatron, MAX_MEGATRON_JSON, "metadata.json", "restore it from the run")
    writer.finish(manifest, megatron)  # SRC's own metadata.json, linked last (a bucket's: its bytes)
    if isinstance(megatron, bytes):
        outcome.copied += 1
    elif megatron is not None:
        linked = os.stat(megatron).st_ino == os.stat(out / MEGATRON_METADATA_FILE).st_ino
        outcome.linked, outcome.copied = outcome.linked + linked, outcome.copied + (not linked)
    outcome.notes = list(manifest.notes[-1:])
    lap("metadata")
    return outcome
