"""The runtime's last-resort handler: a rank that fails exits with one line naming itself.

A training job runs many ranks whose stderr is interleaved in one log; a traceback per rank is
unreadable there, and a checkpoint nobody vouches for can raise anything from a reader
(``RecursionError``, ``ValueError`` from an int over 4,300 digits, ``MemoryError``, DCP's
``CheckpointException``, which is a ``BaseException``). A torchrun rank calls
:func:`report_failure` in its outermost ``except``; ranks started by :mod:`gtp_runtime.launch`
report :func:`describe`'s text to the parent, which prints the line. Every failing rank exits
with a non-zero code (2 for a known checkpoint or configuration error, 1 for anything else) and
at most one line, control and bidi characters escaped, naming the rank: ``error: rank R: ...``.
A known error comes from input every rank reads alike (the checkpoint, the flags), so only rank 0
prints it (the log gets one line, not one per rank); an unexpected one can be rank-specific, so
each rank prints its own, ``error: rank R: TypeError: ... (full log: PATH)``, its traceback kept in
that log file. ``GTP_TRACEBACK=1`` prints the traceback on stderr as well.
"""

from __future__ import annotations

import os
import sys
import tempfile
import traceback
from pathlib import Path

from gtp_format.text import one_line, safe_text


def root_cause(e: BaseException) -> BaseException:
    """DCP wraps what its ranks raised in ``CheckpointException`` (every rank's traceback as its text):
    the first failing rank's exception instead. DCP stores each rank's failure as an ``(exception,
    traceback)`` pair (torch 2.13 ``_wrap_exception``); a bare exception is taken as well."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        inner = failures[min(failures)] if all(isinstance(r, int) for r in failures) else next(iter(failures.values()))
        if isinstance(inner, tuple) and inner:
            inner = inner[0]
        if isinstance(inner, BaseException):
            return root_cause(inner) if inner is not e else inner
    return e


def describe(e: BaseException, limit: int = 1000) -> str:
    """``e``'s message on one line, escaped and bounded; never raises (``str`` itself can)."""
    try:
        text = str(e)
    except Exception:  # noqa: BLE001 - str() itself can fail (an int over 4300 digits)
        text = "(message not printable)"
    return one_line(text, limit)


def failure_line(rank: int, e: BaseException, known: bool, log: str | os.PathLike | None = None) -> str:
    """One printable line for rank ``rank``'s failure ``e`` (unexpected ones name their type and log)."""
    e = root_cause(e)
    if known:
        return f"error: rank {rank}: {describe(e)}"
    return f"error: rank {rank}: {type(e).__name__}: {describe(e)}" + (f" (full log: {safe_text(log)})" if log else "")


def report_failure(rank: int, e: BaseException, known: bool) -> int:
    """Print :func:`failure_line` on stderr (known errors: rank 0 only) and return the exit code (2 known, 1 other).

    An unexpected error's traceback goes to a log file in the temporary folder, named on the line.
    """
    if os.environ.get("GTP_TRACEBACK"):
        traceback.print_exc()
    log = None
    if not known:
        try:
            log = Path(tempfile.gettempdir()) / f"gtp-train.rank{rank}.{os.getpid()}.log"
            log.write_text(traceback.format_exc())
        except OSError:
            log = None
    if rank == 0 or not known:
        print(failure_line(rank, e, known, log), file=sys.stderr, flush=True)
    return 2 if known else 1
