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
from reshard_cases import DENSE, make_source
from safetensors.torch import load_file

from ckpt_tool.reshard import WEIGHT_STATE
from ckpt_tool.reshard.source import open_source
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


def test_export_refusals(tmp_path: Path) -> None:
    r = cli("export", FOLD, tmp_path / "m.pt", "--to", "torch", "--max-memory", str(1 << 24))
    assert r.exit_code == 0  # 0.6 MB fits
    r = cli("export", FOLD, tmp_path / "m.pt", "--to", "torch")
    assert_error_line(r, 2, "already exists")
    r = cli("export", FOLD, tmp_path / "x", "--to", "onnx")
    assert_error_line(r, 2, "--to 'onnx'")
    r = cli("export", FIXTURES / "aliased_cp2_g2_dp2", tmp_path / "y", "--to", "hf")
    assert_error_line(r, 2, "migrate-aliased")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.pt"]
    from ckpt_tool.reshard.export import export
    from gtp_format.errors import FormatError

    with pytest.raises(FormatError, match="holds all .* bytes in memory, more than --max-memory 1000"):
        export(FOLD, tmp_path / "big.pt", "torch", max_memory=1000)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.pt"]
