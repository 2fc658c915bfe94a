"""Megatron's own integrity file, where a checkpoint has one: ``integrity.json`` (SHA-256 per file).

megatron-core writes it when a save is asked to (``dist_checkpointing.save(...,
verify_integrity=True)``, ``--verify-integrity`` in Megatron-LM; PR #4305): after the save, rank 0
hashes every regular file at the top of the checkpoint folder except this one and writes
``{"algorithm": "sha256", "files": {name: hex digest}}``. Its own check runs only inside a load.

Here: without ``--data``, every listed name is a plain file name inside the folder and exists, and
files the save did not list are named (a warning: added afterwards); with ``--data``, each listed
file is hashed, the data files in the data pass's single read (SHA-256 is fed window by window in
file order), the rest here. The file is untrusted input like any other: read through the bounded
JSON reader, names checked before anything is opened.
"""

from __future__ import annotations

from gtp_format.errors import ChunkError, FormatError
from gtp_format.hashing import file_digests
from gtp_format.model import Checkpoint, Problem, ProblemCap
from gtp_format.names import MEGATRON_INTEGRITY_FILE as FILE
from gtp_format.reader.storage import file_size, is_regular_inside, list_dir, open_regular, unsafe_reason

ALGORITHM = "sha256"
SIDE_FILES = 16  # files beside the data files a save may list: .metadata, common.pt, metadata.json, ...
BYTES_PER_ENTRY = 512  # one "name": "64 hex digits" member, with a name of up to 255 bytes and spacing
_HEX = set("0123456789abcdef")


def read_integrity(ckpt: Checkpoint) -> tuple[dict[str, str] | None, list[Problem]]:
    """The listing ``name -> sha256`` when the folder has ``integrity.json``; problems when it is unusable."""
    if is_regular_inside(ckpt.store, FILE) is None:
        return None, []
    from gtp_format.safe_json import Budget, load_json_object

    def bad(message: str) -> tuple[None, list[Problem]]:
        return None, [Problem("error", "megatron_integrity", f"{message}; restore {FILE} from the save that wrote it "
                              "or remove it", file=FILE)]

    files_here = len(ckpt.data_files) + SIDE_FILES
    budget = Budget.per_item(files_here, BYTES_PER_ENTRY, 2, f"a listing of the folder's at most {files_here} files",
                             floor=4096)
    try:
        body = load_json_object(ckpt.root / FILE, "Megatron's integrity manifest", budget=budget)
    except FormatError as e:
        return bad(e.message)
    if body.get("algorithm", ALGORITHM) != ALGORITHM:
        return bad(f"algorithm {body.get('algorithm')!r} is not {ALGORITHM!r}, the only one megatron-core writes")
    files = body.get("files")
    if not isinstance(files, dict):
        return bad("it has no 'files' object")
    if len(files) > files_here:
        return bad(f"it lists {len(files):,} files, more than the {files_here} a checkpoint folder of "
                   f"{len(ckpt.data_files)} data files holds")
    out: dict[str, str] = {}
    problems = ProblemCap("megatron_integrity")
    for name, digest in files.items():
        reason = unsafe_reason(name)
        if reason is None and "/" in name:
            reason = f"{name!r} is not a file name at the top of the checkpoint folder"
        if reason is not None:
            problems.add(Problem("error", "megatron_integrity", f"{FILE} lists {reason}", file=FILE))
        elif not (isinstance(digest, str) and len(digest) == 64 and set(digest.lower()) <= _HEX):
            problems.add(Problem("error", "megatron_integrity", f"{FILE} gives {name} a digest that is not "
                                 "SHA-256 hex", file=name))
        else:
            out[name] = digest.lower()
    return out, problems.done(FILE)


def integrity_algorithms(ckpt: Checkpoint, listing: dict[str, str] | None) -> dict[str, list[str]]:
    """Data files the data pass should also SHA-256 for the integrity file."""
    return {name: [ALGORITHM] for name in listing or {} if name in ckpt.data_files}


def check_integrity(ckpt: Checkpoint, listing: dict[str, str], data: bool,
                    digests: dict[str, dict[str, str]] | None) -> list[Problem]:
    """Listed files exist (and with ``data`` hash as listed); files the save did not list are named."""
    out = ProblemCap("megatron_integrity")
    for name, want in sorted(listing.items()):
        try:
            file_size(ckpt.store, name, "file")
        except ChunkError as err:
            out.add(Problem("error", "megatron_integrity", f"{FILE} lists it, but {err.message}", file=name))
            continue
        if not data:
            continue
        got = (digests or {}).get(name, {}).get(ALGORITHM)
        if got is None:
            try:
                with open_regular(ckpt.store, name, "file") as f:
                    got = file_digests(f, [ALGORITHM])[ALGORITHM]
            except ChunkError as err:
                out.add(Problem("error", "megatron_integrity", err.message, file=name))
                continue
        if got != want:
            out.add(Problem("error", "megatron_integrity", f"sha256 is {got} but {FILE} says {want}: the file "
                               "changed after the save; restore it from a good copy", file=name))
    try:
        present = {n for n in list_dir(ckpt.store) if n != FILE and is_regular_inside(ckpt.store, n) is not None}
    except (ChunkError, FormatError, OSError):
        present = set()
    for name in sorted(present - listing.keys()):
        out.add(Problem("warning", "megatron_integrity", f"not listed in {FILE}: added after the save", file=name))
    return out.done(FILE)
