"""``prepare`` on bad input (issue 22, class 7): one line naming the file and the fix, exit 2, no
traceback, nothing written; and what a good run reports (documents, tokens) and keeps (an existing
dataset unless ``--force``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import launcher_cases as lc
import pytest

from gtp_runtime.data import prepare as prep
from gtp_runtime.data.indexed import read_index


def _run(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = prep.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _one_error(code: int, err: str, *needles: str) -> None:
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    for n in needles:
        assert n in lines[0], (n, lines[0])


def _outputs(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".idx", ".json", ".tmp")
                  or p.name.startswith("."))


@pytest.mark.parametrize(("name", "content", "jsonl", "needles"), [
    ("empty.txt", b"", False, ["no documents in 1 input file", "check --input"]),
    ("blank.jsonl", b"\n  \n", True, ["no documents in 1 input file"]),
    ("binary.dat", bytes(range(128, 256)) * 8, False, ["binary.dat: not UTF-8 text", "convert it to UTF-8"]),
    ("latin1.jsonl", b'{"text": "caf\xe9"}\n', True, ["latin1.jsonl:1: not UTF-8 text"]),
    ("prose.txt", b"just words\n", True, ["prose.txt:1: not a JSON object with a 'text' field", "drop --jsonl"]),
    ("list.jsonl", b"[1, 2]\n", True, ["list.jsonl:1: not a JSON object"]),
    ("num.jsonl", b'{"text": 5}\n', True, ["num.jsonl:1: 'text' must be a string, got int"]),
    ("deep.jsonl", b'{"text": ' + b"[" * 100000 + b"]" * 100000 + b"}\n", True, ["deep.jsonl:1:"]),
])
def test_bad_input_file_is_one_line_naming_it(tmp_path: Path, capsys: pytest.CaptureFixture, name: str,
                                              content: bytes, jsonl: bool, needles: list[str]) -> None:
    (tmp_path / name).write_bytes(content)
    code, out, err = _run(capsys, "--input", str(tmp_path / name), *(["--jsonl"] if jsonl else []),
                          "--output-prefix", str(tmp_path / "out"))
    _one_error(code, err, *needles)
    assert out == "" and _outputs(tmp_path) == []


@pytest.mark.parametrize("jsonl", [False, True])
def test_a_huge_document_is_refused_before_it_is_read_whole(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                            monkeypatch: pytest.MonkeyPatch, jsonl: bool) -> None:
    monkeypatch.setattr(prep, "MAX_DOCUMENT_BYTES", 1000)
    line = json.dumps({"text": "x" * 5000}) + "\n" if jsonl else "x" * 5000
    (tmp_path / "big").write_text(json.dumps({"text": "ok"}) + "\n" + line if jsonl else line)
    code, _, err = _run(capsys, "--input", str(tmp_path / "big"), *(["--jsonl"] if jsonl else []),
                        "--output-prefix", str(tmp_path / "out"))
    _one_error(code, err, "big:2: a document over" if jsonl else "big: a document over", "split it")
    assert _outputs(tmp_path) == []


def test_an_unreadable_file_is_named(tmp_path: Path, capsys: pytest.CaptureFixture,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "secret.txt").write_text("hello")

    def refuse(path: object, mode: str = "r") -> object:  # root reads a mode-000 file, so refuse here
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(prep, "open", refuse, raising=False)
    code, _, err = _run(capsys, "--input", str(tmp_path / "secret.txt"), "--output-prefix", str(tmp_path / "out"))
    _one_error(code, err, f"cannot read {tmp_path / 'secret.txt'}: Permission denied", "fix its permissions")


def test_a_missing_tokenizer_package_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "a.txt").write_text("hello world\n")
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import raises ImportError
    code, _, err = _run(capsys, "--input", str(tmp_path / "a.txt"), "--tokenizer", "bpe", "--vocab-size", "300",
                        "--output-prefix", str(tmp_path / "out"))
    _one_error(code, err, "--tokenizer bpe needs HF tokenizers", "pip install tokenizers")
    assert _outputs(tmp_path) == []


@pytest.mark.parametrize(("prefix", "needles"), [
    ("afile/x", ["afile is a file, not a folder", "choose another prefix"]),
    ("afile/deeper/x", ["afile is a file, not a folder"]),
    (".", ["a folder, not a file prefix"]),
    ("adir", ["a folder, not a file prefix"]),
    ("clash", ["clash.bin is a folder"]),
])
def test_an_output_that_cannot_be_written_is_refused_first(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                           monkeypatch: pytest.MonkeyPatch, prefix: str,
                                                           needles: list[str]) -> None:
    (tmp_path / "a.txt").write_text("hello\n")
    (tmp_path / "afile").write_text("not a folder")
    (tmp_path / "adir").mkdir()
    (tmp_path / "clash.bin").mkdir()
    monkeypatch.chdir(tmp_path)
    code, _, err = _run(capsys, "--input", "a.txt", "--output-prefix", prefix, "--force")
    _one_error(code, err, *needles)
    assert (tmp_path / "afile").read_text() == "not a folder"


def test_reports_documents_and_tokens_and_keeps_an_existing_dataset(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(200))
                                      + json.dumps({"text": ""}) + "\n")
    out = tmp_path / "d"
    code, stdout, _ = _run(capsys, "--input", str(tmp_path / "c.jsonl"), "--jsonl", "--output-prefix", str(out))
    ds = read_index(out)
    assert code == 0 and ds.num_documents == 200
    assert f"200 documents from 1 file, {ds.num_tokens} tokens" in stdout and "skipped 1 empty" in stdout, stdout
    before = (out.with_suffix(".bin").read_bytes(), out.with_suffix(".idx").read_bytes())
    (tmp_path / "other.txt").write_text("something else entirely\n")
    code, _, err = _run(capsys, "--input", str(tmp_path / "other.txt"), "--output-prefix", str(out))
    _one_error(code, err, f"{out}.bin exists", "pass --force")
    assert (out.with_suffix(".bin").read_bytes(), out.with_suffix(".idx").read_bytes()) == before
    code, stdout, _ = _run(capsys, "--input", str(tmp_path / "other.txt"), "--output-prefix", str(out), "--force")
    assert code == 0 and "1 document from 1 file" in stdout and read_index(out).num_documents == 1


def test_module_help_and_usage() -> None:
    ok = subprocess.run([sys.executable, "-m", "gtp_runtime.data", "--help"], cwd=lc.REPO, env=lc.env(),
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and "prepare" in ok.stdout and "examples:" in ok.stdout, ok.stderr
    bare = subprocess.run([sys.executable, "-m", "gtp_runtime.data"], cwd=lc.REPO, env=lc.env(),
                          capture_output=True, text=True, timeout=120)
    assert bare.returncode == 2 and "prepare" in bare.stderr
    sub = subprocess.run([sys.executable, "-m", "gtp_runtime.data", "prepare", "--help"], cwd=lc.REPO, env=lc.env(),
                         capture_output=True, text=True, timeout=120)
    assert sub.returncode == 0 and "--force" in sub.stdout and "(default: byte)" in sub.stdout
