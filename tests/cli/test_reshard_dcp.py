"""A reshard's torch_dist output, written without torch, is what PyTorch DCP reads.

``ckpt reshard`` and ``ckpt export --to fully_reshardable`` write ``.distcp`` blobs and ``.metadata``
through :mod:`gtp_format.writer` and never import torch (checked in a fresh interpreter). Then
torch's own ``torch.distributed.checkpoint`` (``FileSystemReader`` + ``load``) reads every tensor of
the result, and each must equal, bit for bit, what ``ckpt``'s reader reads from the same file, and
the per-parameter state must equal SRC's.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from cli_helpers import run_fresh

from ckpt_tool.copying import WEIGHT_STATE
from ckpt_tool.copying.source import open_source
from gtp_format.names import STATES
from gtp_format.reader.boxes import BoxReader
from gtp_format.reader.checkpoint import open_checkpoint

REPO = Path(__file__).resolve().parents[2]
FOLD = REPO / "fixtures" / "gtp" / "fold_cp2_g2_dp2"


def _dcp_load(folder: Path) -> dict[str, torch.Tensor]:
    import torch.distributed.checkpoint as dcp

    md = dcp.FileSystemReader(folder).read_metadata()
    sd = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype) for k, v in md.state_dict_metadata.items()}
    dcp.load(sd, storage_reader=dcp.FileSystemReader(folder), no_dist=True)
    return sd


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def test_torch_free_reshard_is_read_by_torch_dcp(tmp_path: Path) -> None:
    dst = tmp_path / "dst"
    assert run_fresh("reshard", str(FOLD), str(dst), "--tp", "2", "--cp", "1", "--no-fold-cp", "--layout",
                     "torch_dist", "--format", "json", timeout=300) == {"code": 0, "torch": False}
    folder = next(dst.glob("iter_*"))
    loaded = _dcp_load(folder)
    ckpt = open_checkpoint(folder)
    reader = BoxReader(ckpt)
    assert set(loaded) == {k for k, e in ckpt.entries.items() if e.shape is not None}
    for key, t in loaded.items():
        e = ckpt.entries[key]
        assert str(t.dtype) == f"torch.{e.dtype.name}" and tuple(t.shape) == e.shape, key
        assert _bits(t) == np.ascontiguousarray(reader.read_box(key, (0,) * len(e.shape), e.shape)).tobytes(), key
    src, out = open_source(FOLD), open_source(dst)
    for name, view in src.views.items():
        for state in (*STATES, WEIGHT_STATE):
            box = ((0,) * len(view.full_shape), view.full_shape)
            assert src.read_full_box(view, state, *box).tobytes() == \
                out.read_full_box(out.views[name], state, *box).tobytes(), (name, state)


def test_torch_free_exports(tmp_path: Path) -> None:
    for to in ("fully_reshardable", "hf"):
        assert run_fresh("export", str(FOLD), str(tmp_path / to), "--to", to, "--optimizer", "--format", "json",
                         timeout=300) == {"code": 0, "torch": False}, to
    loaded = _dcp_load(next((tmp_path / "fully_reshardable").glob("iter_*")))
    source = open_source(FOLD)
    for name, view in source.views.items():
        want = source.read_full_box(view, "exp_avg_sq", (0,) * len(view.full_shape), view.full_shape)
        assert _bits(loaded[f"optimizer.state.exp_avg_sq.{name}"]) == want.tobytes(), name
