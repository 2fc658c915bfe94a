"""Round 3 (issue 22) cases: declared counts over what is stored, sparse files behind a budget, byte
objects whose ``data.pkl`` floods ``torch.load``, and hostile ``--data-path`` datasets.

Checkpoint cases register like :mod:`hostile_files` (builders take :class:`make_corpus.Ctx`);
dataset cases (:data:`DATA_SPECS`) build an indexed dataset or a flat ``.bin`` in the case's
``run/`` folder and are run as ``python -m gtp_runtime.train --data-path`` by test_hostile.py.
Sparse files keep the corpus small on disk: holes cost nothing to make.
"""

from __future__ import annotations

import io
import json
import pickle
import struct
import sys
import zipfile
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))  # also when run as a script

from sparse_files import grow_sparse  # noqa: E402

SPECS: list[tuple[str, str, str, list[list[str]], bool, Callable[[Any], None], str]] = []
DATA_SPECS: list[tuple[str, str, Callable[[Path], str]]] = []
VERIFY = [["verify", "{t}"]]
INSPECT_PARAMS = [["inspect", "--params", "{t}"]]
SHOW_DIFF = [["show", "{t}", "{key}"], ["diff", "{t}", "{t}"]]
INDEX_HEADER = b"MMIDIDX\x00\x00"


def spec(klass: str, commands: list[list[str]], load: bool, base: str = "dcp", target: str = "it") -> Callable:
    def register(fn: Callable[[Any], None]) -> Callable[[Any], None]:
        SPECS.append((fn.__name__, klass, base, commands, load, fn, target))
        return fn

    return register


def data_spec(klass: str) -> Callable:
    def register(fn: Callable[[Path], str]) -> Callable[[Path], str]:
        DATA_SPECS.append((fn.__name__, klass, fn))
        return fn

    return register


def specs() -> list[tuple[str, str, str, list[list[str]], bool, Callable[[Any], None], str]]:
    return list(SPECS)


def _holes(path: Path, extra: int) -> int:
    """Append ``extra`` bytes that nobody wrote (a sparse tail); returns where they start."""
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size + extra)
    return size


def _edit_manifest(c: Any, fn: Callable[[dict[str, Any]], None]) -> None:
    path = c.it / "gtp_manifest.json"
    doc = json.loads(path.read_text())
    fn(doc)
    path.write_text(json.dumps(doc))


# -- class 3: declared counts the metadata does not store ------------------------------------------

@spec("time", VERIFY + INSPECT_PARAMS, True)
def topology_world_of_a_billion(c: Any) -> None:
    def grow(doc: dict[str, Any]) -> None:
        doc["topology"].update(dp=10 ** 9, world_size=10 ** 9 * 4, expert_dp=10 ** 9 * 4)

    _edit_manifest(c, grow)


@spec("time", VERIFY + INSPECT_PARAMS, True)
def topology_cp_of_a_million(c: Any) -> None:
    _edit_manifest(c, lambda doc: doc["topology"].update(cp=10 ** 6, world_size=8 * 10 ** 6 // 2,
                                                         expert_dp=8 * 10 ** 6 // 2))


@spec("memory", VERIFY + INSPECT_PARAMS, True)
def layout_of_20000_buckets(c: Any) -> None:
    def many(doc: dict[str, Any]) -> None:
        buf = doc["buffers"][0]
        buf["buckets"] = [{**buf["buckets"][-1], "bucket_idx": i, "params": []} for i in range(20_000)]

    _edit_manifest(c, many)


# -- class 4: budgets behind sparse data files -----------------------------------------------------

@spec("memory", VERIFY + [["inspect", "--format", "json", "{t}"]], True)
def metadata_over_limit_behind_sparse_data(c: Any) -> None:
    raw = (c.it / ".metadata").read_bytes()
    (c.it / ".metadata").write_bytes(raw + b"\0" * (8 << 20))  # 8 MiB: under a limit taken from st_size
    c.drop_checksum(".metadata")
    _holes(c.it / "__0_0.distcp", 16 << 20)


@spec("memory", SHOW_DIFF, False)
def region_backed_by_holes(c: Any) -> None:
    import torch

    md = c.metadata()
    key = next(k for k, v in md.state_dict_metadata.items() if len(getattr(v, "size", ())) == 2)
    tsm = md.state_dict_metadata[key]
    n = 450 << 20  # a 450 MB uint8 region (over the default --max-bytes; the variant below raises it)
    tsm.properties = replace(tsm.properties, dtype=torch.uint8)
    tsm.size = type(tsm.size)([n, 1])
    tsm.chunks[:] = [replace(tsm.chunks[0], offsets=type(tsm.size)([0, 0]), sizes=type(tsm.size)([n, 1]))]
    idx = next(i for i in md.storage_data if i.fqn == key)
    template = md.storage_data[idx]
    md.storage_data = {i: s for i, s in md.storage_data.items() if i.fqn != key}
    at = _holes(c.it / "__0_0.distcp", n + (1 << 20))
    md.storage_data[idx] = replace(template, relative_path="__0_0.distcp", offset=at, length=n + 4096)
    c.write_metadata(md)
    c.drop_checksum("__0_0.distcp")
    (c.case / "key.txt").write_text(key)


@spec("time", [["verify", "--data", "{t}"]], False)  # --load reads only its chunks, never the holes
def data_file_with_16_tib_of_holes(c: Any) -> None:
    """The manifest's size edited to match: hashing the holes would take hours."""
    size = grow_sparse(c.it / "__0_0.distcp", 16 << 40)
    _edit_manifest(c, lambda doc: doc["files"]["__0_0.distcp"].update(size=size))


SHOW_BIG = [["show", "--max-bytes", str(1 << 30), "{t}", "{key}"]]
SPECS.append(("region_backed_by_holes_max_bytes", "memory", "dcp", SHOW_BIG, False, region_backed_by_holes, "it"))


def _megatron_object(c: Any) -> tuple[Any, Any, Any]:
    md = c.metadata()
    i, s = next((i, s) for i, s in md.storage_data.items() if i.offset is None)  # a byte object
    return md, i, s


@spec("memory", [["show", "{t}", "{key}"]], False, base="megatron")
def byte_object_in_600_mb_of_holes(c: Any) -> None:
    md, i, s = _megatron_object(c)
    at = _holes(c.it / s.relative_path, 600 << 20)
    md.storage_data[i] = replace(s, offset=at, length=600 << 20)
    c.write_metadata(md)
    (c.case / "key.txt").write_text(i.fqn)


def _flood_blob(inner_pickle: bytes) -> bytes:
    """DCP's way of storing a ShardedObject: torch.save of a BytesIO holding torch.save's zip."""
    import torch

    inner = io.BytesIO()
    with zipfile.ZipFile(inner, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", inner_pickle)
        z.writestr("archive/version", b"3\n")
    out = io.BytesIO()
    torch.save(io.BytesIO(inner.getvalue()), out)
    return out.getvalue()


def _replace_object(c: Any, blob: bytes) -> None:
    md, i, s = _megatron_object(c)
    path = c.it / s.relative_path
    at = path.stat().st_size
    with open(path, "ab") as f:
        f.write(blob)
    md.storage_data[i] = replace(s, offset=at, length=len(blob))
    c.write_metadata(md)
    (c.case / "key.txt").write_text(i.fqn)


@spec("memory", [["show", "{t}", "{key}"]], False, base="megatron")
def byte_object_5_mb_data_pkl(c: Any) -> None:
    """Round 1's residual: a 5 MB data.pkl of small lists, through torch.load(weights_only=True).
    (``diff`` of the folder with itself compares the object's bytes, equal, and rightly exits 0.)"""
    _replace_object(c, _flood_blob(pickle.dumps([[i] for i in range(600_000)], protocol=2)))


@spec("memory", [["show", "{t}", "{key}"]], False, base="megatron")
def byte_object_container_flood_under_1_mb(c: Any) -> None:
    _replace_object(c, _flood_blob(b"\x80\x02(" + b"]" * 900_000 + b"l."))


# -- class 3: datasets given to --data-path --------------------------------------------------------

def _index(prefix: Path, lengths: list[int], pointers: list[int], docs: list[int], code: int = 8) -> None:
    import numpy as np

    head = INDEX_HEADER + struct.pack("<QBQQ", 1, code, len(lengths), len(docs))
    body = np.array(lengths, np.int32).tobytes() + np.array(pointers, np.int64).tobytes()
    prefix.with_suffix(".idx").write_bytes(head + body + np.array(docs, np.int64).tobytes())


@data_spec("memory")
def idx_sparse_300m_sequences(run: Path) -> str:
    n = 300_000_000
    with open(run / "data.idx", "wb") as f:
        f.write(INDEX_HEADER + struct.pack("<QBQQ", 1, 8, n, 2))
        f.truncate(9 + 8 + 1 + 8 + 8 + 12 * n + 16)
    (run / "data.bin").write_bytes(b"\1\0" * 4096)
    return str(run / "data")


@data_spec("memory")
def flat_bin_sparse_16_tib(run: Path) -> str:
    path = run / "tokens.bin"
    grow_sparse(path, 16 << 40)
    return str(path)


@data_spec("memory")
def idx_overlapping_sequences(run: Path) -> str:
    import numpy as np

    n = 200_000  # each names the whole 64 KiB .bin: one epoch would be 200,000 times the file
    (run / "data.bin").write_bytes((np.arange(32768) % 200).astype(np.uint16).tobytes())
    _index(run / "data", [32768] * n, [0] * n, [0, n])
    return str(run / "data")


@data_spec("traceback")
def idx_documents_past_sequences(run: Path) -> str:
    import numpy as np

    (run / "data.bin").write_bytes((np.arange(1024) % 200).astype(np.uint16).tobytes())
    _index(run / "data", [512, 512], [0, 1024], [0, 1, 7])
    return str(run / "data")
