"""``verify-roundtrip PATH`` never opens the data path a checkpoint records (issue 22, class 2).

The manifest's ``data_position.path`` used to become the ranks' ``--data-path``: every rank opened
it, outside the checkpoint, before any fingerprint was compared, and the error line printed the
file's size. Now the recorded fingerprint stands in for the data
(:class:`gtp_runtime.data.source.RecordedData`): the round trip of a checkpoint trained on data
that is not there, or whose recorded path names a FIFO or a 16 TiB sparse file, passes without
opening it, and nothing about that file reaches the output.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from cli_helpers import cli, snapshot

from gtp_format.manifest import read_manifest
from gtp_format.names import DATA_POSITION_KEY
from gtp_runtime.checkpoint.run_state import run_configs
from gtp_runtime.data import source
from gtp_runtime.data.indexed import DataError

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "fixtures" / "gtp" / "fold_cp2_g2_dp2_st"
FINGERPRINT = {"name": "corpus", "dtype": "uint16", "sequences": 120, "documents": 120, "tokens": 98304,
               "split": "98,2", "seed": 1234}


def _with_data_position(tmp_path: Path, data_path: str) -> Path:
    run = tmp_path / "run"
    shutil.copytree(SRC, run)
    path = run / "iter_0000002" / "gtp_manifest.json"
    doc = json.loads(path.read_text())
    doc[DATA_POSITION_KEY] = {"consumed_train_samples": 16, "path": data_path, "dataset": FINGERPRINT}
    path.write_text(json.dumps(doc))
    return run


def test_recorded_data_is_a_fingerprint_not_a_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = _with_data_position(tmp_path, str(tmp_path / "nowhere" / "corpus"))
    _, data = run_configs(read_manifest(run / "iter_0000002"))
    assert data.path == str(tmp_path / "nowhere" / "corpus") and dict(data.recorded) == FINGERPRINT

    def refuse(*a: object, **k: object) -> None:
        raise AssertionError("the recorded data path was opened")

    monkeypatch.setattr(source, "open_dataset", refuse)
    stand_in = source.open_source(data, 32, 256, 1234)
    assert stand_in.fingerprint() == FINGERPRINT
    with pytest.raises(DataError, match="reads no data"):
        stand_in.train_batch(0, 1)


@pytest.mark.parametrize("bad", [["not", "flat"], {f"k{i}": i for i in range(40)}])
def test_ill_formed_recorded_fingerprint_is_refused(tmp_path: Path, bad: object) -> None:
    from gtp_format.layout.config import ConfigError

    run = _with_data_position(tmp_path, "x")
    path = run / "iter_0000002" / "gtp_manifest.json"
    doc = json.loads(path.read_text())
    doc[DATA_POSITION_KEY]["dataset"] = {"name": bad} if isinstance(bad, list) else bad
    path.write_text(json.dumps(doc))
    with pytest.raises(ConfigError, match="data_position.dataset"):
        run_configs(read_manifest(run / "iter_0000002"))


@pytest.mark.slow
def test_roundtrip_never_opens_the_recorded_path(tmp_path: Path) -> None:
    """Real gloo ranks (4: the safetensors fixture at DP 1). The recorded path is a FIFO: any open
    for reading would block a rank forever, a stat would call it "not a regular file"; a second
    recorded file, a sparse 16 TiB one, would have leaked its size into the error line."""
    outside = tmp_path / "outside"
    outside.mkdir()
    os.mkfifo(outside / "corpus.bin")
    run = _with_data_position(tmp_path, str(outside / "corpus.bin"))
    before = snapshot(tmp_path)
    result = cli("verify-roundtrip", run, "--dp", "1", "--format", "json")
    assert result.exit_code == 0, (result.stdout[-3000:], result.stderr[-3000:])
    doc = json.loads(result.stdout)
    assert doc["ok"] and {c["check"]: c["ok"] for c in doc["checks"]}["manifest"]
    assert snapshot(tmp_path) == before
