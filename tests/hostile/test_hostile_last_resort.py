"""Inputs that reached a last-resort line or a traceback, and the per-expert names ``show`` refused.

Each case: the right exit code, exactly one error line, no traceback, no "unexpected" (the
last-resort handler's word). The classes: a file cut while it is read (never memory-mapped), a
manifest shape with no dimension, numbers from flags and the environment that are not ASCII,
finite and bounded (``--split nan``, ``--tp`` in Arabic-Indic digits, a rank count of 10^12, a
timeout in another script's digits), JSON text holding a lone surrogate.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO / "tests" / "helpers"))

from cli_helpers import cli  # noqa: E402

FOLD = REPO / "fixtures" / "gtp" / "fold_cp2_g2_dp2"
MOE = REPO / "fixtures" / "megatron" / "moe_ep2_dp4_dp_reshardable"
TRAIN = [sys.executable, "-m", "gtp_runtime.train", "--device", "cpu", "--steps", "1"]


def _run(argv: list[str], env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})}, check=False)


def _one_line(r: subprocess.CompletedProcess, code: int, *words: str) -> str:
    lines = r.stderr.strip().splitlines()
    assert r.returncode == code and len(lines) == 1, (r.returncode, r.stderr[-3000:], r.stdout[-500:])
    assert "Traceback" not in r.stderr + r.stdout and "unexpected" not in lines[0], lines[0]
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]


# -- a file cut while import reads it --------------------------------------------------------------

_CUT = """
import sys
from ckpt_tool.hf import folder
from ckpt_tool.cli import run
real = folder._header
def header(path):
    out = real(path)
    with open(path, "r+b") as f:  # the file is cut after its header was checked, before its data is read
        f.truncate(f.seek(0, 2) // 2)
    return out
folder._header = header
sys.exit(run(sys.argv[1:]))
"""


def test_a_safetensors_file_cut_during_import_is_one_line(tmp_path: Path):
    transformers = pytest.importorskip("transformers")
    import torch

    torch.manual_seed(0)
    cfg = transformers.ArceeConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                   num_attention_heads=4, max_position_embeddings=16, hidden_act="gelu",
                                   bos_token_id=None, eos_token_id=None)
    transformers.ArceeForCausalLM(cfg).save_pretrained(tmp_path / "hf")
    r = _run([sys.executable, "-c", _CUT, "import", str(tmp_path / "hf"), str(tmp_path / "out"), "--from", "hf"])
    line = _one_line(r, 2, "model.safetensors")
    assert "shrank" in line or "past" in line or "end" in line, line
    assert not (tmp_path / "out").exists()


# -- a manifest shape with no dimension ------------------------------------------------------------

@pytest.mark.parametrize("field", ["full_shape", "local_shape", "global_shape"])
def test_a_manifest_shape_that_is_empty(tmp_path: Path, field: str):
    folder = tmp_path / "c"
    shutil.copytree(FOLD, folder)
    path = next(folder.glob("iter_*/gtp_manifest.json"))
    doc = json.loads(path.read_text())
    doc["buffers"][0]["buckets"][0]["params"][0][field] = []
    path.write_text(json.dumps(doc))
    for argv in (["inspect", folder, "--params"], ["reshard", folder, tmp_path / "o", "--dp", "4"],
                 ["export", folder, tmp_path / "o.pt", "--to", "torch"]):
        r = cli(*argv)
        assert r.exit_code in (1, 2) and len(r.stderr.strip().splitlines()) == 1, (argv, r.stderr)
        assert "unexpected" not in r.stderr and (field in r.stderr or "manifest" in r.stderr), r.stderr
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.pt").exists()


# -- numbers from flags and the environment --------------------------------------------------------

@pytest.mark.parametrize("flags,words", [
    (["--split", "nan,1"], ["--split"]),
    (["--split", "inf,1"], ["--split"]),
    (["--split", "1e999,1"], ["--split"]),
    (["--tp", "\u0662"], ["--tp", "ASCII"]),
    (["--lr", "nan"], ["--lr", "finite"]),
    (["--steps", "9" * 40], ["--steps"]),
    (["--nproc-per-node", str(10**12)], ["local ranks", "--nproc-per-node"]),
    (["--dp", str(10**11)], ["local ranks"]),
])
def test_launcher_numbers_are_ascii_finite_and_bounded(flags: list[str], words: list[str]):
    _one_line(_run(TRAIN + flags), 2, *words)


@pytest.mark.parametrize("var", ["GTP_GATHER_BATCH", "GTP_KEEP_LAST"])
def test_a_tuning_variable_in_other_digits_is_refused_before_any_rank(var: str):
    _one_line(_run(TRAIN, {var: "\u0662"}), 2, var, "ASCII")


def test_timeouts_and_limits_from_the_environment_take_ascii_digits_only(monkeypatch):
    from gtp_format.errors import FormatError
    from gtp_format.reader.storage import METADATA_LIMIT_ENV, metadata_limit
    from gtp_format.storage import limits, objects
    from gtp_runtime import launch

    for value in ("\u0666\u0660", "\uff16\uff10", "nan", "inf", "1e999"):
        monkeypatch.setenv(launch.TIMEOUT_ENV, value)
        with pytest.raises(launch.LaunchError, match=launch.TIMEOUT_ENV):
            launch.timeout_s()
        monkeypatch.setenv(objects.TIMEOUT_ENV, value)
        with pytest.raises(FormatError, match=objects.TIMEOUT_ENV):
            limits.s3_timeout()
        monkeypatch.setenv(METADATA_LIMIT_ENV, value)
        with pytest.raises(FormatError, match=METADATA_LIMIT_ENV):
            metadata_limit(0)
    monkeypatch.setenv(launch.TIMEOUT_ENV, "30")
    assert launch.timeout_s() == 30.0


def test_prepare_refuses_a_lone_surrogate_in_one_line(tmp_path: Path):
    src = tmp_path / "t.jsonl"
    src.write_text('{"text": "fine"}\n{"text": "a \\ud800 b"}\n')
    r = _run([sys.executable, "-m", "gtp_runtime.data", "prepare", "--input", str(src), "--jsonl",
              "--output-prefix", str(tmp_path / "out")])
    _one_line(r, 2, "t.jsonl:2", "surrogate")
    assert not list(tmp_path.glob("out*"))
    r = _run([sys.executable, "-m", "gtp_runtime.data", "prepare", "--input", str(src), "--jsonl",
              "--output-prefix", str(tmp_path / "out"), "--vocab-size", "\u0665\u0660\u0660"])
    _one_line(r, 2, "--vocab-size", "ASCII")


# -- show takes every name inspect --params prints --------------------------------------------------

def test_show_takes_the_per_expert_names_inspect_prints():
    import torch

    doc = json.loads(cli("inspect", MOE, "--params", "--format", "json").stdout)
    rows = doc["params"] if isinstance(doc, dict) else doc
    experts = [r for r in rows if ".mlp.experts." in r["name"]]
    assert experts
    for r in experts:
        got = cli("show", MOE, r["name"], "--values", "--format", "json")
        assert got.exit_code == 0, (r["name"], got.stderr)
        mine = json.loads(got.stdout)
        layer, expert = int(r["name"].split(".")[2]), int(r["name"].split(".")[5])
        whole = json.loads(cli("show", MOE, r["key"], "--slice", f"{layer}:{layer + 1}", "--values",
                               "--format", "json").stdout)
        assert mine["key"] == r["key"] and mine["shape"][2:] == r["full_shape"]
        assert torch.equal(torch.tensor(mine["values"])[0, 0], torch.tensor(whole["values"])[0, expert]), r["name"]
    r = cli("show", MOE, "decoder.layers.0.mlp.experts.99.linear_fc1.weight")
    assert r.exit_code == 2 and len(r.stderr.strip().splitlines()) == 1
