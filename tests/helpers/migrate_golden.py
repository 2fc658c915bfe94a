"""A version-independent summary of a migrated checkpoint, to compare migrate's output across code changes.

``ckpt migrate-aliased`` must write the same bytes before and after a refactor. Three things in
its output change from run to run or from Python to Python, and nothing else may:

- ``.metadata`` holds ``storage_meta.checkpoint_id`` (the destination path, pickled as
  ``pathlib.PosixPath``, whose module is ``pathlib._local`` from 3.13) and a random ``save_id``;
- the manifest records the time, the source path, and the size and checksum of that ``.metadata``.

So ``.metadata`` is compared as its decoded records (through the allow-listing unpickler), minus
those two fields; the manifest as JSON, minus those fields; every other file by its bytes, and
every chunk by the hash of its stored bytes. ``tests/cli/golden/migrate_aliased.json`` was
recorded from the output of the former ``migrate_core.py`` of ``ckpt_tool`` (since split into
``ckpt_tool/migrate/``) as of commits 57bff73 and b432bb3 (identical output), before migrate
became a package; 101e36d wrote the same bytes too. The chunk
records (``gtp_chunks.json`` and the manifest's ``chunk_records`` section and file entry), which
migrate writes since issue 26, are left out of the summary: everything else must stay as recorded,
and ``tests/cli/test_migrate.py`` checks the records against the chunks' bytes.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

from gtp_format.dtypes import DType
from gtp_format.reader.checkpoint import open_checkpoint
from gtp_format.reader.safe_pickle import EnumRecord, Record, TorchConstant, load_metadata_pickle

VOLATILE_STORAGE_META = ("checkpoint_id", "save_id")


def _plain(value: Any) -> Any:
    """Records and torch stand-ins as JSON values; dict keys that are records become sorted pairs."""
    if isinstance(value, EnumRecord):
        return {"enum": value.kind, "args": _plain(list(value.args))}
    if isinstance(value, Record):
        state = {k: v for k, v in value.state.items()
                 if not (value.kind == "StorageMeta" and k in VOLATILE_STORAGE_META)}
        return {"record": value.kind, **{k: _plain(v) for k, v in sorted(state.items())}}
    if isinstance(value, (DType, TorchConstant)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        pairs = [[_plain(k), _plain(v)] for k, v in value.items()]
        return sorted(pairs, key=lambda kv: json.dumps(kv, sort_keys=True))
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    raise TypeError(f"unexpected {type(value).__name__} in .metadata")


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def summarize(folder: Path) -> dict[str, Any]:
    """What a migration wrote into the iteration folder ``folder``, free of times and paths."""
    raw = (folder / ".metadata").read_bytes()
    metadata = _plain(load_metadata_pickle(raw, str(folder / ".metadata")))
    manifest = json.loads((folder / "gtp_manifest.json").read_text())
    record = manifest["migration"]
    record.pop("time")
    source = record.pop("source")
    manifest["files"].pop(".metadata")
    manifest["files"].pop("gtp_chunks.json", None)
    manifest.pop("chunk_records", None)
    notes = manifest.pop("notes")
    notes[-1] = re.sub(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", "<time>", notes[-1].replace(source, "<source>"))
    ckpt = open_checkpoint(folder)
    chunks = {}
    for key, entry in sorted(ckpt.entries.items()):
        rows = []
        for c in entry.chunks:
            s = c.storage
            with open(folder / s.file, "rb") as f:
                f.seek(s.offset)
                data = f.read(s.length)
            rows.append(f"{list(c.offsets)} {list(c.sizes)} {s.file}@{s.offset}+{s.length} {_digest(data)[:16]}")
        chunks[key] = rows
    files = {p.name: _digest(p.read_bytes())[:16] for p in sorted(folder.iterdir())
             if p.name not in (".metadata", "gtp_manifest.json", "gtp_chunks.json")}
    return {
        "metadata_records": _digest(json.dumps(metadata, sort_keys=True).encode()),
        "migration": manifest.pop("migration"),
        # lineage came after the golden and names a run id made per output (tests/runtime/test_lineage.py)
        "lineage_parent": (manifest.pop("lineage", None) or {}).get("parent", {}).get("via"),
        "manifest_rest": _digest(json.dumps(manifest, sort_keys=True).encode()),
        "new_file_entry": manifest["files"].get(record["new_data_file"]),
        "notes": notes,
        "files": files,
        "keys": sorted(ckpt.entries),
        "chunks": chunks,
    }
