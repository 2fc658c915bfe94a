"""The migrated manifest: SRC's typed manifest, plus what the migration did, in prose and as a record.

``notes`` gets one sentence a person can read (what was renamed, rebuilt and reset, and from which
step the reset moments restart); ``migration`` the same as data (docs/checkpoint-format.md lists
its fields). ``files`` gets the size and checksum of the two files the migration wrote; every other
entry still describes a hard-linked, unchanged file. Built on :class:`gtp_format.manifest.Manifest`,
never on the JSON dict, and written by its one writer.
"""

from __future__ import annotations

import dataclasses
import datetime
from pathlib import Path
from typing import Any

from ckpt_tool.migrate.plan import MIGRATION_VERSION, RESET, TOOL, Plan, lost_dict
from gtp_format.hashing import HASHERS, file_digests
from gtp_format.manifest import FileEntry, Manifest
from gtp_format.names import CHUNK_RECORDS_FILE, DCP_METADATA_FILE


def checksums(path: Path, algorithms: list[str], streamed: tuple[str, int] | None = None) -> dict[str, str]:
    """The file's digests under ``algorithms``; ``streamed`` is a CRC already computed while writing it."""
    out = {}
    rest = []
    for a in algorithms:
        if streamed is not None and a == streamed[0]:
            out[a] = f"{streamed[1]:08x}"
        elif a in HASHERS:
            rest.append(a)
    if rest:
        with open(path, "rb") as f:
            out.update(file_digests(f, rest))
    return out


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def migrated_manifest(plan: Plan, out: Path, new_data_file: str | None, new_crc: tuple[str, int] | None) -> Manifest:
    """SRC's manifest for the folder ``out``, whose ``.metadata`` (and new data file, if any) are written."""
    src = plan.manifest
    assert src is not None
    files = {k: v for k, v in (src.files or {}).items() if k != CHUNK_RECORDS_FILE}  # the output's own, if any
    for name in [DCP_METADATA_FILE] + ([new_data_file] if new_data_file else []):
        path = out / name
        crc = new_crc if name == new_data_file else None
        files[name] = FileEntry(size=path.stat().st_size, checksums=checksums(path, [src.hash_algorithm], crc))
    return dataclasses.replace(src, files=files, notes=[*src.notes, _note(plan)],
                               extra={**src.extra, "migration": _record(plan, new_data_file)})


def _note(plan: Plan) -> str:
    assert plan.manifest is not None
    c = plan.counts()
    moments = [x for x in plan.lost if x.action == RESET]
    step = plan.manifest.optimizer.step if plan.manifest.optimizer else "?"
    if not plan.lossy:
        how = "bit-exact: the weights are fp32"
    else:
        dtypes = sorted({plan.weight_dtypes[n] for n in plan.lossy})
        how = f"LOSSY: rounded, rebuilt from {'/'.join(dtypes)} weights of {len(plan.lossy)} params"
    return (f"{TOOL} on {now()} from {plan.source.folder}: {c['aliased_keys']} aliased folded optimizer keys split "
            f"into {c['new_keys']} .cp_rank_{{i}} keys ({c['kept_chunks']} surviving chunks renamed to their writer's "
            f"CP rank); {c['lost_chunks']} CP-peer chunks ({c['lost_elements']} elements) had been lost at save: "
            f"{c['rebuilt_param_chunks']} fp32 master chunks rebuilt from the model weights ({how}), "
            f"{len(moments)} Adam moment chunks (exp_avg, exp_avg_sq) reset to zero, so those elements restart "
            f"their moments at optimizer step {step}; details under 'migration'")


def _record(plan: Plan, new_data_file: str | None) -> dict[str, Any]:
    return {
        "tool": TOOL,
        "version": MIGRATION_VERSION,
        "time": now(),
        "source": str(plan.source.folder),
        "topology": plan.par.describe() if plan.par else None,
        "counts": plan.counts(),
        "param_rebuild": "lossy" if plan.lossy else "exact",
        "lossy_weights": {n: plan.weight_dtypes[n] for n in plan.lossy},
        "new_data_file": new_data_file,
        "renamed_keys": {k.source_key: k.new_keys for k in plan.keys},
        "kept_chunks": [{"key": x.new_key, "offsets": list(x.offsets), "sizes": list(x.sizes), "file": x.file,
                         "rank": x.rank} for x in plan.kept],
        "lost_chunks": [lost_dict(x) for x in plan.lost],
    }
