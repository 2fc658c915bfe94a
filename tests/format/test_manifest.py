"""The manifest schema: the one writer and the one parser agree, and every bad field is named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gtp_format.manifest import Manifest, ManifestError, parse_manifest

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "gtp"
MANIFESTS = sorted(FIXTURES.glob("*/iter_*/gtp_manifest.json"))


def _raw(path: Path = MANIFESTS[0]) -> dict:
    return json.loads(path.read_text())


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.parent.parent.name)
def test_fixture_manifests_round_trip_exactly(path: Path):
    raw = _raw(path)
    m = parse_manifest(raw, str(path), strict=True)
    assert isinstance(m, Manifest) and not m.problems
    assert m.to_json() == raw  # the writer's JSON is the file, field for field
    assert parse_manifest(json.loads(json.dumps(m.to_json())), "again") == m


@pytest.mark.parametrize("section, field, value, message", [
    ("topology", "fold_cp", 1, r"topology.fold_cp is 1, not true/false"),
    ("topology", "world_size", 6, r"topology.world_size is 6 but the sizes give 8"),
    ("model", "hidden", "32", r"model.hidden is '32', not an integer"),
    ("model", "new_field", 1, r"model.new_field is a field this version does not know"),
    ("optimizer", "lr", None, r"optimizer.lr is None, not a finite number"),
    ("optimizer", "step", 2**70, r"optimizer.step is .* not an integer"),
])
def test_strict_parse_names_the_bad_field(section, field, value, message):
    raw = _raw()
    raw[section][field] = value
    with pytest.raises(ManifestError, match=message):
        parse_manifest(raw, "m.json", strict=True)
    lenient = parse_manifest(raw, "m.json", strict=False)
    assert getattr(lenient, section) is None and len(lenient.problems) == 1
    assert lenient.buffers is not None  # the other sections survive


def test_missing_sections_and_header():
    raw = _raw()
    del raw["model"]
    with pytest.raises(ManifestError, match="model is missing"):
        parse_manifest(raw, "m.json")
    assert parse_manifest(raw, "m.json", strict=False).model is None
    for bad, message in [({**_raw(), "format": "other"}, "not a gtp-ckpt manifest"),
                         ({**_raw(), "format_version": 99}, "newer than this tool"),
                         ({**_raw(), "layout": "zarr"}, "layout is 'zarr'"),
                         ([], "the manifest is list, not an object")]:
        with pytest.raises(ManifestError, match=message):
            parse_manifest(bad, "m.json", strict=False)


def test_param_range_must_match_its_shape():
    raw = _raw()
    raw["buffers"][0]["buckets"][0]["params"][0]["end"] += 1
    with pytest.raises(ManifestError, match=r"buffers\[0\].buckets\[0\].params\[0\] has range"):
        parse_manifest(raw, "m.json")


def test_unknown_top_level_fields_are_kept():
    raw = {**_raw(), "migration": {"tool": "x"}, "future": [1, 2]}
    m = parse_manifest(raw, "m.json")
    assert m.extra == {"migration": {"tool": "x"}, "future": [1, 2]}
    assert m.to_json() == raw


JSONISH = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
                       lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c, max_size=3),
                       max_leaves=8)


@settings(max_examples=300, deadline=None)
@given(section=st.sampled_from(["topology", "model", "optimizer", "buffers", "files", "bucket_size", "param_dtype",
                                "iteration", "notes", "format_version"]), value=JSONISH)
def test_any_value_anywhere_is_a_clean_answer(section, value):
    """Whatever JSON a section holds, the parser returns or raises ManifestError: nothing else."""
    raw = _raw()
    raw[section] = value
    for strict in (True, False):
        try:
            parse_manifest(raw, "m.json", strict=strict)
        except ManifestError as e:
            assert "\n" not in str(e)


LAYOUT_FIXTURES = sorted(p.parent for p in (FIXTURES.parent).glob("*/*/iter_*/gtp_manifest.json"))


@pytest.mark.parametrize("folder", LAYOUT_FIXTURES, ids=lambda p: p.parent.name)
def test_param_shard_spec_places_every_rank_where_the_writer_put_it(folder: Path):
    """The boxes param_shard_spec gives all (tp_rank, shard_rank) are exactly the chunks the runtime saved."""
    from gtp_format.layout.schema import param_shard_spec
    from gtp_format.reader.checkpoint import open_checkpoint

    ckpt = open_checkpoint(folder)
    par, checked = ckpt.manifest.topology, 0
    for buf in ckpt.manifest.buffers:
        for bucket in buf.buckets:
            for p in bucket.params:
                ranks = p.shard_size if p.shard_kind else 1
                specs = [param_shard_spec(p, par, t, r) for t in range(par.tp) for r in range(ranks)]
                assert all(s.local_shape == p.local_shape and s.global_shape == p.global_shape for s in specs)
                boxes = {(s.global_offset, s.local_shape) for s in specs}
                assert boxes == {(c.offsets, c.sizes) for c in ckpt.entries[p.name].chunks}, p.name
                checked += 1
    assert checked >= 15


def test_param_shard_spec_refuses_ranks_outside_the_groups():
    from gtp_format.layout.config import ParallelConfig
    from gtp_format.layout.schema import param_shard_spec

    m = parse_manifest(_raw(), "m", strict=True)
    sharded = next(p for b in m.buffers for k in b.buckets for p in k.params if p.shard_kind)
    plain = next(p for b in m.buffers for k in b.buckets for p in k.params if not p.shard_kind)
    par = ParallelConfig(tp=2, cp=2, gtp_remat=2, dp=2, fold_cp=True)
    assert param_shard_spec(sharded, par, 1, sharded.shard_size - 1).shard_rank == sharded.shard_size - 1
    for p, t, r in [(sharded, 2, 0), (sharded, -1, 0), (sharded, 0, sharded.shard_size), (plain, 0, 1)]:
        with pytest.raises(ValueError, match="outside"):
            param_shard_spec(p, par, t, r)
