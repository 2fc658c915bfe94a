"""Every way json.loads can fail on a hostile file is one FormatError, and memory stays bounded."""

from __future__ import annotations

import pytest

from gtp_format.errors import FormatError
from gtp_format.safe_json import loads


@pytest.mark.parametrize("raw, needle", [
    (b"[" * 5000 + b"]" * 5000, "arrays or objects"),
    (b'["aaaaaaa",' * 3000 + b"1" + b"]" * 3000, "too deeply"),
    (b"1" * 5000, "digits"),
    (b'{"size": 1e999}', "finite"),
    (b'{"size": NaN}', "NaN"),
    (b'{"k\\ud800": 1}', "surrogate"),
    (b'{"a": 1', "not valid JSON"),
    (b"\xff\xfe", "UTF-8"),
    (b"[], " * 1000, "arrays or objects"),
])
def test_hostile_json_is_one_format_error(raw, needle):
    with pytest.raises(FormatError, match=needle) as info:
        loads(raw, "f.json", "restore it")
    assert "\n" not in info.value.message and "f.json" in info.value.message


def test_genuine_json_parses_exactly():
    assert loads(b'{"a": [1, 2.5, "\\ud83d\\ude00"], "b": {"c": null}}', "f", "x") == \
        {"a": [1, 2.5, "\U0001f600"], "b": {"c": None}}
