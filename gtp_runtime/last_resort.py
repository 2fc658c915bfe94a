"""The runtime's last-resort handler: a rank that fails exits with one line naming itself.

A training job runs many ranks whose stderr is interleaved in one log; a traceback per rank is
unreadable there, and a checkpoint nobody vouches for can raise anything from a reader
(``RecursionError``, ``ValueError`` from an int over 4,300 digits, ``MemoryError``). The launcher
calls :func:`report_failure` in each rank's outermost ``except``; every failing rank exits with a
non-zero code (2 for a known checkpoint or configuration error, 1 for anything else) and at most
one line, control characters escaped, naming the rank: ``error: rank R: ...``. A known error
comes from input every rank reads alike (the checkpoint, the flags), so only rank 0 prints it
(the log gets one line, not one per rank); an unexpected one can be rank-specific, so each rank
prints its own, ``error: rank R: unexpected TypeError: ...``. ``GTP_TRACEBACK=1`` prints the
traceback as well, for debugging the runtime itself.
"""

from __future__ import annotations

import os
import re
import sys
import traceback

_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200b-\u200f\u2028-\u202e\u2060-\u206f\ufeff\ud800-\udfff]")


def failure_line(rank: int, e: BaseException, known: bool) -> str:
    """One printable line for rank ``rank``'s failure ``e``.

    DCP wraps what its ranks raised in ``CheckpointException``, whose text is every rank's
    traceback: the first rank's exception is reported instead.
    """
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        inner = next(iter(failures.values()))
        if isinstance(inner, BaseException):
            e = inner
    try:
        text = " ".join(str(e).splitlines())
    except Exception:  # noqa: BLE001 - str() itself can fail (an int over 4300 digits)
        text = "(message not printable)"
    text = _UNSAFE.sub(lambda m: f"\\x{ord(m.group()):02x}" if ord(m.group()) < 0x100 else f"\\u{ord(m.group()):04x}",
                       text[:1000])
    return f"error: rank {rank}: {text}" if known else f"error: rank {rank}: unexpected {type(e).__name__}: {text}"


def report_failure(rank: int, e: BaseException, known: bool) -> int:
    """Print :func:`failure_line` on stderr (known errors: rank 0 only) and return the exit code (2 known, 1 other)."""
    if os.environ.get("GTP_TRACEBACK"):
        traceback.print_exc()
    if rank == 0 or not known:
        print(failure_line(rank, e, known), file=sys.stderr, flush=True)
    return 2 if known else 1
