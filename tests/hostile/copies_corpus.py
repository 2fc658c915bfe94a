"""Crafted sources for the copies (``reshard``, ``export --to hf|hf --optimizer|fully_reshardable|torch``).

Issue 22, class 6: each input is one that a copy used to turn into wrong output with exit 0
(damaged data laundered under fresh checksums, a layout that mislabels parameters, Muon momentum
named an Adam moment, a dtype relabelled, an iteration no marker can name) or, for ``--to torch``,
into memory its files do not store. Built at test time from the repository's fixtures, like
:mod:`make_corpus` (whose case folders and :class:`make_corpus.Ctx` these reuse). Every case
lists the copy commands with a DST outside the corpus; the test requires a refusal and nothing
at DST.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

from damage import flip
from make_corpus import FIXTURE_BASES, SECRET, Case, Ctx

COPY_TARGETS = (["--to", "hf"], ["--to", "hf", "--optimizer"], ["--to", "fully_reshardable"], ["--to", "torch"])
RESHARD_ARGS = {"dcp": ["--dp", "1"], "st": ["--dp", "2"], "megatron": ["--dp", "1"]}
Builder = Callable[[Ctx], None]
SPECS: list[tuple[str, str, Builder, tuple[str, ...]]] = []  # name, base, builder, words the line must hold


def copy_case(base: str, *words: str) -> Callable[[Builder], Builder]:
    def register(fn: Builder) -> Builder:
        SPECS.append((fn.__name__, base, fn, words))
        return fn

    return register


def _manifest(c: Ctx) -> dict:
    return json.loads((c.it / "gtp_manifest.json").read_text())


def _write_manifest(c: Ctx, doc: dict) -> None:
    (c.it / "gtp_manifest.json").write_text(json.dumps(doc))


def flip_element(it: Path, key: str, index: int) -> Path:
    """Flip one bit of element ``index`` (flat, 1-D keys) of ``key`` where it is stored; the file flipped."""
    from gtp_format.reader.blob import parse_blob
    from gtp_format.reader.checkpoint import open_checkpoint
    from gtp_format.reader.chunks import chunk_bytes
    from gtp_format.reader.zip_blob import ViewReader

    ckpt = open_checkpoint(it)
    entry = ckpt.entries[key]
    chunk = next(ch for ch in entry.chunks if ch.offsets[0] <= index < ch.offsets[0] + ch.sizes[0])
    ref = chunk.storage
    at = ref.offset + (index - chunk.offsets[0]) * entry.dtype.itemsize
    if ckpt.encoding != "raw":
        layout = parse_blob(ViewReader(memoryview(bytes(chunk_bytes(ckpt, entry, chunk)))))
        at += layout.payload_offset + layout.storage_offset * entry.dtype.itemsize
    flip(it / ref.file, at, 0x10)
    return it / ref.file


def _largest_tensor(it: Path) -> tuple[str, int]:
    from gtp_format.model import TENSOR
    from gtp_format.reader.checkpoint import open_checkpoint

    ckpt = open_checkpoint(it)
    e, ch = max(((e, ch) for e in ckpt.entries.values() if e.kind == TENSOR and len(e.shape or ()) == 1
                 for ch in e.chunks), key=lambda ec: ec[1].sizes[0])
    return e.key, ch.offsets[0] + ch.sizes[0] // 2


# -- damaged data: a copy must check what it reads ------------------------------------------------

@copy_case("dcp", "__", "crc32c")
def payload_flip_checksummed(c: Ctx) -> None:
    """One bit of an fp32 master weight: the manifest's CRC-32C of the file fails."""
    flip_element(c.it, *_largest_tensor(c.it))


@copy_case("st", ".safetensors", "crc32c")
def payload_flip_safetensors(c: Ctx) -> None:
    flip_element(c.it, *_largest_tensor(c.it))


@copy_case("dcp", "CRC-32")
def payload_flip_no_file_checksum(c: Ctx) -> None:
    """The manifest lists the file without a checksum: the zip record CRC-32 is what is left."""
    key, index = _largest_tensor(c.it)
    path = flip_element(c.it, key, index)
    doc = _manifest(c)
    doc["files"][path.name] = {"size": path.stat().st_size}
    _write_manifest(c, doc)


@copy_case("megatron", "CRC-32")
def payload_flip_megatron(c: Ctx) -> None:
    """A genuine megatron-core checkpoint has no manifest checksums: only the zip CRC-32 catches it."""
    flip_element(c.it, *_largest_tensor(c.it))


@copy_case("dcp", "crc32c")
def replica_flip(c: Ctx) -> None:
    """A bit of a replica no copy reads (a norm's second DP-group copy): joined from the gaps, it fails too."""
    doc = _manifest(c)
    buf = next(b for b in doc["buffers"] if not b["excludes_cp"])
    bucket = buf["buckets"][0]
    p = next(p for p in bucket["params"] if "layernorm" in p["name"])
    from gtp_format.names import optimizer_key

    key = optimizer_key(1, buf["gbuf_idx"], buf["dtype"], bucket["bucket_idx"], "param", None)
    flip_element(c.it, key, p["start"])


# -- a manifest that mislabels: the canonical layout, the owners, the dtypes -------------------------

def _bucket_pair(doc: dict) -> tuple[dict, dict]:
    params = doc["buffers"][0]["buckets"][0]["params"]
    a = next(p for p in params if p["name"].endswith("linear_fc1.weight"))
    size = a["end"] - a["start"]
    b = next(p for p in params if p["name"].endswith("linear_proj.weight") and p["end"] - p["start"] == size)
    return a, b


@copy_case("dcp", "overlap")
def overlapping_slices(c: Ctx) -> None:
    """Two params on one slice: one's master weights would be written under the other's name."""
    doc = _manifest(c)
    a, b = _bucket_pair(doc)
    b["start"], b["end"] = a["start"], a["end"]
    _write_manifest(c, doc)


@copy_case("dcp", "bucket layout")
def swapped_slices(c: Ctx) -> None:
    """No overlap, but two equal-sized params trade places: only the canonical layout tells."""
    doc = _manifest(c)
    a, b = _bucket_pair(doc)
    (a["start"], a["end"]), (b["start"], b["end"]) = (b["start"], b["end"]), (a["start"], a["end"])
    _write_manifest(c, doc)


@copy_case("dcp", "muon")
def muon_owner_in_adam_manifest(c: Ctx) -> None:
    """A Muon run's manifest with its type edited to adamw: momentum would be exported as exp_avg."""
    doc = _manifest(c)
    names = [p["name"] for b in doc["buffers"] for k in b["buckets"] for p in k["params"]]
    doc["format_version"] = 2
    doc["optimizer"]["param_optimizers"] = {n: "muon" if n.endswith("linear_fc1.weight") else "adamw" for n in names}
    _write_manifest(c, doc)


@copy_case("st", "bucket layout")
def param_dtype_relabelled(c: Ctx) -> None:
    """bf16 weights declared float16 (both 2-byte): a copy would relabel every weight's bits."""
    doc = _manifest(c)
    doc["param_dtype"] = "torch.float16"
    _write_manifest(c, doc)


@copy_case("dcp", "bucket layout")
def param_named_metadata(c: Ctx) -> None:
    """A param called ``__metadata__`` (safetensors' reserved header key), in the layout and the metadata."""
    md = c.metadata()
    doc = _manifest(c)
    old = "decoder.final_layernorm.weight"
    for b in doc["buffers"]:
        for k in b["buckets"]:
            for p in k["params"]:
                if p["name"] == old:
                    p["name"] = "__metadata__"
    from make_corpus import _rename_key

    _rename_key(md, old, "__metadata__")
    c.write_metadata(md)
    _write_manifest(c, doc)


@copy_case("dcp", "iteration")
def iteration_no_marker_names(c: Ctx) -> None:
    """An iteration of 13 digits: reshard wrote a latest marker ckpt then refused to read."""
    doc = _manifest(c)
    doc["iteration"] = 10**12
    _write_manifest(c, doc)


# -- sizes that do not match what is stored --------------------------------------------------------

@copy_case("dcp")
def sparse_data_files(c: Ctx) -> None:
    """Every data file replaced by a hole of its size: ``--to torch`` must not budget from ``st_size``."""
    for path in c.it.glob("*.distcp"):
        size = path.stat().st_size
        with open(path, "r+b") as f:
            f.truncate(0)
            f.truncate(size)


def build_copies(root: Path, dst_root: Path) -> list[Case]:
    """Write every case under ``root``; DSTs go under ``dst_root`` (outside the corpus, left empty)."""
    out = []
    for name, base, fn, words in SPECS:
        folder = root / name
        src = FIXTURE_BASES[base]
        it = folder / "run" / src.name
        shutil.copytree(src, it, symlinks=True)
        (folder / "run" / "latest_checkpointed_iteration.txt").write_text(src.name.removeprefix("iter_").lstrip("0"))
        outside = folder / "outside"
        outside.mkdir()
        (outside / "secret.json").write_text(json.dumps({"secret": SECRET}))
        fn(Ctx(folder, it, outside, src))
        dst = dst_root / name
        dst.mkdir(parents=True)
        cmds = [["reshard", str(folder / "run"), str(dst / "reshard"), *RESHARD_ARGS[base]]]
        cmds += [["export", str(folder / "run"), str(dst / f"export{i}"), *t] for i, t in enumerate(COPY_TARGETS)]
        out.append(Case(name, "copies", "run", cmds, False, dir=str(folder), notes={"dst": str(dst),
                                                                                   "words": "|".join(words)}))
    return out
