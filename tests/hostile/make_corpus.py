"""Generate the hostile corpus: crafted checkpoints over every class of issue 13, from genuine ones.

Usage (the tests call :func:`build_corpus`; this is for looking at the inputs by hand)::

    python tests/hostile/make_corpus.py OUT_DIR

Each case is a folder ``OUT/<name>/`` holding ``run/`` (a run directory: the checkpoint folder
``iter_0000002`` and the latest marker) and ``outside/`` (files the reader must never open, with a
secret string in them). Inputs are small and made at test time from the repository's fixtures;
nothing binary is committed. A case lists the ``ckpt`` command lines to run on it and whether
``python -m gtp_runtime.train --load`` applies (the runtime reads the same folder layout).
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import hostile_bounds  # noqa: E402
import hostile_files  # noqa: E402
from hostile_pickles import build_pickles  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
FIXTURE_BASES = {
    "dcp": REPO / "fixtures/gtp/fold_cp2_g2_dp2/iter_0000002",
    "megatron": REPO / "fixtures/megatron/tp2_dp2_dp_reshardable/iter_0000002",
    "st": REPO / "fixtures/compat/bf16_cp2_g2_fold_st/iter_0000002",
}
SECRET = "HOSTILE-SECRET-5e1f"


@dataclass
class Case:
    name: str
    klass: str
    target: str  # path given to the commands, relative to the case folder
    commands: list[list[str]]  # ckpt argv; "{t}" is the target's absolute path
    load: bool  # also run the runtime's --load on it
    dir: str = ""
    notes: dict[str, str] = field(default_factory=dict)


@dataclass
class Ctx:
    """One case being built: its folder, the copied checkpoint, and where secrets live."""

    case: Path
    it: Path
    outside: Path
    base: Path

    @property
    def run(self) -> Path:
        return self.it.parent

    def metadata(self) -> object:
        return pickle.loads((self.it / ".metadata").read_bytes())  # our own fixture copy: trusted

    def write_metadata(self, md: object) -> None:
        (self.it / ".metadata").write_bytes(pickle.dumps(md))
        self.drop_checksum(".metadata")

    def drop_checksum(self, rel: str) -> None:
        """Forget the manifest's checksum of an edited file, so the edit itself is what the reader sees."""
        path = self.it / "gtp_manifest.json"
        if path.exists():
            doc = json.loads(path.read_text())
            doc.get("files", {}).pop(rel, None)
            path.write_text(json.dumps(doc))


VERIFY = [["verify", "{t}"]]
VERIFY_DATA = [["verify", "--data", "{t}"]]
INSPECT_JSON = [["inspect", "--format", "json", "{t}"]]
VERIFY_JSON = [["verify", "--format", "json", "{t}"]]
Builder = Callable[[Ctx], None]
CASES: list[tuple[str, str, str, list[list[str]], bool, Builder, str]] = []


def case(klass: str, commands: list[list[str]], load: bool, base: str = "dcp", target: str = "it") -> Callable:
    def register(fn: Builder) -> Builder:
        CASES.append((fn.__name__, klass, base, commands, load, fn, target))
        return fn

    return register


def _storage_items(md: object) -> list:
    return list(md.storage_data.items())  # type: ignore[attr-defined]


def _rename_key(md: object, old: str, new: str, storage: bool = True) -> None:
    sdm = md.state_dict_metadata  # type: ignore[attr-defined]
    sdm[new] = sdm.pop(old)
    if storage:
        md.storage_data = {(replace(i, fqn=new) if i.fqn == old else i): s  # type: ignore[attr-defined]
                           for i, s in _storage_items(md)}


def _first_2d(md: object) -> str:
    return next(k for k, v in md.state_dict_metadata.items() if len(getattr(v, "size", ())) == 2)  # type: ignore


# -- terminal injection and odd names (each also breaks something, so every command must fail) ----

@case("terminal", VERIFY + VERIFY_JSON, True)
def key_with_escape_sequences(c: Ctx) -> None:
    md = c.metadata()
    key = _first_2d(md)
    _rename_key(md, key, "\x1b]0;pwned\x07\x1b[2K\rall checks OK\x1b[8m")
    md.state_dict_metadata["\x1b]0;pwned\x07\x1b[2K\rall checks OK\x1b[8m"].chunks.pop()  # a hole too
    c.write_metadata(md)


@case("terminal", VERIFY, True)
def key_with_bidi_override(c: Ctx) -> None:
    md = c.metadata()
    _rename_key(md, _first_2d(md), "layer\u202ethgiew.\u2066x\u2069", storage=False)  # and no storage for it
    c.write_metadata(md)


@case("traceback", VERIFY + VERIFY_JSON, True)
def key_with_lone_surrogate(c: Ctx) -> None:
    md = c.metadata()
    key = _first_2d(md)
    _rename_key(md, key, "w\ud800eight")
    md.state_dict_metadata["w\ud800eight"].chunks.pop()
    c.write_metadata(md)


@case("terminal", VERIFY_DATA, True)
def storage_path_with_controls(c: Ctx) -> None:
    md = c.metadata()
    i, s = _storage_items(md)[0]
    md.storage_data[i] = replace(s, relative_path="\x1b]0;x\x07\x1b[31m__0_0.distcp")
    c.write_metadata(md)


# -- paths out of the folder -----------------------------------------------------------------------

@case("outside", VERIFY_DATA, True)
def storage_absolute_path(c: Ctx) -> None:
    md = c.metadata()
    i, s = _storage_items(md)[0]
    md.storage_data[i] = replace(s, relative_path=str(c.outside / "secret.bin"))
    c.write_metadata(md)


@case("outside", VERIFY_DATA, True)
def storage_dotdot_path(c: Ctx) -> None:
    md = c.metadata()
    for i, s in _storage_items(md)[:3]:
        md.storage_data[i] = replace(s, relative_path="../../outside/secret.bin")
    c.write_metadata(md)


# -- geometry that used to take quadratic time -------------------------------------------------------

@case("time", VERIFY, True)
def repeated_identical_chunks(c: Ctx) -> None:
    md = c.metadata()
    tsm = md.state_dict_metadata[_first_2d(md)]
    tsm.chunks[:] = tsm.chunks[:1] * 6000
    c.write_metadata(md)


@case("time", VERIFY, True)
def nested_overlapping_boxes(c: Ctx) -> None:
    md = c.metadata()
    key = _first_2d(md)
    tsm = md.state_dict_metadata[key]
    n0, n1 = tsm.size
    cls, size_cls = type(tsm.chunks[0]), type(tsm.chunks[0].sizes)
    tsm.chunks[:] = [cls(offsets=size_cls([i % n0, 0]), sizes=size_cls([n0 - i % n0, n1 - (i % n1)]))
                     for i in range(3000)]
    c.write_metadata(md)


@case("time", VERIFY_DATA, False)
def many_chunks_share_one_range(c: Ctx) -> None:
    md = c.metadata()
    items = _storage_items(md)
    biggest = max(items, key=lambda kv: kv[1].length)[1]
    for i, s in items:
        md.storage_data[i] = replace(s, relative_path=biggest.relative_path, offset=biggest.offset,
                                     length=biggest.length)
    c.write_metadata(md)


# -- values a reader must refuse in one line -----------------------------------------------------------

@case("traceback", VERIFY + INSPECT_JSON, True)
def chunk_size_5000_digits(c: Ctx) -> None:
    md = c.metadata()
    tsm = md.state_dict_metadata[_first_2d(md)]
    tsm.chunks[0] = replace(tsm.chunks[0], sizes=type(tsm.chunks[0].sizes)([10 ** 5000, 1]))
    c.write_metadata(md)


@case("traceback", VERIFY, True)
def global_shape_over_int64(c: Ctx) -> None:
    md = c.metadata()
    tsm = md.state_dict_metadata[_first_2d(md)]
    tsm.size = type(tsm.size)([2 ** 70, 2 ** 70])
    c.write_metadata(md)


@case("memory", [["show", "{t}", "{key}"], ["diff", "{t}", "{t}"]], False)
def declared_bool_tensor_2gb(c: Ctx) -> None:
    import torch

    md = c.metadata()
    key = _first_2d(md)
    tsm = md.state_dict_metadata[key]
    tsm.properties = replace(tsm.properties, dtype=torch.bool)
    tsm.size = type(tsm.size)([2 ** 31 - 1, 1])
    tsm.chunks[:] = [replace(tsm.chunks[0], offsets=type(tsm.size)([0, 0]), sizes=type(tsm.size)([2 ** 31 - 1, 1]))]
    c.write_metadata(md)
    (c.case / "key.txt").write_text(key)


@case("memory", VERIFY_DATA, False, base="megatron")
def byte_object_over_a_sparse_hole(c: Ctx) -> None:
    md = c.metadata()
    i, s = next((i, s) for i, s in _storage_items(md) if i.offset is None)  # a byte object
    path = c.it / s.relative_path
    size = path.stat().st_size
    with open(path, "r+b") as f:  # 64 MiB of holes that nobody wrote, claimed by the byte object
        f.truncate(size + (64 << 20))
    md.storage_data[i] = replace(s, offset=size, length=64 << 20)
    c.write_metadata(md)


def case_specs(only_load: bool = False) -> list[tuple[str, str, int]]:
    """``(name, class, number of ckpt commands)`` of every case, without building anything (for test ids)."""
    specs = list(CASES) + hostile_files.specs() + hostile_bounds.specs()
    out = [(name, klass, len(cmds)) for name, klass, base, cmds, load, _, _ in specs
           if not only_load or (load and base == "dcp")]
    return out + [(f"pickle_{name}", klass, 1) for name, (klass, _) in build_pickles("x").items()]


@case("integrity", VERIFY_DATA, False, base="megatron")
def flipped_payload_bit_no_manifest(c: Ctx) -> None:
    from gtp_format.model import TENSOR
    from gtp_format.reader.blob import parse_blob
    from gtp_format.reader.checkpoint import open_checkpoint
    from gtp_format.reader.chunks import chunk_bytes
    from gtp_format.reader.zip_blob import ViewReader

    ckpt = open_checkpoint(c.it)
    entry, chunk = max(((e, ch) for e in ckpt.entries.values() if e.kind == TENSOR for ch in e.chunks),
                       key=lambda ec: ec[1].storage.length)
    layout = parse_blob(ViewReader(memoryview(bytes(chunk_bytes(ckpt, entry, chunk)))))
    path = c.it / chunk.storage.file
    raw = bytearray(path.read_bytes())
    raw[chunk.storage.offset + layout.payload_offset + layout.payload_bytes // 2] ^= 0x04
    path.write_bytes(bytes(raw))


def build_corpus(root: Path, bases: dict[str, Path] | None = None, canary: Path | None = None,
                 only_load: bool = False) -> list[Case]:
    """Write every case under ``root``; ``bases`` maps "dcp"/"megatron"/"st" to genuine iter folders.

    With ``only_load`` just the cases where the runtime's ``--load`` applies are built (on the
    ``dcp`` base, which should then be a checkpoint the runtime saved with the same model flags).
    """
    bases = {**FIXTURE_BASES, **(bases or {})}
    canary = canary or root / "CANARY"
    root.mkdir(parents=True, exist_ok=True)
    specs = list(CASES) + hostile_files.specs() + hostile_bounds.specs()
    for name, (klass, data) in build_pickles(str(canary)).items():
        specs.append((f"pickle_{name}", klass, "dcp", VERIFY, True,
                      lambda c, data=data: ((c.it / ".metadata").write_bytes(data), c.drop_checksum(".metadata")),
                      "it"))
    out = []
    for name, klass, base, commands, load, fn, target in specs:
        if only_load and (not load or base != "dcp"):
            continue
        folder = root / name
        src = bases[base]
        it = folder / "run" / src.name
        shutil.copytree(src, it, symlinks=True)
        (folder / "run" / "latest_checkpointed_iteration.txt").write_text(src.name.removeprefix("iter_").lstrip("0")
                                                                          or "0")
        outside = folder / "outside"
        outside.mkdir()
        (outside / "secret.json").write_text(json.dumps({"secret": SECRET, "format": "gtp-ckpt"}))
        (outside / "secret.bin").write_bytes(SECRET.encode() * 64)
        ctx = Ctx(folder, it, outside, src)
        fn(ctx)
        key = (folder / "key.txt").read_text() if (folder / "key.txt").exists() else ""
        t = {"it": it, "run": folder / "run"}[target]
        cmds = [[a.replace("{t}", str(t)).replace("{key}", key) for a in argv] for argv in commands]
        out.append(Case(name, klass, str(t.relative_to(folder)), cmds, load, dir=str(folder)))
    return out


@dataclass
class DataCase:
    name: str
    klass: str
    dir: str
    data_path: str


def build_data_corpus(root: Path) -> list[DataCase]:
    """Write every ``--data-path`` case (:data:`hostile_bounds.DATA_SPECS`) under ``root``: the
    dataset in ``<name>/run/``, an ``outside/`` with the secret beside it."""
    out = []
    for name, klass, fn in hostile_bounds.DATA_SPECS:
        folder = root / name
        (folder / "run").mkdir(parents=True)
        (folder / "outside").mkdir()
        (folder / "outside" / "secret.bin").write_bytes(SECRET.encode() * 64)
        out.append(DataCase(name, klass, str(folder), fn(folder / "run")))
    return out


if __name__ == "__main__":
    dest = Path(sys.argv[1] if len(sys.argv) > 1 else "hostile-corpus")
    cases = build_corpus(dest)
    print(json.dumps([vars(c) for c in cases], indent=1))
    print(f"{len(cases)} cases in {dest}", file=sys.stderr)
    os._exit(0)
