"""JSON inputs bounded by what the input really stores, not by their byte size alone; problems capped.

Each case runs ``ckpt`` in a fresh process and measures its peak RSS (``os.wait4``) and time against
the same command on the genuine input: a crafted file may cost at most :data:`GROWTH_MB` more. On
main, a megatron-core ``integrity.json`` of a million bad entries took 2.3 GB and 77 s, a 96 MiB
safetensors header of empty tensors 1.5 GB in ``import``, a 64 MiB ``--tokenizer`` 740 MB.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
MEGATRON = REPO / "fixtures" / "megatron" / "cp2_dp2_dp_reshardable"
FOLD = REPO / "fixtures" / "gtp" / "fold_cp2_g2_dp2"
GROWTH_MB = 100
SECONDS = 30
# The child reports its own peak (VmHWM, of the memory it has since exec): ru_maxrss would carry the
# test process's own peak into a child started by vfork and exec.
_PROBE = """
import os, sys
from ckpt_tool.cli import run
try:
    code = run(sys.argv[1:])
finally:
    hwm = next(l for l in open("/proc/self/status") if l.startswith("VmHWM:"))
    open(os.environ["RSS_OUT"], "w").write(hwm.split()[1])
sys.exit(code)
"""


def _measured(*args: object, cwd: Path) -> dict:
    """``ckpt ARGS`` in a fresh interpreter: exit code, stdout, stderr, peak RSS (MB) and seconds."""
    out, err, rss = cwd / "stdout", cwd / "stderr", cwd / "rss"
    t0 = time.monotonic()
    with open(out, "wb") as o, open(err, "wb") as e:
        p = subprocess.run([sys.executable, "-c", _PROBE, *map(str, args)], cwd=REPO, stdout=o, stderr=e,
                           env={**os.environ, "PYTHONPATH": str(REPO), "RSS_OUT": str(rss)}, timeout=300, check=False)
    return {"code": p.returncode, "stdout": out.read_text(), "stderr": err.read_text(),
            "rss_mb": int(rss.read_text()) / 1024, "seconds": time.monotonic() - t0}


def _bounded(bad: dict, good: dict, code: int, *words: str) -> str:
    lines = bad["stderr"].strip().splitlines()
    assert bad["code"] == code and len(lines) == 1 and "Traceback" not in bad["stderr"], bad
    assert bad["rss_mb"] < good["rss_mb"] + GROWTH_MB, (bad["rss_mb"], good["rss_mb"])
    assert bad["seconds"] < SECONDS, bad["seconds"]
    for w in words:
        assert w in bad["stdout"] + lines[0], (w, lines[0], bad["stdout"][-2000:])
    return lines[0]


def _megatron_copy(tmp_path: Path) -> Path:
    folder = tmp_path / "ckpt"
    shutil.copytree(MEGATRON, folder)
    return next((p for p in folder.iterdir() if p.is_dir() and p.name.startswith("iter_")), folder)


def test_an_integrity_file_of_a_million_bad_entries(tmp_path: Path):
    inner = _megatron_copy(tmp_path)
    good = _measured("verify", inner, cwd=tmp_path)
    assert good["code"] == 0, good
    with open(inner / "integrity.json", "w") as f:  # ~60 MB: a million names outside the folder
        f.write('{"algorithm": "sha256", "files": {')
        f.write(",".join(f'"../x{i}": "{i:064x}"' for i in range(1_000_000)))
        f.write("}}")
    bad = _measured("verify", inner, "--format", "json", cwd=tmp_path)
    _bounded(bad, good, 1, "integrity.json")
    doc = json.loads(bad["stdout"])
    found = [p for p in doc["problems"] if p["check"] == "megatron_integrity"]
    assert 1 <= len(found) <= 101, len(found)


def test_an_integrity_file_listing_more_files_than_the_folder_holds(tmp_path: Path):
    inner = _megatron_copy(tmp_path)
    names = {f"x{i}.distcp": f"{i:064x}" for i in range(100)}  # small, well-formed, but more than the folder's files
    (inner / "integrity.json").write_text(json.dumps({"algorithm": "sha256", "files": names}))
    r = _measured("verify", inner, "--format", "json", cwd=tmp_path)
    found = [p for p in json.loads(r["stdout"])["problems"] if p["check"] == "megatron_integrity"]
    assert r["code"] == 1 and len(found) == 1 and "more than the" in found[0]["message"], found


def test_chunk_records_problems_are_capped_with_a_count_of_the_rest(tmp_path: Path):
    """A genuine Megatron folder with a planted side file of ill-formed records, one per chunk: at
    most 100 problems listed, then one line with how many more."""
    from gtp_format.integrity.records import read_records
    from gtp_format.model import MAX_PROBLEMS_PER_CHECK
    from gtp_format.reader.checkpoint import open_checkpoint

    folder = _megatron_copy(tmp_path)
    n = open_checkpoint(folder).chunk_count()
    assert n > MAX_PROBLEMS_PER_CHECK
    (folder / "gtp_chunks.json").write_text(json.dumps({"version": 1, "hash": "xxh3_128", "chunks": [{"key": 1}] * n}))
    problems = read_records(open_checkpoint(folder)).problems
    assert len(problems) == MAX_PROBLEMS_PER_CHECK + 1
    assert f"and {n - MAX_PROBLEMS_PER_CHECK:,} more" in problems[-1].message
    r = _measured("verify", folder, "--format", "json", cwd=tmp_path)
    assert r["code"] == 1 and len([p for p in json.loads(r["stdout"])["problems"]
                                   if p["check"] == "chunk_records"]) == MAX_PROBLEMS_PER_CHECK + 1


def test_chunk_records_of_more_values_than_the_chunks_can_need(tmp_path: Path):
    from gtp_format.integrity.records import read_records
    from gtp_format.reader.checkpoint import open_checkpoint

    sys.path.insert(0, str(REPO / "tests" / "helpers"))
    from cli_helpers import cli

    out = tmp_path / "fr"
    assert cli("export", FOLD, out, "--to", "fully_reshardable").exit_code == 0
    folder = next(out.glob("iter_*"))
    doc = json.loads((folder / "gtp_chunks.json").read_text())
    doc["pad"] = [0] * 10_000  # 20 KB of values in a file the byte limit allows
    (folder / "gtp_chunks.json").write_text(json.dumps(doc, separators=(",", ":")))
    (p,) = read_records(open_checkpoint(folder)).problems
    assert "JSON values" in p.message and "chunks" in p.message, p.message


# -- Hugging Face inputs ---------------------------------------------------------------------------

def _hf(tmp_path: Path) -> Path:
    transformers = pytest.importorskip("transformers")
    import torch

    torch.manual_seed(0)
    cfg = transformers.ArceeConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                   num_attention_heads=4, max_position_embeddings=16, hidden_act="gelu",
                                   bos_token_id=None, eos_token_id=None)
    transformers.ArceeForCausalLM(cfg).save_pretrained(tmp_path / "hf")
    return tmp_path / "hf"


def test_a_96_mib_header_of_empty_tensors_is_refused_before_it_is_parsed(tmp_path: Path):
    src = _hf(tmp_path)
    good = _measured("import", src, tmp_path / "good", cwd=tmp_path)
    assert good["code"] == 0, good
    entry = '"t%d":{"dtype":"F32","shape":[0],"data_offsets":[0,0]}'
    body = ("{" + ",".join(entry % i for i in range(1_600_000)) + "}").encode()  # ~95 MiB: under 100 MiB
    body += b" " * (-len(body) % 8)
    (src / "model.safetensors").write_bytes(len(body).to_bytes(8, "little") + body)
    bad = _measured("import", src, tmp_path / "out", cwd=tmp_path)
    _bounded(bad, good, 2, "model.safetensors", "header")
    assert not (tmp_path / "out").exists()


def test_a_config_of_short_values_is_refused_by_its_value_budget(tmp_path: Path):
    src = _hf(tmp_path)
    cfg = json.loads((src / "config.json").read_text())
    cfg["pad"] = [0] * 400_000  # 800 KB: under the byte limit, 400k values no config needs
    (src / "config.json").write_text(json.dumps(cfg, separators=(",", ":")))
    good = {"rss_mb": _measured("inspect", FOLD, cwd=tmp_path)["rss_mb"] + 400}  # import loads torch
    bad = _measured("import", src, tmp_path / "out", cwd=tmp_path)
    _bounded(bad, good, 2, "config.json", "JSON values")


def test_a_tokenizer_larger_than_the_vocabulary_can_need(tmp_path: Path):
    tok = tmp_path / "big.tokenizer.json"
    with open(tok, "w") as f:  # ~60 MB (under the old 64 MiB cap) of vocabulary for a model of 128 tokens
        f.write('{"model": {"vocab": {')
        f.write(",".join(f'"t{i}": 1' for i in range(4_500_000)))
        f.write("}}}")
    good = _measured("export", FOLD, tmp_path / "good", "--to", "hf", cwd=tmp_path)
    assert good["code"] == 0, good
    bad = _measured("export", FOLD, tmp_path / "out", "--to", "hf", "--tokenizer", tok, cwd=tmp_path)
    _bounded(bad, good, 2, "big.tokenizer.json")
    assert not (tmp_path / "out").exists()


def test_a_manifest_larger_than_its_checkpoint_can_need(tmp_path: Path):
    """A 12 MB manifest (under the 16 MiB cap) on a checkpoint storing under 1 MB: refused by the budget
    the data files give (1 MiB + 1/16 of their stored bytes), not parsed."""
    folder = tmp_path / "c"
    shutil.copytree(FOLD, folder)
    inner = next(folder.glob("iter_*"))
    good = _measured("verify", inner, cwd=tmp_path)
    doc = json.loads((inner / "gtp_manifest.json").read_text())
    doc["notes"] = [[0] * 1000] * 6000  # short values: ~12 MB of text, ~6M values parsed
    (inner / "gtp_manifest.json").write_text(json.dumps(doc, separators=(",", ":")))
    bad = _measured("verify", inner, cwd=tmp_path)
    _bounded(bad, good, 2, "gtp_manifest.json", "limit")
