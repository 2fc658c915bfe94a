"""SRC and DST never nest: a bucket DST inside SRC's prefix (by the name the user gave or the iteration it
resolved to), or SRC inside DST, is refused by every command with a DST, as a folder is, in one line naming
both, exit 2, nothing created (moto's S3 server on 127.0.0.1). The rule itself,
:func:`gtp_format.storage.location.within`, is checked by hypothesis against a brute-force reference.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from s3_server import run_ckpt as ckpt
from s3_server import upload

from gtp_format.storage.location import ObjectURL, parse_location, within

REPO = Path(__file__).resolve().parents[2]
SRC = REPO / "fixtures" / "gtp" / "fold_cp2_g2_dp2"  # a run folder holding iter_0000002
ALIASED = REPO / "fixtures" / "gtp" / "aliased_cp2_g2_dp2"
# every command with a DST: (its argv with SRC and DST to fill in, the fixture it reads, a file name DST needs)
COMMANDS = {
    "reshard": (["reshard", "{src}", "{dst}", "--dp", "1"], SRC, ""),
    "export-hf": (["export", "{src}", "{dst}", "--to", "hf"], SRC, ""),
    "export-fully_reshardable": (["export", "{src}", "{dst}", "--to", "fully_reshardable"], SRC, ""),
    "export-torch": (["export", "{src}", "{dst}", "--to", "torch"], SRC, "/model.pt"),
    "import": (["import", "{src}", "{dst}", "--from", "hf", "--dp", "2"], None, ""),
    "migrate": (["migrate-aliased", "{src}", "{dst}", "--reset-lost-moments"], ALIASED, ""),
}


def argv(case: str, src: str, dst: str) -> list[str]:
    return [a.format(src=src, dst=dst + COMMANDS[case][2]) for a in COMMANDS[case][0]]


@pytest.fixture
def staging(tmp_path, monkeypatch) -> Path:
    """The local staging folder of bucket outputs: a refusal must leave it empty."""
    folder = tmp_path / "staging"
    folder.mkdir()
    monkeypatch.setenv("CKPT_S3_STAGING", str(folder))
    return folder


def fixture_of(case: str, hf_src: Path) -> Path:
    return COMMANDS[case][1] or hf_src


def iteration_of(case: str) -> str:
    """The iteration folder SRC resolves to ("" for an HF folder, which is its own root)."""
    return "" if case == "import" else "/iter_0000002"


def refused(capsys, args: list[str], first: str, second: str, how: str) -> None:
    code, out, err = ckpt(capsys, *args)
    assert code == 2 and err.count("\n") == 1 and not out, (code, out, err)
    assert f"{first} is inside {how} {second}" in err, err


@pytest.mark.parametrize("case", sorted(COMMANDS))
def test_a_bucket_dst_inside_the_src_prefix_is_refused(s3, capsys, staging, hf_src, case):
    url = upload(s3, fixture_of(case, hf_src), "runs/a")
    before = s3.keys()
    # DST below SRC as given (the run prefix), and below the iteration folder it resolved to
    for src, dst in ((url, f"{url}/out"), (url + iteration_of(case), f"{url}{iteration_of(case)}/out")):
        args = argv(case, src, dst)
        shown_dst = dst + COMMANDS[case][2]
        refused(capsys, args, f"DST {shown_dst}", src, "SRC")
    assert s3.keys() == before and list(staging.iterdir()) == []


@pytest.mark.parametrize("case", sorted(COMMANDS))
def test_a_src_inside_the_bucket_dst_is_refused(s3, capsys, staging, hf_src, case):
    """SRC below DST: DST the prefix above SRC, and the bucket's top level (which holds every prefix)."""
    name = COMMANDS[case][2]  # --to torch: DST is the object runs/model.pt, so SRC lies below that name
    url = upload(s3, fixture_of(case, hf_src), f"runs{name}/a")
    before = s3.keys()
    refused(capsys, argv(case, url, s3.url("runs")), f"SRC {url}", s3.url("runs") + name, "DST")
    if not name:  # the top level as DST (--to torch names an object there, which holds nothing)
        refused(capsys, argv(case, url, f"s3://{s3.bucket}"), f"SRC {url}", f"s3://{s3.bucket}", "DST")
    assert s3.keys() == before and list(staging.iterdir()) == []


@pytest.mark.parametrize("case", ["reshard", "export-hf"])
def test_a_sibling_prefix_with_the_same_start_is_not_inside(s3, capsys, staging, case):
    """``runs/a2`` does not lie below ``runs/a``: the write goes ahead (prefixes nest by components)."""
    url = upload(s3, SRC, "runs/a")
    code, out, err = ckpt(capsys, *argv(case, url, url + "2"))
    assert code == 0, (out, err)
    assert any(k.startswith("runs/a2/") for k in s3.keys())


@pytest.mark.parametrize("case", sorted(COMMANDS))
def test_a_local_dst_inside_a_local_src_is_refused(capsys, tmp_path, hf_src, case):
    """The folder rule, by the same function: below the run folder given, and below its iteration."""
    import shutil

    src = tmp_path / "src"
    shutil.copytree(fixture_of(case, hf_src), src)
    before = sorted(p for p in tmp_path.rglob("*"))
    for s, d in ((src, src / "out"), (Path(str(src) + iteration_of(case)), Path(f"{src}{iteration_of(case)}/out"))):
        refused(capsys, argv(case, str(s), str(d)), f"DST {d}{COMMANDS[case][2]}", str(s), "SRC")
    assert sorted(p for p in tmp_path.rglob("*")) == before


# -- the rule, against a brute-force reference --------------------------------------------------------------

COMPONENT = st.sampled_from(["a", "a2", "ab", "b", "run", "run2", "iter_0000002", "x.y", "model.pt"])
PREFIX = st.lists(COMPONENT, max_size=4).map("/".join)


def reference(inner: list[str], outer: list[str]) -> bool:
    """``inner`` is ``outer`` or below it: ``outer``'s components are the first ones of ``inner``'s,
    compared one by one (no string prefix test)."""
    if len(outer) > len(inner):
        return False
    return all(inner[i] == outer[i] for i in range(len(outer)))


def components(prefix: str) -> list[str]:
    return prefix.split("/") if prefix else []


@settings(max_examples=400, deadline=None)
@given(a=PREFIX, b=PREFIX, same_bucket=st.booleans())
def test_bucket_prefixes_nest_component_wise(a, b, same_bucket):
    inner = ObjectURL("s3", "bucket", a)
    outer = ObjectURL("s3", "bucket" if same_bucket else "bucket2", b)
    assert within(inner, outer) == (same_bucket and reference(components(a), components(b)))
    # as the CLI parses them, too
    assert within(parse_location(str(inner)), parse_location(str(outer))) == within(inner, outer)


@settings(max_examples=200, deadline=None)
@given(a=PREFIX, b=PREFIX)
def test_folders_nest_component_wise_and_never_with_a_bucket(tmp_path_factory, a, b):
    root = Path(os.path.realpath(tmp_path_factory.getbasetemp()))
    inner, outer = root.joinpath(*components(a)), root.joinpath(*components(b))
    assert within(inner, outer) == reference(components(a), components(b))
    url = ObjectURL("s3", "bucket", a)
    assert not within(url, outer) and not within(inner, url)


def test_a_symlinked_folder_nests_by_what_it_points_to(tmp_path):
    (tmp_path / "real" / "run").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert within(tmp_path / "link" / "run" / "out", tmp_path / "real" / "run")
    assert within(tmp_path / "real" / "run", tmp_path / "link")
    assert not within(tmp_path / "link" / "run2", tmp_path / "real" / "run")
