"""The one escaper for every printed field: ``ckpt``'s tables and errors, and the runtime's lines.

What a terminal would act on rather than print, or what reads differently than it is stored, is
written as a visible escape (``\\x1b``, ``\\u202e``, ``\\U000e0041``): the Unicode categories
Cc (controls: escape sequences can retitle the window, move the cursor, erase a line and print a
fake "all checks OK"), Cf (format characters: bidi overrides, zero-width joiners, soft hyphen,
U+180E, the interlinear annotations U+FFF9..U+FFFB, the tag block U+E0000..U+E007F), Co (private
use), Cs (lone surrogates: printing one raised ``UnicodeEncodeError``), Zl and Zp (line and
paragraph separators: a second line inside a one-line error) and Cn (unassigned in this Python's
Unicode database: a newer terminal may give them any meaning).

Why by category and not a list: the list this replaced named ranges one by one, and each red-team
round found a character it missed (tags, U+180E, U+FFFB). ``str.isprintable`` is the fast path
(C speed; false for exactly these categories plus non-ASCII spaces), so ordinary text costs one
call and only a line that fails it is walked character by character.

It lives in the torch-free format package because the CLI and the runtime both print untrusted
text, and the runtime must not import the CLI.
"""

from __future__ import annotations

import unicodedata
from typing import Any

UNSAFE_CATEGORIES = frozenset({"Cc", "Cf", "Co", "Cs", "Zl", "Zp", "Cn"})


def escape_char(c: str) -> str:
    """``c`` as a visible, plain-ASCII escape."""
    n = ord(c)
    return f"\\x{n:02x}" if n < 0x100 else f"\\u{n:04x}" if n < 0x10000 else f"\\U{n:08x}"


def _escape_line(line: str) -> str:
    if line.isprintable():
        return line
    return "".join(escape_char(c) if unicodedata.category(c) in UNSAFE_CATEGORIES else c for c in line)


def safe_text(text: Any, keep_newlines: bool = False) -> str:
    """``text`` with every character of :data:`UNSAFE_CATEGORIES` written as a visible escape.

    ``keep_newlines`` keeps ``\\n`` (a multi-line block); every other line break is escaped.
    Idempotent (an escape is plain ASCII) and a no-op on ordinary text, so tables and error lines
    can pass through it more than once. JSON output needs none of this: ``json.dumps`` escapes
    them itself, so the document stays exact.
    """
    s = text if isinstance(text, str) else str(text)
    if keep_newlines:
        return "\n".join(_escape_line(line) for line in s.split("\n"))
    return _escape_line(s)


def one_line(text: Any, limit: int | None = None) -> str:
    """``text`` folded onto one line (whitespace runs become one space), bounded, then escaped."""
    s = " ".join((text if isinstance(text, str) else str(text)).split())
    return safe_text(s[:limit] if limit is not None else s)
