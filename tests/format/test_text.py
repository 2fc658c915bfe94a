"""The one escaper (gtp_format.text.safe_text) over the whole class of unsafe code points.

Checked against brute force (every code point's Unicode category) exhaustively and with hypothesis
over mixed strings, then on the surfaces that print untrusted text: the runtime's error lines and
the reshard/export summaries.
"""

from __future__ import annotations

import re
import sys
import unicodedata
from pathlib import Path

from cli_helpers import cli
from hypothesis import given
from hypothesis import strategies as st

from gtp_format.text import UNSAFE_CATEGORIES, one_line, safe_text
from gtp_runtime.last_resort import describe, failure_line

FOLD = Path(__file__).resolve().parents[2] / "fixtures" / "gtp" / "fold_cp2_g2_dp2"
ESCAPE = re.compile(r"\\x[0-9a-f]{2}|\\u[0-9a-f]{4}|\\U[0-9a-f]{8}")
code_points = st.integers(0, sys.maxunicode).map(chr)


def unsafe(c: str) -> bool:
    return unicodedata.category(c) in UNSAFE_CATEGORIES


def test_every_code_point_is_escaped_exactly_when_its_category_is_unsafe() -> None:
    every = "".join(map(chr, range(sys.maxunicode + 1)))
    out = safe_text(every)
    assert not any(unsafe(c) for c in out)
    expected = "".join((f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}" if ord(c) < 0x10000
                        else f"\\U{ord(c):08x}") if unsafe(c) else c for c in every)
    assert out == expected


def test_the_characters_the_red_team_printed_are_in_the_class() -> None:
    for c in "\x1b\u202e\u00ad\u180e\ufffb\ufff9\U000e0041\U000e0001\U000e0000\u2028\u2029\ud800\ue000\U0010ffff":
        assert safe_text(c) != c and ESCAPE.fullmatch(safe_text(c)), hex(ord(c))


@given(st.lists(code_points, max_size=60).map("".join))
def test_output_holds_no_unsafe_character_and_is_idempotent(s: str) -> None:
    out = safe_text(s)
    assert not any(unsafe(c) for c in out)
    assert safe_text(out) == out
    # every safe character survives in order: removing the escapes of unsafe ones gives them back
    assert "".join(c for c in s if not unsafe(c)) == "".join(
        c for c in ESCAPE.sub(lambda m: "" if unsafe(chr(int(m.group()[2:], 16))) else m.group(), out))


@given(st.lists(code_points, max_size=40).map("".join))
def test_keep_newlines_keeps_only_line_feeds(s: str) -> None:
    out = safe_text(s, keep_newlines=True)
    assert out.count("\n") == s.count("\n") and not any(unsafe(c) and c != "\n" for c in out)


@given(st.lists(code_points, max_size=40).map("".join))
def test_runtime_error_lines_go_through_the_escaper(s: str) -> None:
    line = failure_line(3, RuntimeError(f"bad key {s}"), known=False, log=f"/tmp/log{s}")
    assert "\n" not in line and not any(unsafe(c) for c in line)
    assert describe(ValueError(s)) == one_line(s, 1000)


def test_reshard_and_export_summaries_escape_the_dst_name(tmp_path: Path) -> None:
    name = "out\x1b[2K\u202eevil\u00ad\U000e0041"
    r = cli("reshard", FOLD, tmp_path / f"r{name}", "--cp", "1", "--dp", "4")
    assert r.exit_code == 0, r.stderr
    e = cli("export", FOLD, tmp_path / f"e{name}", "--to", "hf")
    assert e.exit_code == 0, e.stderr
    for out in (r.stdout + r.stderr, e.stdout + e.stderr):
        assert out.startswith("wrote ") and not any(unsafe(c) and c != "\n" for c in out), out
        assert "out\\x1b[2K\\u202eevil\\xad\\U000e0041" in out
