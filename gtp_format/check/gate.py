"""The one gate: open a checkpoint and refuse it exactly as ``ckpt verify`` would, before code trusts it.

Anything that is about to hand a checkpoint to code that trusts it (DCP's loader, a reshard or
export that copies it, migrate-aliased that rewrites it, verify-roundtrip that loads it on ranks)
passes here: the same reader, the same strict manifest verdict and the same structural checks as
``ckpt verify``, refused with the same one line. Measured on 101e36d: a ``.metadata`` storage path
with ``..`` was refused by ``ckpt verify`` while ``ckpt verify-roundtrip PATH`` started ranks that
opened the file outside the folder. Four hand-written gates had grown since, with four coverages
and five "no manifest" refusals in four wordings; each refusal below is now written once.

The order is fixed, so a checkpoint with several faults gets the same first line from every caller:

1. the reader (:func:`gtp_format.reader.checkpoint.open_checkpoint`, exit 2 when it cannot open it);
2. the manifest: a present but broken one is refused with the strict parser's line (exit 2; the
   verdict comes from the one parse ``open_checkpoint`` made, :attr:`Manifest.strict_error`); an
   absent one is refused when the caller needs it, with :func:`no_manifest_line`;
3. aliased optimizer keys, for a caller that copies them (reshard, export): the fix is named;
4. ``ckpt verify``'s structural checks (metadata and ``stat`` only, no data file), run once: for a
   copy, a missing byte (a hole, a chunk without storage, a data file that is gone or short) is an
   "incomplete checkpoint" (exit 2); any other error is refused with
   :meth:`VerifyResult.failure_line` (exit 1).
"""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gtp_format.check.verify import VerifyResult, verify
from gtp_format.errors import EXIT_CHECK_FAILED, ChunkError, FormatError
from gtp_format.manifest import FileEntry, Manifest, ManifestError
from gtp_format.model import Checkpoint
from gtp_format.names import MANIFEST_FILE

ALIASING = "aliasing"  # verify's check code for aliased keys (gtp_format.check.analysis.aliasing)
NONFINITE = "nonfinite"  # verify's check code for NaN/Inf in the state (gtp_format.check.values)
JUDGE, REFUSE, REPAIR = "judge", "refuse", "repair"  # what the gate does with aliased keys (open_gated)
# The codes of verify's geometry and storage checks (gtp_format.check.verify.check_geometry,
# check_storage): bytes a copy would have to invent, so a copy refuses them as "incomplete" (exit 2).
INCOMPLETE = frozenset({"chunk_rank", "chunk_bounds", "overlap", "hole", "no_storage", "unsafe_path", "out_of_file",
                        "declared_size", "data_file", "byte_overlap"})


@dataclass(frozen=True)
class Gated:
    """What passed the gate: the checkpoint, its strict manifest (None: it has none) and verify's result."""

    ckpt: Checkpoint
    manifest: Manifest | None
    result: VerifyResult | None  # None when the caller asked for no checks


def no_manifest_line(root: Path, needs: str) -> str:
    """The one refusal of a checkpoint without a manifest; ``needs`` says what the caller needs it for."""
    return f"{root} has no {MANIFEST_FILE}, so it is not a gtp_runtime checkpoint: {needs}"


def strict_manifest(ckpt: Checkpoint) -> Manifest | None:
    """The manifest as a strict parse reads it, or None when the folder has none.

    Raises the strict parser's own line (exit 2) when the manifest is present but unusable: its
    header (the lenient read left it out with an error note) or any section.
    """
    if ckpt.manifest is not None:
        return ckpt.manifest.strict()
    broken = next((p for p in ckpt.notes if p.check == "manifest" and p.severity == "error"
                   and p.file == MANIFEST_FILE), None)
    if broken is not None:
        raise ManifestError(broken.message)
    return None


def open_gated(path: os.PathLike[str] | str, *, needs_manifest: str | None = None, aliased: str = JUDGE,
               checks: bool = True, copy: bool = False, cp_size: int | None = None,
               keep_raw_metadata: bool = False, refusal_suffix: str = "", judge_values: bool = True,
               session: Any = None) -> Gated:
    """Open ``path`` and pass it through the gate (see the module docstring for the order).

    ``needs_manifest``: the caller cannot work without the manifest, and this says why (the
    refusal's tail); None accepts a checkpoint without one (export of a megatron-core checkpoint).
    ``aliased``: :data:`JUDGE` leaves aliased keys to verify (an error there refuses, a
    ``possibly_aliased`` warning does not: ``--load``); :data:`REFUSE` also refuses possibly aliased
    keys, naming the repair, before verify (a copy would carry the loss on); :data:`REPAIR` lets
    them through (``migrate-aliased`` repairs them). ``checks=False`` runs no verify step (the
    caller runs :func:`run_checks` later, where it applies). ``copy``: the caller copies the bytes
    (reshard, export), so missing ones are refused as an incomplete checkpoint.
    ``refusal_suffix`` ends verify's line with what the caller would have done. ``judge_values=False``
    leaves NaN/Inf in the state to verify (a writer's read-back: a diverged run's state is saved as it
    is, and ``--load`` and ``verify`` judge it). ``session``: the command's
    (:func:`gtp_format.reader.checkpoint.open_checkpoint`).
    """
    from gtp_format.reader.checkpoint import open_checkpoint

    ckpt = open_checkpoint(path, keep_raw_metadata=keep_raw_metadata, session=session)
    manifest = strict_manifest(ckpt)
    if manifest is None and needs_manifest is not None:
        raise FormatError(no_manifest_line(ckpt.root, needs_manifest))
    if aliased not in (JUDGE, REFUSE, REPAIR):
        raise ValueError(f"aliased={aliased!r}")
    if aliased == REFUSE:
        refuse_aliased(ckpt, cp_size)
    if not checks:
        return Gated(ckpt, manifest, None)
    ignore = frozenset() if judge_values else frozenset({NONFINITE})
    return Gated(ckpt, manifest, run_checks(ckpt, cp_size, aliased == REPAIR, refusal_suffix, copy, ignore))


def refuse_aliased(ckpt: Checkpoint, cp_size: int | None = None) -> None:
    """Refuse (exit 2) folded optimizer keys without ``.cp_rank_{i}``, naming the repair."""
    from gtp_format.check.analysis import aliasing, classify_all, topology_view

    report = aliasing(ckpt, classify_all(ckpt), topology_view(ckpt.manifest, cp_size, ckpt=ckpt))
    if report.status in ("aliased", "possibly_aliased", "inconsistent"):
        first = report.aliased[0].key if report.aliased else "-"
        raise FormatError(f"{ckpt.root}: {report.message} (e.g. {first}); run `ckpt migrate-aliased` on it first, "
                          "then use the migrated copy")


def run_checks(ckpt: Checkpoint, cp_size: int | None = None, allow_aliased: bool = False,
               refusal_suffix: str = "", copy: bool = False, ignore: frozenset[str] = frozenset()) -> VerifyResult:
    """``ckpt verify``'s structural checks; the first error refuses with verify's line (exit 1).

    ``copy``: missing bytes first refuse as an incomplete checkpoint (exit 2, see the module docstring).
    """
    result = verify(ckpt, cp_size=cp_size)
    if copy:
        missing = [p for p in result.problems if p.severity == "error" and p.check in INCOMPLETE]
        if missing:
            e = missing[0]
            raise FormatError(f"{ckpt.root}: incomplete checkpoint ({len(missing)} problems); first: "
                              f"{e.key or e.file or '-'}: {e.message}; run `ckpt verify` on it and copy a complete one")
    judged = result
    skip = ignore | ({ALIASING} if allow_aliased else set())
    if skip:
        judged = VerifyResult([p for p in result.problems if p.check not in skip], result.checks, result.stats)
    line = judged.failure_line(ckpt.root)
    if line is not None:
        raise FormatError(line + refusal_suffix, EXIT_CHECK_FAILED)
    return result


def check_written(folder: Path, entries: Mapping[str, FileEntry]) -> str | None:
    """The gate's part that reads every byte of some of an output's files: each of ``entries`` (relative to
    ``folder``) a regular file inside it, not sparse, of its entry's size and checksums, read in full. The
    first failure's line, naming the file, or None.

    Why: :func:`open_gated` takes from a data file only its size, a safetensors header and the few chunks of
    the bucket-numel vectors (a torch_dist file replaced by a sparse file of its size passes it); the rest is
    vouched for by the entries the writer computed from the bytes as it wrote them. Where the files are kept
    somewhere before they are published (a bucket output's local staging, uploaded only at the commit), this
    proves the bytes about to go out are still those bytes; it is split over the ranks of a torchrun job
    (``ckpt_tool/copying/ranked.py``), each checking files of its own node's staging.
    """
    from gtp_format.hashing import file_digests
    from gtp_format.reader.storage import open_regular

    for rel, entry in sorted(entries.items()):
        try:
            with open_regular(folder, rel) as f:
                sparse = f.sparse_message(rel)  # type: ignore[attr-defined]
                if sparse is not None:
                    return sparse
                size = f.size  # type: ignore[attr-defined]
                if size != entry.size:
                    return f"{rel} is {size} bytes but was written as {entry.size}"
                algos = sorted(entry.checksums)
                have = file_digests(f, algos)
        except ChunkError as e:
            return e.message
        for a in algos:
            if have[a] != entry.checksums[a].lower():
                return f"{rel}: {a} is {have[a]} but it was written as {entry.checksums[a].lower()}"
    return None


def stand_in(folder: Path, rel: str, size: int, parts: Mapping[int, bytes]) -> None:
    """Make ``rel`` in ``folder`` a file of ``size`` bytes holding ``parts`` (offset -> bytes) and a hole
    everywhere else: a data file that lives on another node, for :func:`open_gated` on this one.

    Why that suffices: what the gate takes from a data file is its size, a safetensors file's header and the
    chunks of the bucket-numel vectors (:func:`gate_reads`); a hole where it would read anything else reads as
    zeros, which no torch.save blob or safetensors header decodes as, so a range left out is a refusal, never a
    pass. The bytes come from the node that holds the file and read it in full against its entry
    (:func:`check_written`)."""
    path = folder / rel
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
    try:
        os.ftruncate(fd, size)
        for offset, raw in sorted(parts.items()):
            if offset < 0 or offset + len(raw) > size:
                raise FormatError(f"{rel}: bytes {offset}-{offset + len(raw)} lie outside its {size} bytes")
            os.pwrite(fd, raw, offset)
    finally:
        os.close(fd)


def gate_reads(folder: Path, files: Collection[str], session: Any = None) -> dict[str, list[tuple[int, int]]]:
    """The byte ranges (offset, length) of ``files`` that :func:`open_gated` decodes beyond their sizes and
    safetensors headers: the chunks of the optimizer's bucket-numel vectors (``ckpt verify``'s bucket check
    decodes them: 3,154 bytes from 2 of the 8 files of a fixture's torch_dist copy). ``folder`` must already
    hold every file, those of ``files`` as stand-ins with their headers (:func:`stand_in`)."""
    from gtp_format.check.analysis import BUCKET_NUMEL, classify_all

    ckpt = open_gated(folder, checks=False, session=session).ckpt
    want = set(files)
    out: dict[str, list[tuple[int, int]]] = {}
    for key, cls in classify_all(ckpt).items():
        if cls.category != BUCKET_NUMEL:
            continue
        for c in ckpt.entries[key].chunks:
            if c.storage is not None and c.storage.file in want:
                out.setdefault(c.storage.file, []).append((int(c.storage.offset), int(c.storage.length)))
    return {f: sorted(set(r)) for f, r in sorted(out.items())}
