"""A copy whose source has a data file of holes under a matching manifest: refused without reading them.

The hostile corpus ran this file only through ``verify --data`` (which refuses sparse files before
reading); run through ``export`` (first from a bucket, then on the folder it was uploaded from), the
integrity ledger's background fill hashed the 16 TiB of holes and the export did not end. Every copy
(export, reshard) checks its source through the ledger, so the ledger refuses the file itself.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))

from sparse_files import grow_sparse  # noqa: E402

from ckpt_tool.cli import run  # noqa: E402

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "gtp" / "fold_cp2_g2_dp2"


@pytest.mark.parametrize("argv", [["export", "--to", "hf"], ["export", "--to", "fully_reshardable"],
                                  ["export", "--to", "torch"]])
def test_a_copy_refuses_a_source_of_holes_in_bounded_time(tmp_path, capsys, argv):
    src = tmp_path / "ckpt"
    shutil.copytree(FIXTURE, src)
    it = next(src.glob("iter_*"))
    size = grow_sparse(it / "__0_0.distcp", 16 << 40)
    man = it / "gtp_manifest.json"
    doc = json.loads(man.read_text())
    doc["files"]["__0_0.distcp"]["size"] = size  # the size matches: only the stored bytes give it away
    man.write_text(json.dumps(doc))
    t = time.monotonic()
    code = run([argv[0], str(src), str(tmp_path / "out"), *argv[1:]])
    err = capsys.readouterr().err
    assert time.monotonic() - t < 60
    assert code in (1, 2), err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "__0_0.distcp" in lines[0] and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()
