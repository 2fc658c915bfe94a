"""Hostile lineage sections and attestations: forged parents, loops, huge chains, ids with control
characters, oversize strings, a forged root hash. Each is bounded (the manifest's and attestation's
bounded JSON readers; ids are fixed-length hex, strings capped) and refused in one line: ``ckpt log``
exit 2 for a section it cannot trust (exit 1 for a well-formed one that contradicts the records),
``inspect`` shows the rest with the refusal as a note, and ``--load``'s check refuses through the same
parser (:func:`gtp_format.check.lineage.resume_check`)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from cli_helpers import assert_error_line, cli

REPO = Path(__file__).resolve().parents[2]
FIXTURE = REPO / "fixtures" / "gtp" / "fold_cp2_g2_dp2"
ITER = "iter_0000002"


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A run folder whose iteration has chunk records and a lineage section (written by reshard)."""
    out = tmp_path_factory.mktemp("lineage") / "run"
    r = cli("reshard", str(FIXTURE), str(out), "--dp", "1")
    assert r.exit_code == 0, r.stderr
    return out


def edited(base: Path, tmp_path: Path, edit) -> Path:  # noqa: ANN001
    run = tmp_path / "run"
    shutil.copytree(base, run)
    path = run / ITER / "gtp_manifest.json"
    doc = json.loads(path.read_text())
    edit(doc["lineage"], doc)
    path.write_text(json.dumps(doc))
    return run


def nested(depth: int) -> dict:
    d: dict = {"via": "load"}
    for _ in range(depth):
        d = {"via": "load", "parent": d}
    return d


CASES = {
    "control-characters-in-run-id": (lambda lin, _: lin.update(run_id="\x1b[31m" + "a" * 27 + "\x07"), "run_id"),
    "forged-parent-root": (lambda lin, _: lin.update(parent={"run_id": lin["run_id"], "root_hash": "zz" * 32,
                                                             "iteration": 1, "via": "load"}), "parent.root_hash"),
    "parent-names-itself": (lambda lin, _: lin.update(parent={"run_id": lin["run_id"], "root_hash": lin["root_hash"],
                                                              "iteration": 1, "via": "load"}), "a loop"),
    "huge-chain": (lambda lin, _: lin.update(parent=nested(90)), "parent"),
    "oversize-id": (lambda lin, _: lin.update(run_id="a" * (1 << 20)), "run_id"),
    "unknown-via": (lambda lin, _: lin.update(parent={"via": "teleport"}), "parent.via"),
    "newer-version": (lambda lin, _: lin.update(version=99), "newer than this tool"),
    "not-an-object": (lambda lin, doc: doc.update(lineage=[1, 2]), "not an object"),
    "writer-with-escapes": (lambda lin, _: lin.update(writer="x\x1b]0;pwned\x07"), "writer"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_refused_in_one_line(base, tmp_path, case):
    edit, needle = CASES[case]
    run = edited(base, tmp_path, edit)
    r = cli("log", str(run))
    line = assert_error_line(r, 2, needle)
    assert "\x1b" not in r.stderr and "\x07" not in r.stderr and len(line) < 2100
    ins = cli("inspect", str(run), "--format", "json")
    assert ins.exit_code == 0, ins.stderr
    doc = json.loads(ins.stdout)
    assert doc["lineage"] is None and any(n["check"] == "lineage" for n in doc["notes"])
    from gtp_format.check.lineage import resume_check
    from gtp_format.errors import FormatError

    with pytest.raises(FormatError):
        resume_check(run, ITER, str(run))


def test_forged_root_hash_fails_the_log(base, tmp_path):
    run = edited(base, tmp_path, lambda lin, _: lin.update(root_hash="0" * 64))
    r = cli("log", str(run), "--format", "json")
    assert r.exit_code == 1
    assert "chunk records hash to" in json.loads(r.stdout)["iterations"][0]["problems"][0]


def test_parents_pointing_at_each_other(base, tmp_path):
    """Two iterations whose parents name each other (a loop across folders): the later one's parent is not
    older than itself, named; nothing follows the chain, so its length costs nothing."""
    run = tmp_path / "run"
    shutil.copytree(base, run)
    shutil.copytree(run / ITER, run / "iter_0000004")
    for it, other in ((2, 4), (4, 2)):
        path = run / f"iter_{it:07d}" / "gtp_manifest.json"
        doc = json.loads(path.read_text())
        doc["iteration"] = doc["lineage"]["iteration"] = it
        doc["lineage"]["parent"] = {"run_id": doc["lineage"]["run_id"], "root_hash": "ab" * 32, "iteration": other,
                                    "via": "load"}
        path.write_text(json.dumps(doc))
    (run / "latest_checkpointed_iteration.txt").write_text("4\n")
    r = cli("log", str(run), "--format", "json")
    assert r.exit_code == 1
    probs = json.loads(r.stdout)["iterations"][0]["problems"]
    assert any("not older than itself" in p for p in probs), probs


@pytest.mark.parametrize("bad", [{"version": 1, "command": "x\x1b", "tool": "t", "source": {}, "target": {}},
                                 {"version": 1, "command": "c", "tool": "t", "source": {"root_hash": "Z"},
                                  "target": {}},
                                 {"version": 1, "command": "c", "tool": "t", "source": {}, "target": {},
                                  "tensors": {"a": 1}},
                                 [1] * 10])
def test_hostile_attestation(base, tmp_path, bad):
    run = tmp_path / "run"
    shutil.copytree(base, run)
    (run / ITER / "gtp_attestation.json").write_text(json.dumps(bad))
    r = cli("log", str(run), "--format", "json")
    assert r.exit_code == 1 and "\x1b" not in r.stdout
    assert "attestation" in json.loads(r.stdout)["iterations"][0]["problems"][0]


@pytest.mark.parametrize("bad", ['{"version": 1, "command": "x\\u001b", "tool": "t", "source": {}, "target": {}}',
                                 '{"version": 1', "[" * 100000, '{"version": 2}'])
def test_hostile_attestation_beside_a_torch_file(tmp_path, bad):
    """``export --to torch``'s attestation beside its file: damaged or forged, one line naming it."""
    from gtp_format.errors import FormatError
    from gtp_format.lineage import read_file_attestation

    (tmp_path / "m.pt").write_bytes(b"")
    (tmp_path / "m.pt.gtp_attestation.json").write_text(bad)
    with pytest.raises(FormatError) as e:
        read_file_attestation(tmp_path / "m.pt")
    assert "m.pt.gtp_attestation.json" in e.value.message and "\n" not in e.value.message
    assert "\x1b" not in e.value.message
