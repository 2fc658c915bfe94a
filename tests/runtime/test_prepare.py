"""``python -m gtp_runtime.data prepare``: text files to an indexed dataset our reader (and the trainer) takes."""

from __future__ import annotations

import json
import subprocess
import sys

import launcher_cases as lc
import numpy as np

from gtp_runtime.data.corpus import stdlib_files
from gtp_runtime.data.indexed import read_index
from gtp_runtime.data.prepare import main


def _docs(ds):
    return [ds.tokens[s : s + n].tolist() for s, n in zip(ds.starts, ds.lengths)]


def test_byte_tokens_one_document_per_file(tmp_path):
    (tmp_path / "in").mkdir()
    texts = {"a.txt": "héllo\n", "b.txt": "x = 1\0y\n", "c.md": "# not matched\n"}
    for name, t in texts.items():
        (tmp_path / "in" / name).write_text(t, encoding="utf-8")
    assert main(["--input", str(tmp_path / "in"), "--glob", "*.txt", "--output-prefix", str(tmp_path / "out")]) == 0
    ds = read_index(tmp_path / "out")
    assert str(ds.tokens.dtype) == "uint8" and ds.num_documents == 2
    assert _docs(ds) == [list("héllo\n".encode()) + [0], list(b"x = 1y\n") + [0]]  # NUL is the EOD, so dropped


def test_jsonl_and_bad_lines(tmp_path, capsys):
    (tmp_path / "c.jsonl").write_text(json.dumps({"text": "one"}) + "\n\n" + json.dumps({"text": "two"}) + "\n")
    assert main(["--input", str(tmp_path / "c.jsonl"), "--jsonl", "--output-prefix", str(tmp_path / "j")]) == 0
    assert _docs(read_index(tmp_path / "j")) == [list(b"one\0"), list(b"two\0")]
    (tmp_path / "bad.jsonl").write_text('{"txt": 1}\n')
    capsys.readouterr()
    assert main(["--input", str(tmp_path / "bad.jsonl"), "--jsonl", "--output-prefix", str(tmp_path / "k")]) == 2
    err = capsys.readouterr().err
    assert "bad.jsonl:1" in err and "'text'" in err
    assert not (tmp_path / "k.idx").exists()  # nothing half-written


def test_bpe_trained_locally_round_trips(tmp_path):
    from tokenizers import Tokenizer

    files = stdlib_files()[:25]
    prefix = tmp_path / "bpe"
    assert main(["--input", *map(str, files), "--output-prefix", str(prefix), "--tokenizer", "bpe",
                 "--vocab-size", "600"]) == 0
    tok = Tokenizer.from_file(str(prefix) + ".tokenizer.json")
    ds = read_index(prefix)
    assert ds.num_documents == 25 and str(ds.tokens.dtype) == "uint16"
    assert int(np.asarray(ds.tokens).max()) < tok.get_vocab_size() <= 600
    first = _docs(ds)[0]
    assert first[-1] == tok.token_to_id("<|endoftext|>") == 0
    assert tok.decode(first[:-1]) == files[0].read_text(encoding="utf-8", errors="replace")
    assert ds.num_tokens < sum(len(f.read_bytes()) for f in files) / 2  # it compresses: real merges


def test_no_input_is_one_line_exit_2(tmp_path):
    p = subprocess.run([sys.executable, "scripts/prepare_data.py", "--input", str(tmp_path / "none*"),
                        "--output-prefix", str(tmp_path / "o")], cwd=lc.REPO, env=lc.env(), capture_output=True,
                       text=True)
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "no input files match" in p.stderr
    p = subprocess.run([sys.executable, "-m", "gtp_runtime.data", "prepare", "--help"], cwd=lc.REPO, env=lc.env(),
                       capture_output=True, text=True)
    assert p.returncode == 0 and "examples:" in p.stdout
