"""Output conventions shared by every command (modelled on the ``hf`` CLI).

* ``--format table|json``: tables (tabulate) for people, one JSON document for scripts;
* exit codes: 0 ok, 1 a check failed, 2 usage error or unreadable input;
* bad input: one line on stderr, ``ckpt: error: ...``, naming the file or key and the fix;
* progress bars (rich) only when stdout is a terminal and never in JSON mode, on stderr, so
  piping or capturing the output never carries escape codes.
"""

from __future__ import annotations

import errno
import functools
import json
import math
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from enum import Enum
from typing import Annotated, Any, NoReturn, ParamSpec, TypeVar

import typer

from gtp_format.errors import EXIT_BAD_INPUT, FormatError

P = ParamSpec("P")
R = TypeVar("R")


class OutputFormat(str, Enum):
    table = "table"
    json = "json"


FormatOption = Annotated[
    OutputFormat, typer.Option("--format", help="table for people, json for scripts (one document on stdout).")
]


DEFAULT_MAX_BYTES = 2 << 30
MaxBytesOption = Annotated[
    int, typer.Option("--max-bytes", min=1, help="Refuse to assemble a tensor region larger than this many bytes.")
]
MaxMemoryOption = Annotated[int, typer.Option("--max-memory", min=1 << 24, help="Bytes of tensor data in flight.")]


# What a terminal would act on rather than print: C0/C1 controls and DEL (escape sequences can
# retitle the window, move the cursor, erase a line and print a fake "all checks OK"), the bidi and
# zero-width format characters (text that reads differently than it is stored), lone surrogates
# (not encodable: printing them raised UnicodeEncodeError) and the tag characters.
_UNSAFE = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\xad\u061c\u180e\u200b-\u200f\u2028-\u202e\u2060-\u206f"
                     "\ufeff\ufff9-\ufffb\ud800-\udfff\U000e0000-\U000e007f]")
_UNSAFE_OR_NEWLINE = re.compile(_UNSAFE.pattern[:-1] + "\n]")


def _escape_char(m: re.Match[str]) -> str:
    c = m.group()
    n = ord(c)
    return f"\\x{n:02x}" if n < 0x100 else f"\\u{n:04x}" if n < 0x10000 else f"\\U{n:08x}"


def safe_text(text: Any, keep_newlines: bool = False) -> str:
    """``text`` with every control, bidi or unencodable character written as a visible escape (``\\x1b``).

    Idempotent (an escape is plain ASCII), and a no-op on ordinary text, so tables and error lines
    can pass through it more than once. JSON output needs none of this: ``json.dumps`` escapes
    them itself, so the document stays exact.
    """
    s = text if isinstance(text, str) else str(text)
    return (_UNSAFE if keep_newlines else _UNSAFE_OR_NEWLINE).sub(_escape_char, s)


def fail(message: str, code: int = EXIT_BAD_INPUT) -> NoReturn:
    """Print the one-line error (control characters escaped) and exit with ``code``."""
    typer.echo(f"ckpt: error: {safe_text(' '.join(message.splitlines()))}", err=True)
    raise typer.Exit(code)


_WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS}


def os_error_message(e: OSError) -> str:
    """One line for an OS error; a full disk names the file being *written* (``filename2`` of a copy)."""
    if e.errno in _WRITE_ERRNOS:
        target = e.filename2 or e.filename
        return f"cannot write{f' {target}' if target else ''}: {e.strerror or e}; free space or choose another output"
    return f"cannot read{f' {e.filename}' if e.filename else ''}: {e.strerror or e}"


def handle_errors(func: Callable[P, R]) -> Callable[P, R]:
    """Turn :class:`FormatError` and OS errors into the one-line message and the right exit code."""

    @functools.wraps(func)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        from gtp_format.writer.work import Terminated

        try:
            return func(*args, **kwargs)
        except Terminated:  # SIGTERM during a write: the writer already removed its work folder
            fail("terminated (SIGTERM); nothing was written, the partial output was removed", 128 + 15)
        except FormatError as e:
            fail(e.message, e.exit_code)
        except OSError as e:
            fail(os_error_message(e), EXIT_BAD_INPUT)

    return wrapper


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/Inf
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)


def print_json(doc: Any) -> None:
    typer.echo(json.dumps(_jsonable(doc), indent=2, allow_nan=False))


def table(rows: Sequence[Sequence[Any]], headers: Sequence[str], title: str | None = None) -> str:
    from tabulate import tabulate  # here: a JSON run never needs it (50 ms of every CLI start-up)

    rows = [[safe_text(c) if isinstance(c, str) else c for c in row] for row in rows]  # numbers keep tabulate's format
    body = tabulate(rows, headers=[safe_text(h) for h in headers], tablefmt="simple", disable_numparse=True) \
        if rows else "(none)"
    return f"{safe_text(title)}\n{body}" if title else body


def print_blocks(*blocks: str) -> None:
    """Print text blocks for people; whatever a block holds, no control character reaches the terminal."""
    typer.echo(safe_text("\n\n".join(b for b in blocks if b), keep_newlines=True))


def fmt_shape(shape: Sequence[int] | None) -> str:
    return "-" if shape is None else "(" + ", ".join(map(str, shape)) + ")"


def fmt_bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"


def progress_enabled(fmt: OutputFormat) -> bool:
    return fmt == OutputFormat.table and sys.stdout.isatty()


@contextmanager
def progress(total: int, description: str, enabled: bool) -> Iterator[Callable[[int], None]]:
    """Yield an ``advance(n)`` callback; a transient rich bar on stderr when enabled."""
    if not enabled or total <= 0:
        yield lambda n: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                   console=Console(stderr=True), transient=True)
    with bar:
        task = bar.add_task(description, total=total)
        yield lambda n: bar.advance(task, n)


def progress_opener(stack: ExitStack, description: str, fmt: OutputFormat
                    ) -> Callable[[int], Callable[[int], None]]:
    """For engines that learn their total late: ``open(total)`` starts the bar inside ``stack``
    (closed with it) and returns its ``advance(n)``."""
    def open_bar(total: int) -> Callable[[int], None]:
        return stack.enter_context(progress(total, description, progress_enabled(fmt)))

    return open_bar
