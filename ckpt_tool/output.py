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
import inspect
import json
import math
import os
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from enum import Enum
from typing import Annotated, Any, NoReturn, ParamSpec, TypeVar

import typer

from gtp_format import sizes
from gtp_format.errors import EXIT_BAD_INPUT, FormatError
from gtp_format.text import safe_text

P = ParamSpec("P")
R = TypeVar("R")


class OutputFormat(str, Enum):
    table = "table"
    json = "json"


FormatOption = Annotated[
    OutputFormat, typer.Option("--format", help="table for people, json for scripts (one document on stdout).")
]


def parse_size(text: str | int, minimum: int = 1) -> int:
    """:func:`gtp_format.sizes.parse_size` (the one parser of every size option, the launcher's too),
    its error as ``typer.BadParameter`` (exit 2, one line)."""
    try:
        return sizes.parse_size(text, minimum)
    except sizes.SizeError as e:
        raise typer.BadParameter(str(e)) from None


def size_option(name: str, help: str, minimum: int = 1) -> Any:
    """A typer option that takes a size with units (:func:`parse_size`)."""
    return typer.Option(name, parser=lambda v: parse_size(v, minimum), metavar="SIZE",
                        help=f"{help} Bytes, or with a unit: 5GB (10^9), 512MiB (2^20).")


# The one spelling of key selection, on every command that selects keys (inspect, diff,
# verify-roundtrip): repeatable globs, any --keys match selects, any --ignore match drops.
KeysOption = Annotated[list[str] | None, typer.Option(
    "--keys", metavar="GLOB", help="Only keys matching this glob (fnmatch; repeatable).", show_default=False)]
IgnoreOption = Annotated[list[str] | None, typer.Option(
    "--ignore", metavar="GLOB", help="Skip keys matching this glob (fnmatch; repeatable; wins over --keys).",
    show_default=False)]


DEFAULT_MAX_BYTES = 2 << 30
MaxBytesOption = Annotated[
    int, size_option("--max-bytes", "Refuse to assemble a tensor region larger than this.")
]
FirstLayersOption = Annotated[int | None, typer.Option(
    "--decoder-first-pipeline-num-layers", min=1,
    help="Layers on the first pipeline stage at the target (megatron-core sources; Megatron's flag). Default: "
         "the source's split where --pp stays, else an even split.")]
LastLayersOption = Annotated[int | None, typer.Option(
    "--decoder-last-pipeline-num-layers", min=1,
    help="Layers on the last pipeline stage at the target (megatron-core sources; Megatron's flag).")]
MaxMemoryOption = Annotated[int, size_option("--max-memory", "Tensor data in flight.", minimum=1 << 24)]


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
    """Turn :class:`FormatError` and OS errors into the one-line message and the right exit code.

    The command runs in a session of its own (:class:`gtp_format.session.Session`): its bucket locations are
    bound to it, and a command that declares a ``session`` parameter is handed it (hidden from the CLI's
    options), so that the folders it reads and writes use the session's one set of limits and its work
    folders are the session's to remove on a failure."""
    wants = "session" in inspect.signature(func).parameters

    @functools.wraps(func)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        from gtp_format.session import Session
        from gtp_format.work import Terminated

        try:
            with Session() as session:  # one command: its locations read and written through its session
                bound = session.bind_all(kwargs)
                if wants:
                    bound["session"] = session
                return func(*(session.bind(a) for a in args), **bound)
        except Terminated:  # SIGTERM during a write: the writer already removed its work folder
            from gtp_format import ranks

            group = ranks.current()  # under torchrun: its agent stops the job after a rank died; name that rank
            fail(group.lost("(torchrun stopped the job)").message if group is not None else
                 "terminated (SIGTERM); nothing was written, the partial output was removed", 128 + 15)
        except FormatError as e:
            fail(e.message, e.exit_code)
        except OSError as e:
            fail(os_error_message(e), EXIT_BAD_INPUT)

    if wants:  # Typer reads the options from the signature (its annotations evaluated): the session is no option
        signature = inspect.signature(func, eval_str=True)
        wrapper.__signature__ = signature.replace(  # type: ignore[attr-defined]
            parameters=[p for p in signature.parameters.values() if p.name != "session"])
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


def print_line(text: str) -> None:
    """Print one summary line for people, every field escaped (a DST name may carry ESC or bidi)."""
    typer.echo(safe_text(text))


def print_blocks(*blocks: str) -> None:
    """Print text blocks for people; whatever a block holds, no control character reaches the terminal."""
    typer.echo(safe_text("\n\n".join(b for b in blocks if b), keep_newlines=True))


def count(n: int, noun: str) -> str:
    """``1 file``, ``2 files``: a number with its noun, singular or plural."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def fmt_shape(shape: Sequence[int] | None) -> str:
    return "-" if shape is None else "(" + ", ".join(map(str, shape)) + ")"


def fmt_bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"


def print_written(fmt: OutputFormat, doc: dict[str, Any], line: str) -> None:
    """The summary of a command that wrote DST (reshard, export, import): the JSON document, or ``line``
    followed by the memory the run took against its budget (``peak_rss_bytes``, ``max_memory``)."""
    if fmt == OutputFormat.json:
        print_json({"ok": True, **doc})
    else:
        print_line(f"{line}; peak memory {fmt_bytes(doc['peak_rss_bytes'])} (budget {fmt_bytes(doc['max_memory'])})")


def progress_enabled(fmt: OutputFormat) -> bool:
    return fmt == OutputFormat.table and sys.stdout.isatty()


BYTES = "B"  # the unit of engines that move data: shown as MB and MB/s, like `hf download`


@contextmanager
def progress(total: int, description: str, enabled: bool, unit: str = BYTES) -> Iterator[Callable[[int], None]]:
    """Yield an ``advance(n)`` callback; a transient rich bar on stderr when enabled.

    The one progress display of every engine. ``unit`` is :data:`BYTES` (done/total in MB and the
    throughput in MB/s) or a plural noun (``"chunks"``: done/total chunks and chunks/s).
    """
    if not enabled or total <= 0:
        yield lambda n: None
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        MofNCompleteColumn,
        Progress,
        ProgressColumn,
        Task,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )
    from rich.text import Text

    class Rate(ProgressColumn):
        def render(self, task: Task) -> Text:
            speed = task.finished_speed or task.speed
            return Text(f"{speed:,.1f} {unit}/s" if speed else f"? {unit}/s", style="progress.data.speed")

    amount: tuple[ProgressColumn, ...] = (DownloadColumn(binary_units=False), TransferSpeedColumn()) \
        if unit == BYTES else (MofNCompleteColumn(), TextColumn(unit), Rate())
    bar = Progress(TextColumn("{task.description}"), BarColumn(), *amount, TimeRemainingColumn(),
                   console=Console(stderr=True), transient=True)
    with bar:
        task = bar.add_task(description, total=total)
        yield lambda n: bar.advance(task, n)


@contextmanager
def follow_bytes_written(folder: str | os.PathLike, advance: Callable[[int], None], total: int,
                         interval: float = 0.25) -> Iterator[None]:
    """Advance a bytes bar as files appear under ``folder`` while the block runs (written by other
    processes: the ranks of ``verify-roundtrip``), then by whatever is left of ``total``.

    Why: a bar that sits at 0 through a minute of loading and saving looks hung; the bytes the
    ranks have written so far are the one measure of their progress this process can see.
    """
    stop = threading.Event()
    done = [0]

    def size() -> int:
        n = 0
        for root, _, files in os.walk(folder):
            for f in files:
                try:
                    n += os.stat(os.path.join(root, f), follow_symlinks=False).st_size
                except OSError:
                    pass
        return n

    def poll() -> None:
        while not stop.wait(interval):
            step = min(size(), total) - done[0]
            if step > 0:
                done[0] += step
                advance(step)

    thread = threading.Thread(target=poll, name="ckpt-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
    if total > done[0]:
        advance(total - done[0])


def progress_opener(stack: ExitStack, description: str, fmt: OutputFormat
                    ) -> Callable[[int], Callable[[int], None]]:
    """For engines that learn their total late: ``open(total)`` starts the bar inside ``stack``
    (closed with it) and returns its ``advance(n)``."""
    def open_bar(total: int) -> Callable[[int], None]:
        return stack.enter_context(progress(total, description, progress_enabled(fmt)))

    return open_bar
