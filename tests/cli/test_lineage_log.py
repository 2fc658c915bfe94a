"""``ckpt log`` without the runtime: megatron-core run folders (no manifest: what it could not check is said,
``integrity.json`` digests compared where present), a fault case (an iteration left unfinished, the marker
naming it), usage errors, and no torch import. Real runs: ``tests/runtime/test_lineage.py``."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from cli_helpers import assert_error_line, cli, run_fresh

REPO = Path(__file__).resolve().parents[2]
MEGATRON = REPO / "fixtures" / "megatron" / "cp2_dp2_dp_reshardable"
OURS = REPO / "fixtures" / "gtp" / "fold_cp2_g2_dp2"


def with_integrity(folder: Path) -> None:
    """megatron-core's ``verify_integrity`` file: SHA-256 of every top-level file."""
    files = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}
    (folder / "integrity.json").write_text(json.dumps({"algorithm": "sha256", "files": files}))


def megatron_run(tmp_path: Path, integrity: bool) -> Path:
    run = tmp_path / "mcore"
    run.mkdir()
    shutil.copytree(MEGATRON / "iter_0000002", run / "iter_0000002")
    shutil.copytree(MEGATRON / "iter_0000002", run / "iter_0000004")  # the same state under a later step
    if integrity:
        for it in ("iter_0000002", "iter_0000004"):
            with_integrity(run / it)
    (run / "latest_checkpointed_iteration.txt").write_text("4\n")
    return run


def test_megatron_without_integrity_says_what_it_could_not_check(tmp_path):
    """The iteration, data position, step counter and RNG come from the byte objects, decoded inertly: the copy
    under a later name still records iteration 2; its content is not compared (no records, no integrity.json)."""
    r = cli("log", str(megatron_run(tmp_path, integrity=False)), "--format", "json")
    assert r.exit_code == 1, r.stdout
    doc = json.loads(r.stdout)
    first, copy = doc["iterations"]
    assert (first["recorded_iteration"], first["consumed_samples"], first["step"]) == (2, 16, 2)
    assert first["problems"] == []
    assert copy["problems"] == ["records iteration 2 but its folder name says 4 (copied or renamed?)"]
    assert any("content not compared" in n for n in copy["notes"])
    assert any("torch/CUDA generator tensors not read" in n for n in copy["notes"])
    assert copy["changed"] == {"weights": "n/a", "masters": "n/a", "moments": "n/a", "step": "unchanged",
                               "rng": "unchanged", "data": "unchanged"}


def test_megatron_data_position_going_back_and_rng_changing(tmp_path):
    """Two genuine megatron-core saves in one folder: 32 samples consumed (global batch 16), then 16 under a later
    name: named; their RNG states differ (another seed layout), so the column says changed."""
    run = tmp_path / "mcore"
    run.mkdir()
    shutil.copytree(REPO / "fixtures" / "megatron" / "moe_ep2_dp4_dp_reshardable" / "iter_0000002",
                    run / "iter_0000002")
    shutil.copytree(REPO / "fixtures" / "megatron" / "pp2_dp2_dp_reshardable" / "iter_0000002", run / "iter_0000004")
    (run / "latest_checkpointed_iteration.txt").write_text("4\n")
    r = cli("log", str(run), "--format", "json")
    assert r.exit_code == 1, r.stdout
    e = json.loads(r.stdout)["iterations"][1]
    assert "consumed samples went back from 32 to 16" in e["problems"], e["problems"]
    assert e["changed"]["rng"] == "changed" and e["changed"]["step"] == "unchanged"


def test_megatron_damaged_rng_object_is_a_note_not_a_crash(tmp_path):
    """Every rng_state blob overwritten whole: nothing decodes, the log says so and goes on."""
    from gtp_format.reader.checkpoint import open_checkpoint

    run = megatron_run(tmp_path, integrity=False)
    folder = run / "iter_0000004"
    ckpt = open_checkpoint(folder)
    for key, entry in ckpt.entries.items():
        if key.startswith("rng_state/"):
            c = entry.chunks[0].storage
            with open(folder / c.file, "r+b") as f:
                f.seek(c.offset)
                f.write(b"\xff" * c.length)
    r = cli("log", str(run), "--format", "json")
    assert r.exit_code == 1 and "Traceback" not in r.output, r.output
    e = json.loads(r.stdout)["iterations"][1]
    assert any("no rng_state ckpt can decode" in n for n in e["notes"]) and e["changed"]["rng"] == "n/a"


def test_megatron_integrity_digests_catch_a_repeated_state(tmp_path):
    r = cli("log", str(megatron_run(tmp_path, integrity=True)), "--format", "json")
    assert r.exit_code == 1, r.stdout
    it = json.loads(r.stdout)["iterations"]
    assert it[0]["problems"] == [] and any("stale save" in p for p in it[1]["problems"]), it[1]["problems"]
    assert any("integrity.json file digests" in n for n in it[1]["notes"])


def test_old_checkpoint_without_lineage_is_readable(tmp_path):
    r = cli("log", str(OURS), "--format", "json")
    assert r.exit_code == 0, r.stdout
    e = json.loads(r.stdout)["iterations"][0]
    assert e["run_id"] is None and any("no lineage section" in n for n in e["notes"])
    ins = json.loads(cli("inspect", str(OURS), "--format", "json").stdout)
    assert ins["lineage"] is None and ins["attestation"] is None


def test_unfinished_iteration_named_by_the_marker(tmp_path):
    """Fault case: a save that died before its commit object (``metadata.json``, written last) and a marker
    that names it anyway: the iteration is skipped as incomplete and the marker is the problem."""
    run = tmp_path / "run"
    r = cli("reshard", str(OURS), str(run), "--dp", "1")
    assert r.exit_code == 0, r.stderr
    shutil.copytree(run / "iter_0000002", run / "iter_0000004")
    (run / "iter_0000004" / "metadata.json").unlink()
    (run / "latest_checkpointed_iteration.txt").write_text("4\n")
    r = cli("log", str(run), "--format", "json")
    assert r.exit_code == 1
    doc = json.loads(r.stdout)
    assert doc["iterations"][1]["complete"] is False
    assert "names iteration 4, which is incomplete" in doc["problems"][0]
    table = cli("log", str(run))
    assert table.exit_code == 1 and "incomplete" in table.stdout


@pytest.mark.parametrize("where,needles", [
    ("iter", ["holds no iter_* folders", "pass its parent"]),
    ("missing", ["does not exist"]),
])
def test_usage_errors_are_one_line(tmp_path, where, needles):
    path = OURS / "iter_0000002" if where == "iter" else tmp_path / "nope"
    assert_error_line(cli("log", str(path)), 2, *needles)


def test_log_does_not_import_torch():
    res = run_fresh("log", str(OURS))
    assert res == {"code": 0, "torch": False}


def test_moments_all_zero_past_step_zero(tmp_path):
    """An import without optimizer state has every moment at zero at step 0 (fine); the same state claiming a
    later step is optimizer state that restarted. The zero counts come from the chunk records' statistics."""
    r = cli("export", str(OURS), str(tmp_path / "hf"), "--to", "hf")
    assert r.exit_code == 0, r.stderr
    run = tmp_path / "imp"
    r = cli("import", str(tmp_path / "hf"), str(run), "--from", "hf", "--cp", "2", "--fold-cp")
    assert r.exit_code == 0, r.stderr
    assert cli("log", str(run)).exit_code == 0
    path = run / "iter_0000000" / "gtp_manifest.json"
    doc = json.loads(path.read_text())
    doc["optimizer"]["step"] = 5
    path.write_text(json.dumps(doc))
    r = cli("log", str(run), "--format", "json")
    assert r.exit_code == 1
    assert "every optimizer moment is zero at step 5" in json.loads(r.stdout)["iterations"][0]["problems"][0]
