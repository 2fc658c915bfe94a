"""A failing rank prints one line naming itself, whatever it raised."""

from __future__ import annotations

from gtp_runtime.last_resort import failure_line, report_failure


def test_unexpected_error_is_one_escaped_line(capsys, monkeypatch, tmp_path):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert report_failure(3, RecursionError("maximum recursion\n\x1b]0;x\x07 depth"), known=False) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: rank 3: RecursionError: ")
    assert f"(full log: {tmp_path}/gtp-train.rank3." in err
    assert "\x1b" not in err and "\\x1b" in err


def test_known_error_printed_by_rank_zero_only(capsys):
    assert report_failure(1, ValueError("bad checkpoint"), known=True) == 2
    assert capsys.readouterr().err == ""
    assert report_failure(0, ValueError("bad checkpoint"), known=True) == 2
    assert capsys.readouterr().err == "error: rank 0: bad checkpoint\n"


def test_unprintable_message():
    class Bad(Exception):
        def __str__(self):
            raise ValueError("Exceeds the limit (4300 digits)")

    assert failure_line(0, Bad(), known=False) == "error: rank 0: Bad: (message not printable)"


def test_roundtrip_limits_bound_what_a_manifest_may_start(monkeypatch):
    import pytest

    from gtp_format.layout.config import ConfigError, ModelConfig
    from gtp_runtime.roundtrip import check_roundtrip_limits

    check_roundtrip_limits(8, ModelConfig())
    with pytest.raises(ConfigError, match="17 processes"):
        check_roundtrip_limits(17, ModelConfig())
    with pytest.raises(ConfigError, match="parameters"):
        check_roundtrip_limits(1, ModelConfig(hidden=8192, num_layers=64, ffn_hidden=32768))
    monkeypatch.setenv("GTP_ROUNDTRIP_MAX_WORLD", "32")
    check_roundtrip_limits(17, ModelConfig())
