"""``export --to torch`` writes the checkpoint's non-tensor objects as PyTorch's ``dcp_to_torch_save`` does,
where ``torch.load(weights_only=True)`` decodes them, and names the rest; a byte object that is not data
stops it (``ckpt_tool/export/torch_objects.py``).

Compared with ``dcp_to_torch_save``'s own output of genuine megatron-core checkpoints: every key ours has
is theirs, tensors bit for bit and objects equal (same types and values); the keys only theirs has are
exactly those named as left out (``common_state``'s argparse namespace, ``rng_state``'s numpy arrays).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from cli_helpers import REPO, assert_error_line, cli, rewrite_metadata, snapshot

MEGATRON = REPO / "fixtures" / "megatron"


def _theirs(folder: Path, out: Path) -> dict:
    """PyTorch's own conversion, read back with weights_only=True and, for this repository's own fixture
    only, the data types megatron-core puts in common_state and rng_state allowed."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(folder, out)
    allowed: list = [argparse.Namespace, np.ndarray, np.dtype, type(np.dtype(np.uint32))]
    allowed += [np._core.multiarray._reconstruct] if hasattr(np, "_core") else [np.core.multiarray._reconstruct]
    with torch.serialization.safe_globals(allowed):
        return torch.load(out, weights_only=True)


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.view(torch.uint8), b.view(torch.uint8)))
    return type(a) is type(b) and a == b and repr(a) == repr(b)


@pytest.mark.parametrize("name", ["tp2_dp2_dp_reshardable", "pair_moe_ep2_dp_reshardable"])
def test_objects_equal_dcp_to_torch_save_and_the_refused_are_named(name: str, tmp_path: Path) -> None:
    src = MEGATRON / name
    before = snapshot(src)
    r = cli("export", src, tmp_path / "ours.pt", "--to", "torch", "--format", "json")
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    ours = torch.load(tmp_path / "ours.pt", weights_only=True)
    theirs = _theirs(src / "iter_0000002", tmp_path / "theirs.pt")
    for k, v in ours.items():
        assert k in theirs and _same(v, theirs[k]), k
    objects = [k for k, v in ours.items() if not isinstance(v, torch.Tensor)]
    assert doc["byte_objects"] == len(objects) > 0 and doc["keys"] == len(ours)
    assert any("_extra_state" in k for k in objects) and any("optimizer" in k for k in objects)
    assert sorted(set(theirs) - set(ours)) == doc["left_out"], doc["left_out"]
    assert {k.split("/")[0] for k in doc["left_out"]} == {"common_state", "rng_state"}
    assert doc["equals_dcp_to_torch_save"] is False
    assert all("argparse.Namespace" in doc["left_out_why"][k] for k in doc["left_out"] if k.startswith("common"))
    assert all("numpy" in doc["left_out_why"][k] for k in doc["left_out"] if k.startswith("rng_state"))
    assert snapshot(src) == before


def _copy(tmp_path: Path, name: str = "tp2_dp2_dp_reshardable") -> Path:
    dst = tmp_path / name
    shutil.copytree(MEGATRON / name, dst)
    return dst


class _Payload:
    """Pickles as a call of ``os.system``: what a crafted byte object runs on ``torch.load(weights_only=False)``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {self.marker}",))


def _replace_object(folder: Path, key_prefix: str, blob: bytes, length: int | None = None) -> str:
    """Append ``blob`` to a data file and point the first byte object under ``key_prefix`` at it."""
    it = folder / "iter_0000002"
    target = it / "__0_0.distcp"
    offset = target.stat().st_size
    with open(target, "ab") as f:
        f.write(blob)
    hit: list[str] = []

    def edit(md: object) -> None:
        for idx, info in md.storage_data.items():  # type: ignore[attr-defined]
            if idx.fqn.startswith(key_prefix) and not hit:
                hit.append(idx.fqn)
                info.relative_path, info.offset, info.length = target.name, offset, length or len(blob)

    rewrite_metadata(it, edit)
    assert hit
    return hit[0]


def test_a_byte_object_that_runs_code_is_refused_and_nothing_runs(tmp_path: Path) -> None:
    src = _copy(tmp_path)
    marker = tmp_path / "pwned"
    buf = io.BytesIO()
    torch.save([_Payload(marker)], buf)  # saving only pickles: nothing runs here
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as z:
        assert b"system" in z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
    key = _replace_object(src, "decoder.layers.mlp.linear_fc1._extra_state", buf.getvalue())
    before = snapshot(src)
    out = tmp_path / "out"
    out.mkdir()
    r = cli("export", src, out / "model.pt", "--to", "torch")
    line = assert_error_line(r, 2, key, "system", "not data", "nothing was written")
    assert len(line) < 600
    assert not marker.exists(), "the pickle ran"
    assert os.listdir(out) == [] and snapshot(src) == before


def test_a_huge_declared_byte_object_is_refused_before_it_is_read(tmp_path: Path) -> None:
    """A byte object declaring 1 TiB (its file holds a few KB): one line, exit 2, at once, in little memory."""
    import resource

    src = _copy(tmp_path)
    _replace_object(src, "decoder.layers.mlp.linear_fc2._extra_state", b"PK" + b"\0" * 100, length=1 << 40)
    out = tmp_path / "out"
    out.mkdir()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t = time.monotonic()
    r = cli("export", src, out / "model.pt", "--to", "torch")
    assert_error_line(r, 2, "decoder.layers.mlp.linear_fc2._extra_state", "runs past the end")
    assert time.monotonic() - t < 30
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss < 200 << 10  # KiB: no 1 TiB read
    assert os.listdir(out) == []


def test_objects_are_bounded_by_max_memory(tmp_path: Path) -> None:
    """Three real byte objects of 900 KB (under the reader's 1 MiB cap on one object's pickle), over an eighth
    of --max-memory 16MiB together: refused before any object is decoded; within 64MiB they are written."""
    src = _copy(tmp_path)
    for module in ("mlp.linear_fc1", "mlp.linear_fc2", "self_attention.linear_proj"):
        buf = io.BytesIO()
        torch.save([module * (900_000 // len(module))], buf)
        _replace_object(src, f"decoder.layers.{module}._extra_state", buf.getvalue())
    out = tmp_path / "out"
    out.mkdir()
    r = cli("export", src, out / "model.pt", "--to", "torch", "--max-memory", "16MiB")
    assert_error_line(r, 2, "non-tensor objects store", "--max-memory 16777216")
    assert os.listdir(out) == []
    r = cli("export", src, out / "model.pt", "--to", "torch", "--max-memory", "64MiB")
    assert r.exit_code == 0, r.stderr
    ours = torch.load(out / "model.pt", weights_only=True)
    assert ours[next(k for k in ours if k.startswith("decoder.layers.mlp.linear_fc1._extra_state"))][0][:6] == "mlp.li"


def test_the_fragment_of_an_object_is_a_value_inside_another_pickle() -> None:
    from ckpt_tool.export.torch_objects import fragment

    obj = [{"param_groups": [{"lr": 0.1, "betas": (0.9, 0.95), "params": [0, 1]}]},
           {(torch.bfloat16, torch.float32): [12416]}, None, "x", 2**70]
    body = b"\x80\x02}q\x00(X\x01\x00\x00\x00a" + fragment(obj) + b"u."
    assert torch.load(io.BytesIO(_as_torch_file(body)), weights_only=True) == {"a": obj}
    assert b"q" not in fragment([[1], [2]]) and b"h" not in fragment([[1], [2]])  # no PUT, no GET


def _as_torch_file(pkl: bytes) -> bytes:
    """A torch.save archive holding ``pkl`` as its data.pkl and no storages."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", pkl)
        z.writestr("archive/byteorder", "little")
        z.writestr("archive/version", "3\n")
    return buf.getvalue()
