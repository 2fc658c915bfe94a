"""The manifest's layout predicts every stored key (gtp_format.check.keys), and verify names a missing one."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from gtp_format.check.keys import check_manifest_keys, expected_keys
from gtp_format.check.verify import verify
from gtp_format.reader.checkpoint import open_checkpoint

GTP = Path(__file__).resolve().parents[2] / "fixtures" / "gtp"


@pytest.mark.parametrize("name", ["fold_cp2_g2_dp2", "fold_cp2_g2_dp2_st", "nofold_cp2_g2_dp2"])
def test_layout_predicts_exactly_the_stored_keys_and_shapes(name: str) -> None:
    ckpt = open_checkpoint(GTP / name)
    assert ckpt.manifest is not None
    found = expected_keys(ckpt.manifest)
    assert found is not None
    expected, weights = found
    assert set(expected) == set(ckpt.entries)
    assert weights == {k for k in ckpt.entries if not k.startswith("optimizer.")}
    for key, (shape, _) in expected.items():
        assert shape is None or ckpt.entries[key].shape == shape, key
    assert check_manifest_keys(ckpt) == []


def _first(ckpt, pred) -> str:
    return sorted(k for k in ckpt.entries if pred(k))[0]


@pytest.mark.parametrize("pick", [
    lambda k: not k.startswith("optimizer."),  # a model weight
    lambda k: ".cp_rank_1" in k,  # one CP rank of a folded bucket state
    lambda k: k.endswith("per_bucket_numel_unpadded"),
])
def test_a_missing_key_is_an_error_naming_it(pick) -> None:
    ckpt = open_checkpoint(GTP / "fold_cp2_g2_dp2")
    key = _first(ckpt, pick)
    del ckpt.entries[key]
    problems = [p for p in verify(ckpt).problems if p.check == "manifest_keys"]
    assert [(p.severity, p.key) for p in problems] == [("error", key)]
    assert "missing from the metadata" in problems[0].message


def test_a_wrong_shape_is_an_error() -> None:
    ckpt = open_checkpoint(GTP / "fold_cp2_g2_dp2")
    key = _first(ckpt, lambda k: not k.startswith("optimizer."))
    entry = ckpt.entries[key]
    ckpt.entries[key] = dataclasses.replace(entry, shape=(entry.shape[0] + 1, *entry.shape[1:]))
    problems = check_manifest_keys(ckpt)
    assert [(p.severity, p.key) for p in problems] == [("error", key)] and "layout gives" in problems[0].message


def test_many_missing_keys_are_counted_not_listed() -> None:
    ckpt = open_checkpoint(GTP / "fold_cp2_g2_dp2")
    for key in [k for k in ckpt.entries if k.startswith("optimizer.") and ".param" in k]:
        del ckpt.entries[key]
    problems = check_manifest_keys(ckpt)
    assert len(problems) == 4 and problems[-1].key is None and "more keys" in problems[-1].message


def test_aliased_keys_are_left_to_the_aliasing_check() -> None:
    ckpt = open_checkpoint(GTP / "aliased_cp2_g2_dp2")
    assert check_manifest_keys(ckpt) == []
    assert any(p.check == "aliasing" and p.severity == "error" and "ckpt migrate-aliased" in p.message
               for p in verify(ckpt).problems)
