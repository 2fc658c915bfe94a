"""Open a checkpoint PATH as a :class:`gtp_format.model.Checkpoint`: locate, detect, read metadata.

This is the only entry point the commands use, so every command accepts the same PATH forms and
refuses the same bad input with the same words.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from gtp_format.errors import ChunkError, FormatError
from gtp_format.model import ENC_RAW, ENC_TORCH_SAVE, Checkpoint, ChunkColumns, ChunkTable, Entry, Problem
from gtp_format.names import DCP_METADATA_FILE, iteration_from_name
from gtp_format.reader.dcp_reader import data_file_sizes, read_dcp_metadata
from gtp_format.reader.declared import check_declared_counts
from gtp_format.reader.locate import LAYOUT_SAFETENSORS, load_side_files, locate
from gtp_format.reader.safetensors_reader import read_gtp_index, read_safetensors_metadata, safetensors_files
from gtp_format.reader.storage import file_size

if TYPE_CHECKING:
    from gtp_format.session import Session

TORCH_DIST_BACKEND = "torch_dist"
GTP_SAFETENSORS_BACKEND = "gtp_safetensors"  # metadata.json of gtp_runtime's safetensors layout


def open_checkpoint(path: str | os.PathLike[str], keep_raw_metadata: bool = False,
                    session: Session | None = None) -> Checkpoint:
    """Read a checkpoint's metadata; never reads a data file except safetensors headers.

    ``keep_raw_metadata`` keeps the allow-listed ``.metadata`` records on the model
    (:attr:`Checkpoint.raw_metadata`, torch_dist only) for a caller that rewrites them. ``session``: the
    command's (:class:`gtp_format.session.Session`): the checkpoint's files are read through its storage
    (:attr:`Checkpoint.store`), under its limits.
    """
    loc = locate(path, session)
    megatron, manifest, manifest_notes = load_side_files(loc)
    notes: list[Problem] = []
    if loc.layout == LAYOUT_SAFETENSORS:
        from gtp_format.names import GTP_INDEX_FILE as INDEX_FILE  # this project's layout

        files = safetensors_files(loc)
        encoding, version, raw_metadata = ENC_RAW, None, None
        if INDEX_FILE in loc.names:
            entries, notes = read_gtp_index(loc, files, INDEX_FILE)
            backend, metadata_file = "gtp safetensors", INDEX_FILE
        elif megatron is not None and megatron.get("sharded_backend") == GTP_SAFETENSORS_BACKEND:
            raise FormatError(f"{loc.folder / INDEX_FILE} is missing: metadata.json names the gtp safetensors layout "
                              f"but its index was never written (an interrupted save?); use another iteration")
        else:
            entries, notes = read_safetensors_metadata(loc, files)
            backend, metadata_file = "dcp safetensors (HuggingFaceStorageWriter)", None
    else:
        files = data_file_sizes(loc.folder, loc.names)
        entries, notes, version, raw_metadata = read_dcp_metadata(loc, files, keep_raw_metadata)
        is_megatron = megatron is not None and megatron.get("sharded_backend") == TORCH_DIST_BACKEND
        backend = "megatron torch_dist" if is_megatron else "dcp"
        encoding, metadata_file = ENC_TORCH_SAVE, DCP_METADATA_FILE
        if megatron is not None and not is_megatron:
            notes.append(Problem("warning", "backend",
                                 f"metadata.json names sharded_backend {megatron.get('sharded_backend')!r}, "
                                 "not 'torch_dist', yet the folder holds DCP files"))
        # Referenced files with other names (older writers, renamed copies) are data files too.
        referenced = referenced_files(entries.values())
        files.update(_referenced_sizes(loc.folder, referenced - files.keys()))
    iteration = iteration_from_name(loc.folder)
    if loc.recovered is not None:
        iteration = iteration_from_name(Path(loc.recovered))
        notes.append(Problem("warning", "recovered", f"{loc.folder.parent / loc.recovered} is missing (a crash while "
                             f"it was replaced); read its complete hidden copy {loc.folder.name} instead"))
    notes.extend(manifest_notes)
    if manifest is not None:
        check_declared_counts(manifest, entries, str(loc.folder))
        if iteration is not None and manifest.iteration != iteration:
            notes.append(Problem("warning", "manifest", f"manifest says iteration {manifest.iteration} but the folder "
                                 f"is {loc.folder.name}"))
        iteration = manifest.iteration
    return Checkpoint(
        root=loc.folder, layout=loc.layout, backend=backend, encoding=encoding, entries=entries,
        data_files=dict(sorted(files.items())), metadata_file=metadata_file, dcp_version=version,
        megatron_metadata=megatron, manifest=manifest, iteration=iteration, notes=notes, raw_metadata=raw_metadata,
        storage=loc.storage,
    )



def referenced_files(entries: Iterable[Entry]) -> set[str]:
    """The files the chunks' storage names (a chunk table's once, not per chunk)."""
    out: set[str] = set()
    tables: dict[int, ChunkTable] = {}
    for e in entries:
        if isinstance(e.chunks, ChunkColumns):
            tables[id(e.chunks.table)] = e.chunks.table
        else:
            out.update(c.storage.file for c in e.chunks if c.storage)
    for t in tables.values():
        used = np.unique(t.file[t.file >= 0])
        out.update(t.files[i] for i in used.tolist())
    return out


def _referenced_sizes(folder: Path, rels: set[str]) -> dict[str, int]:
    """Sizes of referenced data files with non-DCP names that are usable files inside the folder."""
    sizes = {}
    for rel in rels:
        try:
            sizes[rel] = file_size(folder, rel)
        except ChunkError:
            pass  # verify reports unusable storage paths, with the reason
    return sizes
