"""The one gate: the strict verdict of the one lenient parse, and the gate's fixed order of refusals.

The strict verdict is checked against the brute force it replaced: a second, strict parse of the
same object must raise exactly :attr:`Manifest.strict_error`, or accept and give the same manifest.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gtp_format.check.gate import JUDGE, REFUSE, REPAIR, no_manifest_line, open_gated
from gtp_format.errors import EXIT_BAD_INPUT, EXIT_CHECK_FAILED, FormatError
from gtp_format.manifest import ManifestError, parse_manifest
from gtp_format.names import MANIFEST_FILE

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "gtp"
MANIFESTS = sorted(FIXTURES.glob("*/iter_*/gtp_manifest.json"))
FOLD = FIXTURES / "fold_cp2_g2_dp2"
ALIASED = FIXTURES / "aliased_cp2_g2_dp2"
SECTIONS = ("topology", "model", "param_dtype", "optimizer", "bucket_size", "buffers", "files")
JUNK = st.one_of(st.none(), st.booleans(), st.integers(-3, 2**70), st.text(max_size=4), st.just([]), st.just({}))

pytestmark = pytest.mark.skipif(not MANIFESTS, reason="run python fixtures/make_fixtures.py to generate fixtures/gtp")


def _edit(raw: dict[str, Any], edits: list[tuple[str, str | None, Any]]) -> dict[str, Any]:
    """Apply (section, field or None for the whole section, value or ... to delete) edits to a copy."""
    out = json.loads(json.dumps(raw))
    for section, name, value in edits:
        if name is None:
            if value is ...:
                out.pop(section, None)
            else:
                out[section] = value
        elif isinstance(out.get(section), dict):
            out[section][name] = value
    return out


@settings(max_examples=150, deadline=None)
@given(path=st.sampled_from(MANIFESTS) if MANIFESTS else st.nothing(),
       edits=st.lists(st.tuples(st.sampled_from(SECTIONS),
                                st.one_of(st.none(), st.sampled_from(["tp", "hidden", "step", "lr", "fold_cp"])),
                                st.one_of(st.just(...), JUNK)), max_size=3))
def test_strict_verdict_of_the_lenient_parse_is_the_strict_parse(path: Path, edits: list) -> None:
    raw = _edit(json.loads(path.read_text()), edits)
    lenient = parse_manifest(raw, "m.json", strict=False)
    try:
        strict = parse_manifest(raw, "m.json", strict=True)
    except ManifestError as e:
        assert lenient.strict_error == e.message
        with pytest.raises(ManifestError) as again:
            lenient.strict()
        assert again.value.message == e.message
    else:
        assert lenient.strict_error is None and lenient.strict() is lenient and lenient == strict


def _copy(tmp_path: Path, src: Path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return next(dst.glob("iter_*"))


def test_no_manifest_is_refused_in_one_wording(tmp_path: Path) -> None:
    folder = _copy(tmp_path, FOLD)
    (folder / MANIFEST_FILE).unlink()
    assert open_gated(folder).manifest is None  # not needed: passes
    with pytest.raises(FormatError) as e:
        open_gated(folder, needs_manifest="the caller needs its bucket layout")
    assert e.value.exit_code == EXIT_BAD_INPUT
    assert e.value.message == no_manifest_line(folder, "the caller needs its bucket layout")


@pytest.mark.parametrize("damage", ["header", "section"])
def test_a_broken_manifest_is_refused_with_the_strict_line(tmp_path: Path, damage: str) -> None:
    folder = _copy(tmp_path, FOLD)
    path = folder / MANIFEST_FILE
    raw = json.loads(path.read_text())
    if damage == "header":
        raw["format_version"] = "two"
    else:
        raw["model"]["hidden"] = "32"
    path.write_text(json.dumps(raw))
    with pytest.raises(ManifestError) as want:
        parse_manifest(raw, str(path), strict=True)
    with pytest.raises(FormatError) as got:
        open_gated(folder)  # even when the caller could do without a manifest
    assert got.value.exit_code == EXIT_BAD_INPUT and got.value.message == want.value.message


@pytest.mark.skipif(not ALIASED.is_dir(), reason="run python fixtures/make_fixtures.py to generate fixtures/gtp")
def test_aliased_keys_refuse_fail_or_pass_as_the_caller_asks() -> None:
    with pytest.raises(FormatError) as refused:
        open_gated(ALIASED, aliased=REFUSE)
    assert refused.value.exit_code == EXIT_BAD_INPUT and "ckpt migrate-aliased" in refused.value.message
    with pytest.raises(FormatError) as failed:
        open_gated(ALIASED, aliased=JUDGE)
    assert failed.value.exit_code == EXIT_CHECK_FAILED and failed.value.message.startswith("verify failed: ")
    gated = open_gated(ALIASED, aliased=REPAIR)
    assert gated.result is not None and any(p.check == "aliasing" and p.severity == "error"
                                            for p in gated.result.problems)


def test_missing_bytes_are_an_incomplete_copy_source_and_a_failed_verify_otherwise(tmp_path: Path) -> None:
    folder = _copy(tmp_path, FOLD)
    victim = sorted(folder.glob("*.distcp"))[0]
    victim.write_bytes(victim.read_bytes()[:100])
    with pytest.raises(FormatError) as copy:
        open_gated(folder, copy=True)
    assert copy.value.exit_code == EXIT_BAD_INPUT and "incomplete checkpoint" in copy.value.message
    with pytest.raises(FormatError) as load:
        open_gated(folder)
    assert load.value.exit_code == EXIT_CHECK_FAILED and "runs past the end" in load.value.message
