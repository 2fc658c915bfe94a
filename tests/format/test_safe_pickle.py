"""The allow-listing unpickler: what real files need, what hostile files get."""

from __future__ import annotations

import builtins
import os
import pickle
import resource
import struct
from pathlib import Path

import pytest
from cli_helpers import assert_error_line, cli, snapshot

from gtp_format.errors import FormatError
from gtp_format.reader.safe_pickle import ALLOWED_GLOBALS, MetadataRecord, UnsafePickle, load_metadata_pickle

# Exactly what torch 2.13 references in the fixture's .metadata (float32 and bfloat16 tensors).
TORCH_2_13_GLOBALS = {
    ("pathlib", "PosixPath"),
    ("torch", "Size"),
    ("torch", "bfloat16"),
    ("torch", "float32"),
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.distributed.checkpoint.metadata", "BytesStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "Metadata"),
    ("torch.distributed.checkpoint.metadata", "MetadataIndex"),
    ("torch.distributed.checkpoint.metadata", "StorageMeta"),
    ("torch.distributed.checkpoint.metadata", "TensorProperties"),
    ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
}


class _Recorder(pickle.Unpickler):
    def __init__(self, data: bytes) -> None:
        import io

        super().__init__(io.BytesIO(data))
        self.seen: set[tuple[str, str]] = set()

    def find_class(self, module: str, name: str):
        self.seen.add((module, name))
        return super().find_class(module, name)


def test_real_metadata_needs_exactly_the_documented_globals(ckpts: Path):
    data = (ckpts / "good" / "iter_0000010" / ".metadata").read_bytes()
    rec = _Recorder(data)
    rec.load()  # our own fixture: trusted
    assert rec.seen == TORCH_2_13_GLOBALS
    assert rec.seen <= ALLOWED_GLOBALS.keys()
    assert isinstance(load_metadata_pickle(data, "good/.metadata"), MetadataRecord)


class _Evil:
    def __init__(self, func, arg) -> None:
        self.func, self.arg = func, arg

    def __reduce__(self):
        return self.func, (self.arg,)


def _evil_payloads(marker: Path) -> dict[str, tuple[bytes, str]]:
    cmd = f"touch {marker}"
    code = f"open({str(marker)!r}, 'w').close()"
    return {
        "posix.system": (pickle.dumps(_Evil(os.system, cmd)), "posix.system"),
        "builtins.exec": (pickle.dumps(_Evil(builtins.exec, code)), "builtins.exec"),
        "os.system protocol 0": (f"cos\nsystem\n(V{cmd}\ntR.".encode(), "os.system"),
        "builtins.eval": (pickle.dumps(_Evil(builtins.eval, code)), "builtins.eval"),
    }


@pytest.mark.parametrize("name", ["posix.system", "builtins.exec", "os.system protocol 0", "builtins.eval"])
def test_hostile_pickle_runs_nothing(tmp_path: Path, name: str):
    marker = tmp_path / "pwned"
    data, global_name = _evil_payloads(marker)[name]
    with pytest.raises(UnsafePickle, match=global_name.replace(".", r"\.")):
        load_metadata_pickle(data, "x/.metadata")
    assert not marker.exists()


def test_hostile_object_nested_inside_real_metadata(ckpts: Path, copy_ckpt, tmp_path: Path):
    run = copy_ckpt("good")
    folder = run / "iter_0000010"
    marker = tmp_path / "pwned"
    md = pickle.loads((folder / ".metadata").read_bytes())  # trusted fixture
    md.storage_meta.save_id = _Evil(os.system, f"touch {marker}")
    (folder / ".metadata").write_bytes(pickle.dumps(md))
    before = snapshot(run)
    for command in (["inspect", run], ["verify", run, "--data"], ["show", run, "decoder.final_layernorm.weight"]):
        line = assert_error_line(cli(*command), 2, "posix.system", str(folder / ".metadata"), "nothing")
        assert "\n" not in line
    assert not marker.exists()
    assert snapshot(run) == before


def test_memo_bomb_is_not_allocated():
    # LONG_BINPUT 2**31: the C unpickler would size its memo table for 2**32 entries (32 GiB).
    data = b"\x80\x04N" + b"r" + struct.pack("<I", 2**31) + b"."
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(FormatError):
        obj = load_metadata_pickle(data, "bomb/.metadata")
        if not isinstance(obj, MetadataRecord):
            raise FormatError("not metadata")
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown_kib < 64 * 1024


@pytest.mark.parametrize("payload", [b"", b"\x80\x04", b"garbage that is not a pickle", b"\x80\x04K\x01."])
def test_damaged_pickles_are_one_clean_error(payload: bytes):
    try:
        obj = load_metadata_pickle(payload, "d/.metadata")
    except FormatError as e:
        assert "d/.metadata" in e.message and "\n" not in e.message
    else:
        assert not isinstance(obj, MetadataRecord)


def test_torch_size_refuses_non_ints():
    # torch.Size((1, "x")) via REDUCE: refused while parsing, never stored
    data = b"\x80\x04\x8c\x05torch\x94\x8c\x04Size\x94\x93\x94K\x01\x8c\x01x\x86\x94\x85\x94R\x94."
    with pytest.raises(FormatError, match="torch.Size"):
        load_metadata_pickle(data, "s/.metadata")


MEGATRON_DIR = Path(__file__).parents[2] / "fixtures" / "megatron"
MEGATRON = sorted(p.parent.parent for p in MEGATRON_DIR.glob("*/iter_*/.metadata"))


@pytest.mark.parametrize("run", MEGATRON, ids=[p.name for p in MEGATRON])
def test_real_megatron_checkpoints_pass_the_allow_list(run: Path):
    """Checkpoints written by genuine megatron-core (fixtures/megatron, when generated)."""
    for meta in run.glob("iter_*/.metadata"):
        rec = _Recorder(meta.read_bytes())
        rec.load()  # generated in this repository: trusted
        assert rec.seen <= ALLOWED_GLOBALS.keys()
    result = cli("inspect", run, "--format", "json")
    assert result.exit_code == 0, result.stderr
