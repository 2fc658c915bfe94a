"""Counts a manifest declares are bounded by what the metadata stores (``reader/declared.py``).

Issue 22: a 4 KB edit of the manifest's topology to a world of 10**9 made ``verify`` and
``inspect --params`` walk world-long ranges. Now ``open_checkpoint`` refuses, before any walk, a
topology of more ranks than stored chunks and a layout implying more optimizer keys than stored
keys; every genuine fixture passes.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from gtp_format.errors import EXIT_BAD_INPUT
from gtp_format.manifest import ManifestError
from gtp_format.reader.checkpoint import open_checkpoint
from gtp_format.reader.declared import owner_count

ROOT = Path(__file__).resolve().parents[2]
GENUINE = sorted(p.parent for p in ROOT.glob("fixtures/*/*/iter_*/gtp_manifest.json"))


def _copy(tmp_path: Path, name: str = "fixtures/gtp/fold_cp2_g2_dp2/iter_0000002") -> Path:
    dst = tmp_path / "iter_0000002"
    shutil.copytree(ROOT / name, dst)
    return dst


def _edit(folder: Path, fn) -> None:
    path = folder / "gtp_manifest.json"
    doc = json.loads(path.read_text())
    fn(doc)
    path.write_text(json.dumps(doc))


@pytest.mark.parametrize("folder", GENUINE, ids=lambda p: p.parent.name)
def test_genuine_manifests_are_within_their_bounds(folder: Path) -> None:
    ckpt = open_checkpoint(folder)
    m = ckpt.manifest
    assert m is not None and m.topology is not None
    assert m.topology.world_size <= sum(len(e.chunks) for e in ckpt.entries.values())
    assert sum(owner_count(m, b.is_expert) * len(b.buckets) * 3 for b in m.buffers or ()) <= len(ckpt.entries)


@pytest.mark.parametrize("sizes", [{"dp": 10 ** 9}, {"cp": 10 ** 6, "fold_cp": False}, {"tp": 2 ** 40}])
def test_world_larger_than_stored_chunks_is_refused_at_once(tmp_path: Path, sizes: dict) -> None:
    folder = _copy(tmp_path)

    def grow(doc: dict) -> None:
        doc["topology"].update(sizes)
        doc["topology"].pop("world_size", None)
        doc["topology"].pop("expert_dp", None)

    _edit(folder, grow)
    t0 = time.monotonic()
    with pytest.raises(ManifestError) as info:
        open_checkpoint(folder)
    assert time.monotonic() - t0 < 5
    msg = info.value.message
    assert info.value.exit_code == EXIT_BAD_INPUT and "gtp_manifest.json" in msg and "chunks" in msg
    assert "restore it" in msg and "\n" not in msg


def test_layout_implying_more_keys_than_stored_is_refused(tmp_path: Path) -> None:
    folder = _copy(tmp_path)

    def many_buckets(doc: dict) -> None:
        buf = doc["buffers"][0]
        template = buf["buckets"][-1]
        buf["buckets"] = [{**template, "bucket_idx": i, "params": []} for i in range(5000)]

    _edit(folder, many_buckets)
    with pytest.raises(ManifestError) as info:
        open_checkpoint(folder)
    assert "implies" in info.value.message and "optimizer keys" in info.value.message


def test_a_world_within_the_bound_still_opens(tmp_path: Path) -> None:
    """The bound is a fact of complete checkpoints, not a cap: a wrong but small topology opens,
    and verify's own checks name what does not match."""
    folder = _copy(tmp_path)
    _edit(folder, lambda doc: doc["topology"].update(dp=4, world_size=16, expert_dp=16))
    assert open_checkpoint(folder).manifest.topology.world_size == 16
