"""Find the checkpoint folder behind a user's PATH and tell which layout it uses.

Users pass either an ``iter_XXXXXXX`` folder or the run's checkpoint directory holding
``latest_checkpointed_iteration.txt``, the way Megatron resumes. The marker file is input like
any other: its content must be an iteration number (or Megatron's ``release``) and the folder it
names must exist, or the user gets one line saying which.

What a crash leaves is read too (the writer's rules, :mod:`gtp_format.writer.checkpoint`): a
hidden work folder pointed at directly is a checkpoint only once its writer finished it
(``metadata.json``, written last, is there) and its owner is gone; and where the marker names an
iteration that is missing because a crash fell between the two renames of a portable replace, its
finished hidden copy is used instead (:func:`recover_hidden`), with a note saying so.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gtp_format.errors import FormatError
from gtp_format.manifest import Manifest, ManifestError, parse_manifest
from gtp_format.model import Problem
from gtp_format.names import (
    DCP_METADATA_FILE,
    DISTCP_RE,
    ITER_DIR_RE,
    LATEST_FILE,
    LAYOUTS,
    MANIFEST_FILE,
    MEGATRON_METADATA_FILE,
    iter_dir_name,
    parse_latest,
)
from gtp_format.reader.storage import is_folder_inside, is_regular_inside, list_dir, read_small_file, stored_size
from gtp_format.safe_json import JSON_LIMIT, Budget, load_json_object
from gtp_format.storage.base import Storage, storage_for
from gtp_format.storage.location import ObjectURL
from gtp_format.work import leftovers, parse_work, proven

if TYPE_CHECKING:
    from gtp_format.session import Session

LAYOUT_TORCH_DIST, LAYOUT_SAFETENSORS = LAYOUTS
SAFETENSORS_SUFFIX = ".safetensors"
SAFETENSORS_INDEX_FILE = "model.safetensors.index.json"
RELEASE_DIR = "release"



@dataclass(frozen=True)
class Located:
    """A checkpoint folder and what was found in it."""

    folder: Path | ObjectURL  # a bucket's prefix for s3:// (gtp_format.storage.location)
    layout: str
    names: tuple[str, ...]  # entries of the folder, sorted
    recovered: str | None = None  # the iteration folder the marker names, when a hidden copy stands in for it
    storage: Storage | None = None  # the folder's storage in the opening session (None: none was given)

    @property
    def store(self) -> Path | ObjectURL | Storage:
        """Where its files are read: the session's storage of the folder, else the folder."""
        return self.folder if self.storage is None else self.storage


# Which hidden copies may stand in for a missing iteration: a writer's finished new copy. An ``old``
# copy (the iteration a replace moved aside) carries no ownership token, so it is never promoted.
_RECOVERY_ORDER = {"tmp": 0, "migrate": 1}


def recover_hidden(parent: Path, name: str) -> Path | None:
    """The hidden copy that stands in for the missing ``parent/name``, None when there is no candidate,
    or a one-line refusal (:class:`FormatError`) naming a candidate that cannot be trusted.

    A copy is promoted only when all of these hold: its writer is gone (a live writer's copy is about
    to be renamed); it is finished (``metadata.json``, written last after every other file was
    fsynced); this tool's writer provably made it (the ownership token matches its name,
    :func:`gtp_format.work.proven`: a folder merely *named* like one is not); and its
    manifest records the iteration the marker names. Anything else was taken with a warning before
    (a copy of unknown owner, a copy holding another iteration); now it is refused, the candidate named.
    """
    best: tuple[int, str, Path] | None = None
    refused: str | None = None
    want = parse_latest(name.removeprefix("iter_")) if name.startswith("iter_") else None
    for w in leftovers(parent):
        if w.target != name or w.state == "live" or not is_folder_inside(parent, w.path.name):
            continue
        why = _unrecoverable(w, want, proven(w))
        if why is not None:
            refused = refused or f"{w.path}: {why}"
            continue
        rank = (_RECOVERY_ORDER[w.tag], w.path.name, w.path)
        best = rank if best is None or rank < best else best
    if best is not None:
        return best[2]
    if refused is not None:
        raise FormatError(f"{parent / name} is missing and its hidden copy cannot stand in for it: {refused}; "
                          f"restore {name} from a good copy (or point {LATEST_FILE} at another iteration)")
    return None


def _unrecoverable(w: Any, want: int | None, owned: bool) -> str | None:
    """Why the hidden copy ``w`` may not stand in for the marker's iteration ``want``, or None."""
    if w.tag not in _RECOVERY_ORDER:
        return f"a {w.tag!r} copy (what a replace moved aside) is never promoted"
    if not owned:
        return "nothing proves this tool's writer made it (no ownership token matching its name)"
    try:
        names = list_dir(w.path)
    except FormatError as e:
        return e.message
    if MEGATRON_METADATA_FILE not in names or _layout_of(names) is None:
        return f"its writer never finished it (no {MEGATRON_METADATA_FILE}, written last)"
    if MANIFEST_FILE not in names:
        return f"it has no {MANIFEST_FILE} to say which iteration it holds"
    try:
        it = parse_manifest(load_json_object(w.path / MANIFEST_FILE, "the manifest"), str(w.path / MANIFEST_FILE),
                            strict=False).iteration
    except FormatError as e:
        return e.message
    if want is None or it != want:
        return f"its manifest records iteration {it}, not the marker's {want}"
    return None


def _check_work_folder(p: Path, names: list[str]) -> None:
    """Refuse a hidden work folder that is not a finished checkpoint (pointed at directly)."""
    w = parse_work(p)
    if w is None:
        return
    if w.state == "live" and w.pid != os.getpid():  # a writer may check its own work (migrate's self-check)
        raise FormatError(f"{p}: a hidden work folder that process {w.pid} is still writing; wait for it, "
                          f"then use {p.with_name(w.target)}")
    if MEGATRON_METADATA_FILE not in names:
        raise FormatError(f"{p}: a hidden work folder its writer never finished (no {MEGATRON_METADATA_FILE}, "
                          "written last): not a checkpoint; use a committed iter_XXXXXXX folder")


def _read_latest(parent: Path | ObjectURL) -> Path | ObjectURL:
    marker = parent / LATEST_FILE
    fix = f"write the iteration number into {LATEST_FILE} or pass the iter_XXXXXXX folder itself"
    raw = read_small_file(marker, 64, "an iteration marker", fix)
    text = raw.decode("utf-8", errors="replace").strip()
    if text == RELEASE_DIR:
        folder = parent / RELEASE_DIR
    elif (iteration := parse_latest(text)) is not None:
        folder = parent / iter_dir_name(iteration)
    else:
        raise FormatError(f"{marker} holds {text[:40]!r}, not an iteration number; {fix}")
    if not is_folder_inside(parent, folder.name):
        if not storage_for(folder).in_place:  # a bucket has no hidden copies to recover: its writer commits last
            raise FormatError(f"{marker} names iteration {text} but no object lies below {folder}; {fix}")
        if not os.path.lexists(folder):
            hidden = recover_hidden(parent, folder.name)
            if hidden is not None:
                return hidden
        what = ("missing" if not os.path.lexists(folder) else "a file" if folder.is_file() and not folder.is_symlink()
                else "not a folder inside the run directory")
        raise FormatError(f"{marker} names iteration {text} but {folder} is {what}; {fix}")
    return folder


def _layout_of(names: list[str]) -> str | None:
    if DCP_METADATA_FILE in names:
        return LAYOUT_TORCH_DIST
    if any(n.endswith(SAFETENSORS_SUFFIX) for n in names):
        return LAYOUT_SAFETENSORS
    return None


def locate(path: str | os.PathLike[str] | ObjectURL, session: Session | None = None) -> Located:
    """Resolve PATH (a folder, or an ``s3://`` URL: :func:`parse_location`) to a checkpoint folder,
    following ``latest_checkpointed_iteration.txt``; ``session``: the command's
    (:class:`gtp_format.session.Session`), whose storage of the folder the readers then use."""
    store = storage_for(path, session)
    p = store.location
    if not store.exists():
        raise FormatError(f"{p} does not exist; pass a checkpoint folder (iter_XXXXXXX) or its parent")
    if store.in_place and not p.is_dir():  # a bucket's prefix is listed next, with its own words
        raise FormatError(f"{p} is a file, expected a checkpoint folder; pass the iter_XXXXXXX folder or its parent")
    names = list_dir(p)
    layout = _layout_of(names)
    recovered = None
    if layout is None and LATEST_FILE in names:
        named = _read_latest(p)
        hidden = parse_work(named)
        recovered = hidden.target if hidden is not None else None
        p = named
        names = list_dir(p)
        layout = _layout_of(names)
    _check_work_folder(p, names)
    if not store.in_place and layout is not None and MEGATRON_METADATA_FILE not in names:
        # the bucket writer's commit object, uploaded last (gtp_format/storage/upload.py)
        raise FormatError(f"{p}: no {MEGATRON_METADATA_FILE}, the object a writer uploads last: an unfinished upload, "
                          "not a checkpoint; use a committed prefix (or copy metadata.json in if the upload finished)")
    if layout is None:
        if any(DISTCP_RE.match(n) for n in names) or MEGATRON_METADATA_FILE in names:
            raise FormatError(
                f"{p / DCP_METADATA_FILE} is missing: the folder has data files but no DCP metadata "
                "(an interrupted save?); restore .metadata or use another iteration"
            )
        iters = [n for n in names if ITER_DIR_RE.match(n)]
        if iters:
            raise FormatError(f"{p} holds {len(iters)} iter_* folders but no {LATEST_FILE}; pass one of them, "
                              f"e.g. {p / iters[-1]}")
        what = "is empty" if not names else "has no .metadata, *.safetensors or " + LATEST_FILE
        raise FormatError(f"{p} {what}: not a checkpoint folder; pass an iter_XXXXXXX folder or its parent")
    return Located(folder=p, layout=layout, names=tuple(names), recovered=recovered,
                   storage=None if session is None else storage_for(p, session))


SIDE_PER_DATA = 16  # a manifest spends ~200 bytes per parameter; a parameter stores thousands of bytes


def side_file_budget(loc: Located) -> Budget:
    """What ``metadata.json`` and the manifest may cost: 1 MiB, plus a sixteenth of the bytes the data
    files really store (a sparse file adds nothing), at most :data:`JSON_LIMIT`. Parsed, a 16 MiB file
    of short values is ~250 MB; a checkpoint of a few MB gets a few MB of side file, not that."""
    sizes = [is_regular_inside(loc.folder, n) or 0 for n in (MANIFEST_FILE, MEGATRON_METADATA_FILE) if n in loc.names]
    if max(sizes, default=0) <= 1 << 20:  # every genuine side file: no data file is asked for its size
        return Budget(1 << 20, None, "a side file")
    stored = sum(stored_size(loc.folder, n) for n in loc.names if DISTCP_RE.match(n) or n.endswith(".safetensors"))
    limit = min(JSON_LIMIT, (1 << 20) + stored // SIDE_PER_DATA)
    return Budget(limit, None, f"a side file of a checkpoint storing {stored} data bytes")


def load_side_files(loc: Located) -> tuple[dict[str, Any] | None, Manifest | None, list[Problem]]:
    """Megatron's ``metadata.json`` and our ``gtp_manifest.json`` (parsed leniently), when present.

    A manifest whose header is unusable is left out with an ``error`` problem; sections that fail
    their type checks are dropped with one problem each, so ``inspect`` still shows everything else.
    """
    budget = side_file_budget(loc)
    megatron = (load_json_object(loc.folder / MEGATRON_METADATA_FILE, "Megatron metadata", budget=budget)
                if MEGATRON_METADATA_FILE in loc.names else None)
    if MANIFEST_FILE not in loc.names:
        return megatron, None, []
    path = loc.folder / MANIFEST_FILE
    try:
        manifest = parse_manifest(load_json_object(path, "the manifest", budget=budget), str(path), strict=False)
    except ManifestError as e:
        return megatron, None, [Problem("error", "manifest", e.message, file=MANIFEST_FILE)]
    # A damaged files section leaves data unchecked: an error. Other sections only inform the
    # views (topology, folded buffers); without them the checks fall back to the keys: a warning.
    return megatron, manifest, [
        Problem("error" if p.startswith("files") else "warning", "manifest", f"{path}: {p}; the section is ignored",
                file=MANIFEST_FILE) for p in manifest.problems]
