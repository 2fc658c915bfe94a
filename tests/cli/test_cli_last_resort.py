"""One line on stderr whatever happens: usage errors, unexpected exceptions, hostile text."""

from __future__ import annotations

import errno

import pytest

from ckpt_tool import cli, output


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.run(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("argv", [["inspect"], ["inspect", "--bogus", "x"], ["nope"],
                                  ["verify", "--format", "xml", "x"]])
def test_usage_errors_are_one_line(capsys, argv):
    code, _, err = _run(capsys, *argv)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ckpt: error: "), err
    assert "╭" not in err and "Traceback" not in err


def test_unexpected_exception_is_one_line(capsys, monkeypatch, tmp_path):
    import gtp_format.reader.locate as locate

    def boom(*a, **k):
        raise ValueError("Exceeds the limit (4300 digits) for integer string conversion\nsecond line")

    monkeypatch.setattr(locate, "list_dir", boom)
    (tmp_path / "x").mkdir()
    code, _, err = _run(capsys, "inspect", str(tmp_path / "x"))
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "unexpected ValueError" in lines[0], err


def test_recursion_error_is_one_line(capsys, monkeypatch, tmp_path):
    import gtp_format.reader.locate as locate

    def deep(*a, **k):
        return deep()

    monkeypatch.setattr(locate, "list_dir", deep)
    (tmp_path / "x").mkdir()
    code, _, err = _run(capsys, "inspect", str(tmp_path / "x"))
    assert code == 2 and len(err.strip().splitlines()) == 1 and "RecursionError" in err


def test_error_line_escapes_terminal_controls(capsys, tmp_path):
    bad = tmp_path / "a\x1b]0;owned\x07\u202e\x1b[2Kall checks OK"
    code, _, err = _run(capsys, "inspect", str(bad))
    assert code == 2
    assert "\x1b" not in err and "\u202e" not in err and "\x07" not in err
    assert "\\x1b]0;owned\\x07\\u202e" in err


def test_tables_escape_but_json_stays_exact():
    assert "\x1b" not in output.table([["k\x1b[2K", 1]], ["key", "n"])
    assert output.safe_text(output.safe_text("\x1b\ud800")) == "\\x1b\\ud800"
    assert output.safe_text("plain key.weight") == "plain key.weight"


def test_disk_full_names_the_file_being_written():
    e = OSError(errno.ENOSPC, "No space left on device", "/src/__0_0.distcp", None, "/out/__0_0.distcp")
    msg = output.os_error_message(e)
    assert "cannot write /out/__0_0.distcp" in msg and "/src" not in msg
