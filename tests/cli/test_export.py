"""``ckpt export``: Hugging Face safetensors equal to ``ckpt show`` of the same keys (padding removed)
and loadable by ``safetensors``; ``--to torch`` equal to PyTorch's own ``dcp_to_torch_save``;
``--to fully_reshardable`` loadable by PyTorch DCP and equal to the per-parameter view."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from cli_helpers import assert_error_line, cli
from damage import flip, flip_inside_a_chunk
from reshard_cases import DENSE, make_source
from safetensors.torch import load_file

from ckpt_tool.copying import WEIGHT_STATE
from ckpt_tool.copying.source import open_source
from gtp_format.layout.config import ParallelConfig as P
from gtp_format.layout.shard import ShardSpec
from gtp_format.names import STATES

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "gtp"
FOLD = FIXTURES / "fold_cp2_g2_dp2"


@pytest.fixture(scope="module")
def bf16_tp2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """bf16 params, TP 2 and GTP padding (96 qkv rows -> 48 per TP rank -> padded to 64)."""
    return make_source(tmp_path_factory.mktemp("bf16tp2"), P(tp=2, gtp_remat=2), DENSE, bf16=True)


def _shown(src: Path, key: str, dtype: torch.dtype) -> torch.Tensor:
    r = cli("show", src, key, "--values", "--format", "json")
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    return torch.tensor(doc["values"], dtype=torch.float64).to(dtype).reshape(doc["global_shape"])


def _unpadded(shown: torch.Tensor, p, tp: int) -> torch.Tensor:  # noqa: ANN001
    """The full weight inside ``ckpt show``'s global tensor: each TP part without its GTP tail rows."""
    parts = []
    for t in range(tp if p.tp_mode else 1):
        spec = ShardSpec(p.full_shape, p.tp_mode, tp, t, p.shard_kind, p.shard_size, 0, p.align)
        tl, go = spec.tp_local_shape, spec.global_offset
        parts.append(shown[tuple(slice(o, o + n) for o, n in zip(go, tl))])
    return torch.cat(parts, dim=1 if p.tp_mode == "row" else 0)


@pytest.mark.slow
@pytest.mark.parametrize("which", ["fold_fp32", "bf16_tp2"])
def test_hf_export_equals_show_and_loads(which: str, bf16_tp2: Path, tmp_path: Path) -> None:
    src = FOLD if which == "fold_fp32" else bf16_tp2
    out = tmp_path / "hf"
    r = cli("export", src, out, "--to", "hf", "--names", "megatron", "--optimizer", "--max-shard-size", "20KB",
            "--format", "json")
    assert r.exit_code == 0, r.stderr
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted({f for f in index["weight_map"].values()})
    assert len(files) > 1 and all(f.startswith("model-") and f.endswith(f"-of-{len(files):05d}.safetensors")
                                  for f in files)
    loaded: dict[str, torch.Tensor] = {}
    for f in files:
        loaded.update(load_file(out / f))  # the safetensors library reads every file
    source = open_source(src)
    m = source.manifest
    assert m.topology is not None and m.buffers is not None
    params = {p.name: p for buf in m.buffers for b in buf.buckets for p in b.params}
    assert loaded.keys() == params.keys() == set(index["weight_map"])
    for name, p in params.items():
        t = loaded[name]
        assert tuple(t.shape) == p.full_shape and str(t.dtype) == m.param_dtype
        want = _unpadded(_shown(src, name, t.dtype), p, m.topology.tp)
        assert torch.equal(t, want), name
    opt: dict[str, torch.Tensor] = {}
    for f in sorted(set(json.loads((out / "optimizer.safetensors.index.json").read_text())["weight_map"].values())):
        opt.update(load_file(out / f))
    assert len(opt) == 3 * len(params)
    for name, view in source.views.items():
        for state in STATES:
            want = source.read_full_box(view, state, (0,) * len(view.full_shape), view.full_shape)
            assert opt[f"optimizer.state.{state}.{name}"].numpy().tobytes() == want.tobytes()


def test_torch_export_equals_pytorch_dcp_to_torch_save(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    ours, theirs = tmp_path / "ours.pt", tmp_path / "theirs.pt"
    r = cli("export", FOLD, ours, "--to", "torch")
    assert r.exit_code == 0, r.stderr
    dcp_to_torch_save(FOLD / "iter_0000002", theirs)
    a = torch.load(ours, weights_only=True)
    b = torch.load(theirs, weights_only=True)
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)), k


def test_fully_reshardable_loads_with_dcp_and_equals_view(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    out = tmp_path / "fr"
    r = cli("export", FOLD, out, "--to", "fully_reshardable")
    assert r.exit_code == 0, r.stderr
    folder = out / "iter_0000002"
    md = dcp.FileSystemReader(folder).read_metadata()
    sd = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype) for k, v in md.state_dict_metadata.items()}
    dcp.load(sd, storage_reader=dcp.FileSystemReader(folder), no_dist=True)
    source = open_source(FOLD)
    assert len(sd) == 4 * len(source.views)
    for name, view in source.views.items():
        for state, key in [(WEIGHT_STATE, name), *((s, f"optimizer.state.{s}.{name}") for s in STATES)]:
            want = source.read_full_box(view, state, (0,) * len(view.full_shape), view.full_shape)
            assert np.ascontiguousarray(sd[key].numpy()).tobytes() == want.tobytes(), key


def test_fully_reshardable_export_records_every_chunk_and_verify_names_a_damaged_one(tmp_path: Path) -> None:
    """Megatron's layout has no manifest, so the records stand alone (``gtp_chunks.json``); every chunk,
    byte objects included, has one, and a flipped byte is named by key, chunk, file and range."""
    import xxhash

    from gtp_format.check.verify import verify
    from gtp_format.integrity.records import read_records
    from gtp_format.reader.checkpoint import open_checkpoint

    out = tmp_path / "fr"
    assert cli("export", FOLD, out, "--to", "fully_reshardable").exit_code == 0
    folder = out / "iter_0000002"
    ckpt = open_checkpoint(folder)
    records = read_records(ckpt)
    assert records is not None and not records.problems and len(records.by_chunk) == ckpt.chunk_count()
    for rec in records.by_chunk.values():  # independent of the writer: the bytes the record names
        with open(folder / rec.file, "rb") as f:
            f.seek(rec.offset)
            assert xxhash.xxh3_128_hexdigest(f.read(rec.length)) == rec.digest, rec.key
    ok = verify(ckpt, data=True)
    assert ok.ok and "chunk_records" in ok.checks, [p.message for p in ok.problems]
    line = json.loads(cli("inspect", folder, "--format", "json").stdout)["integrity"]
    assert line == "xxh3_128 per chunk (gtp_chunks.json, no manifest)", line
    line = json.loads(cli("inspect", folder, "--stats", "--format", "json").stdout)["integrity"]
    assert line.startswith(f"xxh3_128 per chunk ({ckpt.chunk_count()} chunks, statistics for "), line
    key, index, file, start, stop = flip_inside_a_chunk(folder)
    found = [p for p in verify(open_checkpoint(folder), data=True).problems if p.check == "chunk_hash"]
    assert [(p.key, p.chunk, p.file) for p in found] == [(key, index, file)]
    assert f"[{start}, {stop})" in found[0].message
    r = cli("verify", folder, "--data")
    assert r.exit_code == 1 and key in r.stdout + r.stderr
    # laundering: a byte of the largest chunk's elements flipped, then the records rewritten to match the
    # damaged bytes. Nothing checksums a manifest-less side file, so it must not replace the zip records'
    # own CRC-32 there (the flip above may sit in zip bytes no CRC covers: it is the chunk hash's alone)
    big = max((r for r in read_records(open_checkpoint(folder)).by_chunk.values()), key=lambda r: r.length)
    assert big.length > 8192  # about 1.5 KiB of zip around 16 KiB of elements: its middle is an element
    flip(folder / big.file, big.offset + big.length // 2, 0x10)
    body = json.loads((folder / "gtp_chunks.json").read_text())
    for raw in body["chunks"]:
        with open(folder / raw["file"], "rb") as f:
            f.seek(raw["offset"])
            raw["xxh3_128"] = xxhash.xxh3_128_hexdigest(f.read(raw["length"]))
    (folder / "gtp_chunks.json").write_text(json.dumps(body))
    res = verify(open_checkpoint(folder), data=True)
    assert not [p for p in res.problems if p.check == "chunk_hash"]
    assert [p.key for p in res.problems if p.severity == "error"] == [big.key], [p.message for p in res.problems]


def test_export_refusals(tmp_path: Path) -> None:
    r = cli("export", FOLD, tmp_path / "m.pt", "--to", "torch", "--max-memory", str(1 << 24))
    assert r.exit_code == 0  # 0.6 MB fits
    r = cli("export", FOLD, tmp_path / "m.pt", "--to", "torch")
    assert_error_line(r, 2, "already exists")
    r = cli("export", FOLD, tmp_path / "x", "--to", "onnx")
    assert_error_line(r, 2, "--to 'onnx'")
    r = cli("export", FIXTURES / "aliased_cp2_g2_dp2", tmp_path / "y", "--to", "hf")
    assert_error_line(r, 2, "migrate-aliased")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.pt", "m.pt.gtp_attestation.json"]
    from ckpt_tool.export.engine import export

    # streamed: a --max-memory below the state's size is no longer refused, and the file is the same
    export(FOLD, tmp_path / "small.pt", "torch", max_memory=1000)
    a, b = torch.load(tmp_path / "m.pt", weights_only=True), torch.load(tmp_path / "small.pt", weights_only=True)
    assert list(a) == list(b) and all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)


@pytest.mark.parametrize("name", ["tp2_dp2_dp_reshardable", "pair_moe_ep2_dp_reshardable"])
def test_torch_export_of_megatron_core_names_the_objects_it_leaves_out(name: str, tmp_path: Path) -> None:
    """A genuine megatron-core checkpoint: the tensors are PyTorch DCP's own, bit for bit; the non-tensor
    objects (``BytesStorageMetadata``) that ``torch.load(weights_only=True)`` decodes are in the file
    (compared with ``dcp_to_torch_save`` in ``test_export_torch_objects.py``), and those it refuses
    (common_state, rng_state) are named as left out, in the JSON and in the line."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    src = FIXTURES.parent / "megatron" / name
    r = cli("export", src, tmp_path / "ours.pt", "--to", "torch", "--format", "json")
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    folder = src / "iter_0000002"
    md = dcp.FileSystemReader(folder).read_metadata()  # the repository's own fixture: trusted
    objects = sorted(k for k, v in md.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata))
    refused = [k for k in objects if k.startswith(("common_state", "rng_state"))]
    assert refused and doc["left_out"] == refused and doc["equals_dcp_to_torch_save"] is False
    theirs = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype) for k, v in md.state_dict_metadata.items()
              if isinstance(v, TensorStorageMetadata)}
    dcp.load(theirs, storage_reader=dcp.FileSystemReader(folder), no_dist=True)
    ours = torch.load(tmp_path / "ours.pt", weights_only=True)
    tensors = {k for k, v in ours.items() if isinstance(v, torch.Tensor)}
    assert tensors == theirs.keys() and set(ours) | set(refused) == set(md.state_dict_metadata)
    for k in tensors:
        assert ours[k].dtype == theirs[k].dtype and torch.equal(ours[k].view(torch.uint8),
                                                               theirs[k].view(torch.uint8)), k
    line = cli("export", src, tmp_path / "again.pt", "--to", "torch").stdout
    assert f"left out {len(refused)} non-tensor objects" in line and "common_state" in line, line
    assert "weights_only=True refuses them" in line, line


def test_torch_export_writes_its_attestation_beside_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--to torch`` writes one file, so its attestation lies beside it (``m.pt.gtp_attestation.json``): the
    source it came from and the command; a leftover attestation of that name is refused before anything is
    written, and an attestation that cannot be made after the file is says so in one line."""
    from gtp_format import commit as commit_mod
    from gtp_format.lineage import read_file_attestation

    r = cli("export", FOLD, tmp_path / "m.pt", "--to", "torch", "--format", "json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["attestation"] == str(tmp_path / "m.pt.gtp_attestation.json")
    att = read_file_attestation(tmp_path / "m.pt")
    assert att is not None and att.command == "ckpt export --to torch"
    assert att.source["path"].endswith("iter_0000002") and att.source["iteration"] == 2
    assert att.target == {"path": str(tmp_path / "m.pt"), "root_hash": None, "iteration": 2, "run_id": None}
    assert read_file_attestation(tmp_path / "other.pt") is None
    # a leftover attestation of the name: refused first, nothing written
    (tmp_path / "n.pt.gtp_attestation.json").write_text("{}")
    r = cli("export", FOLD, tmp_path / "n.pt", "--to", "torch")
    assert_error_line(r, 2, "n.pt.gtp_attestation.json already exists")
    assert not (tmp_path / "n.pt").exists()
    # the attestation's commit fails after the file's: one line, the file stays (it is complete), no leftover
    real = commit_mod.commit_file

    def fail(tmp: Path, final: Path) -> None:
        if final.name.endswith(".gtp_attestation.json"):
            raise OSError(28, "No space left on device")
        real(tmp, final)

    monkeypatch.setattr(commit_mod, "commit_file", fail)
    r = cli("export", FOLD, tmp_path / "o.pt", "--to", "torch")
    assert_error_line(r, 2, "its attestation")
    assert (tmp_path / "o.pt").is_file() and not (tmp_path / "o.pt.gtp_attestation.json").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
