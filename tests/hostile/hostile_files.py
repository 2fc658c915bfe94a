"""Crafted files around a checkpoint: symlinks out, FIFOs, markers, JSON side files, safetensors
headers, zip structures and flipped bits. Builders take :class:`make_corpus.Ctx`."""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

SPECS: list[tuple[str, str, str, list[list[str]], bool, Callable[[Any], None], str]] = []
VERIFY = [["verify", "{t}"]]
VERIFY_DATA = [["verify", "--data", "{t}"]]
INSPECT_JSON = [["inspect", "--format", "json", "{t}"]]
MARKER = "latest_checkpointed_iteration.txt"


def spec(klass: str, commands: list[list[str]], load: bool, base: str = "dcp", target: str = "it") -> Callable:
    def register(fn: Callable[[Any], None]) -> Callable[[Any], None]:
        SPECS.append((fn.__name__, klass, base, commands, load, fn, target))
        return fn

    return register


def specs() -> list[tuple[str, str, str, list[list[str]], bool, Callable[[Any], None], str]]:
    return list(SPECS)


def _link_out(c: Any, name: str, content: bytes) -> None:
    """Replace ``name`` in the checkpoint with a symlink to an outside file holding ``content``."""
    target = c.outside / f"linked-{name.strip('.')}"
    target.write_bytes(content)
    (c.it / name).unlink()
    os.symlink(os.path.relpath(target, c.it), c.it / name)


def _manifest(c: Any) -> dict[str, Any]:
    return json.loads((c.it / "gtp_manifest.json").read_text())


def _write_manifest(c: Any, doc: Any, raw: bytes | None = None) -> None:
    (c.it / "gtp_manifest.json").write_bytes(raw if raw is not None else json.dumps(doc).encode())


# -- reads outside the folder ---------------------------------------------------------------------

@spec("outside", VERIFY + INSPECT_JSON, True)
def metadata_symlink_out(c: Any) -> None:
    _link_out(c, ".metadata", (c.it / ".metadata").read_bytes())  # genuine content: following it would "work"


@spec("outside", VERIFY_DATA, True)
def data_file_symlink_out(c: Any) -> None:
    _link_out(c, "__0_0.distcp", (c.it / "__0_0.distcp").read_bytes())


@spec("outside", INSPECT_JSON, True)
def manifest_symlink_out(c: Any) -> None:
    doc = _manifest(c)
    doc["secret"] = c.outside.joinpath("secret.json").read_text()
    _link_out(c, "gtp_manifest.json", json.dumps(doc).encode())


@spec("outside", INSPECT_JSON, True)
def megatron_json_symlink_out(c: Any) -> None:
    _link_out(c, "metadata.json", c.outside.joinpath("secret.json").read_bytes())


@spec("outside", VERIFY, True, target="run")
def latest_marker_symlink_out(c: Any) -> None:
    (c.outside / "marker.txt").write_text(c.it.name.removeprefix("iter_").lstrip("0") + "\n")
    (c.run / MARKER).unlink()
    os.symlink("../outside/marker.txt", c.run / MARKER)


@spec("time", VERIFY, True, target="run")
def latest_marker_fifo(c: Any) -> None:
    (c.run / MARKER).unlink()
    os.mkfifo(c.run / MARKER)


@spec("outside", VERIFY, True, target="run")
def latest_marker_dotdot(c: Any) -> None:
    (c.run / MARKER).write_text("../outside\n")


@spec("traceback", VERIFY, True, target="run")
def latest_marker_overlong(c: Any) -> None:
    (c.run / MARKER).write_text("9" * (1 << 20))


@spec("traceback", VERIFY, True, target="run")
def latest_marker_junk(c: Any) -> None:
    (c.run / MARKER).write_bytes(b"\xff\xfe\x00\x1b]0;x\x07junk")


@spec("outside", VERIFY, True, target="run")
def iteration_folder_symlink_out(c: Any) -> None:
    moved = c.outside / c.it.name
    c.it.rename(moved)
    os.symlink(os.path.relpath(moved, c.run), c.it)


@spec("time", VERIFY_DATA, True)
def data_file_fifo(c: Any) -> None:
    path = sorted(c.it.glob("*.distcp"))[-1]
    path.unlink()
    os.mkfifo(path)


@spec("outside", VERIFY_DATA, True)
def data_file_directory(c: Any) -> None:
    path = sorted(c.it.glob("*.distcp"))[-1]
    path.unlink()
    path.mkdir()


@spec("time", VERIFY, True)
def metadata_fifo(c: Any) -> None:
    (c.it / ".metadata").unlink()
    os.mkfifo(c.it / ".metadata")


# -- the manifest and other JSON side files ---------------------------------------------------------

@spec("memory", VERIFY + INSPECT_JSON, True)
def manifest_empty_list_flood(c: Any) -> None:
    _write_manifest(c, None, b'{"format": "gtp-ckpt", "x": [' + b"[]," * 400_000 + b"[]]}")


@spec("crash", VERIFY, True)
def manifest_deep_nesting(c: Any) -> None:
    _write_manifest(c, None, b'{"a": ' + b'["aaaaaaaaaa", ' * 5000 + b"1" + b"]" * 5000 + b"}")


@spec("traceback", VERIFY, True)
def manifest_size_5000_digits(c: Any) -> None:
    doc = _manifest(c)
    next(iter(doc["files"].values()))["size"] = 0
    raw = json.dumps(doc).replace('"size": 0', '"size": ' + "9" * 5000, 1)
    _write_manifest(c, None, raw.encode())


@spec("traceback", VERIFY, True)
def manifest_size_1e999(c: Any) -> None:
    doc = _manifest(c)
    next(iter(doc["files"].values()))["size"] = 0
    _write_manifest(c, None, json.dumps(doc).replace('"size": 0', '"size": 1e999', 1).encode())


@spec("traceback", VERIFY, True)
def manifest_nan(c: Any) -> None:
    doc = _manifest(c)
    doc["iteration"] = 0
    _write_manifest(c, None, json.dumps(doc).replace('"iteration": 0', '"iteration": NaN', 1).encode())


@spec("traceback", VERIFY, True)
def manifest_wrong_type(c: Any) -> None:
    _write_manifest(c, [1, 2, 3])


@spec("traceback", VERIFY, True)
def manifest_topology_wrong_types(c: Any) -> None:
    doc = _manifest(c)
    doc["topology"] = {k: "eight" for k in doc["topology"]}
    doc["files"] = "none"
    _write_manifest(c, doc)


@spec("traceback", VERIFY_DATA, True)
def manifest_lone_surrogate(c: Any) -> None:
    raw = json.dumps(_manifest(c)).replace('"__0_0.distcp"', '"\\ud800__0_0.distcp"', 1)
    _write_manifest(c, None, raw.encode())


@spec("integrity", VERIFY_DATA, False)
def manifest_unknown_checksum_algorithm(c: Any) -> None:
    doc = _manifest(c)
    for name, entry in doc["files"].items():
        if name.endswith(".distcp"):
            for a in [k for k in entry if k != "size"]:
                entry.pop(a)
            entry["md5"] = "0" * 32
    _write_manifest(c, doc)
    with open(c.it / "__0_0.distcp", "r+b") as f:  # and damage a file nothing else checks
        f.seek(os.path.getsize(c.it / "__0_0.distcp") - 30)
        f.write(b"\0")


@spec("memory", [["verify-roundtrip", "{t}"]], False)
def roundtrip_asks_for_17_ranks(c: Any) -> None:
    doc = _manifest(c)
    doc["topology"].update(tp=1, cp=1, gtp_remat=1, dp=17, fold_cp=False, world_size=17, expert_dp=17)
    _write_manifest(c, doc)


@spec("memory", [["verify-roundtrip", "{t}"]], False)
def roundtrip_asks_for_a_huge_model(c: Any) -> None:
    doc = _manifest(c)
    doc["model"].update(hidden=65536, num_heads=64, ffn_hidden=262144, num_layers=96)
    _write_manifest(c, doc)


@spec("traceback", INSPECT_JSON, True)
def megatron_json_recursion(c: Any) -> None:
    (c.it / "metadata.json").write_bytes(b'{"a": ' + b'["aaaaaaaaaa", ' * 3000 + b"1" + b"]" * 3000 + b"}")


# -- safetensors headers and indexes --------------------------------------------------------------

def _st_header(c: Any, name: str = "__0_0.safetensors") -> tuple[dict[str, Any], bytes]:
    raw = (c.it / name).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _st_write(c: Any, header: bytes, data: bytes, name: str = "__0_0.safetensors") -> None:
    (c.it / name).write_bytes(struct.pack("<Q", len(header)) + header + data)
    c.drop_checksum(name)


@spec("memory", VERIFY, False, base="st")
def st_header_container_flood(c: Any) -> None:
    _, data = _st_header(c)
    _st_write(c, b'{"x": [' + b"[]," * 300_000 + b"[]]}", data)


@spec("traceback", VERIFY, False, base="st")
def st_header_length_past_end(c: Any) -> None:
    raw = (c.it / "__0_0.safetensors").read_bytes()
    (c.it / "__0_0.safetensors").write_bytes(struct.pack("<Q", 1 << 40) + raw[8:])


@spec("traceback", VERIFY, False, base="st")
def st_header_shape_5000_digits(c: Any) -> None:
    header, data = _st_header(c)
    key = next(k for k in header if k != "__metadata__")
    header[key]["shape"] = [0]
    _st_write(c, json.dumps(header).replace('"shape": [0]', '"shape": [' + "7" * 5000 + "]", 1).encode(), data)


@spec("traceback", VERIFY, False, base="st")
def st_header_lone_surrogate(c: Any) -> None:
    header, data = _st_header(c)
    key = next(k for k in header if k != "__metadata__")
    _st_write(c, json.dumps(header).replace(json.dumps(key), '"\\udc80' + key + '"', 1).encode(), data)


@spec("traceback", VERIFY, False, base="st")
def st_index_nan(c: Any) -> None:
    raw = (c.it / "index.json").read_text().replace('"version": 1', '"version": NaN', 1)
    (c.it / "index.json").write_text(raw)


@spec("outside", VERIFY_DATA, False, base="st")
def st_index_chunk_file_outside(c: Any) -> None:
    doc = json.loads((c.it / "index.json").read_text())
    for entry in list(doc["keys"].values())[:3]:
        entry["chunks"][0]["file"] = "../../outside/secret.bin"
    (c.it / "index.json").write_text(json.dumps(doc))


# -- integrity: bits and zip structures ----------------------------------------------------------

def _blob_spans(path: Path) -> list[tuple[int, int]]:
    """``(start, end)`` of each torch.save zip in a .distcp file, found by their end records."""
    raw = path.read_bytes()
    spans, start = [], 0
    while True:
        at = raw.find(b"PK\x05\x06", start)
        if at < 0:
            return spans
        spans.append((start, at + 22))
        start = at + 22


def _central(raw: bytes, lo: int, hi: int) -> list[int]:
    out, at = [], raw.find(b"PK\x01\x02", lo, hi)
    while at >= 0:
        out.append(at)
        at = raw.find(b"PK\x01\x02", at + 4, hi)
    return out


@spec("integrity", VERIFY_DATA, False, base="megatron")
def zip_entry_points_at_another_record(c: Any) -> None:
    path = sorted(c.it.glob("*.distcp"))[0]
    raw = bytearray(path.read_bytes())
    lo, hi = _blob_spans(path)[0]
    heads = _central(bytes(raw), lo, hi)
    first_offset = struct.unpack_from("<I", raw, heads[0] + 42)[0]
    struct.pack_into("<I", raw, heads[-1] + 42, first_offset)  # the last record's entry names the first's bytes
    path.write_bytes(bytes(raw))


@spec("integrity", VERIFY_DATA, False, base="megatron")
def zip_record_marked_compressed(c: Any) -> None:
    path = sorted(c.it.glob("*.distcp"))[0]
    raw = bytearray(path.read_bytes())
    lo, hi = _blob_spans(path)[0]
    for h in _central(bytes(raw), lo, hi):
        struct.pack_into("<H", raw, h + 10, 8)  # deflate
    path.write_bytes(bytes(raw))


@spec("integrity", VERIFY_DATA, False, base="megatron")
def truncated_data_file(c: Any) -> None:
    path = max(c.it.glob("*.distcp"), key=os.path.getsize)
    os.truncate(path, os.path.getsize(path) // 2)
