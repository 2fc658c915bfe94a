"""No rank outlives its launcher: the parent-death signal, a pipe the ranks watch, SIGTERM as SIGINT.

Why: a fault-injection campaign killed ``python -m gtp_runtime.train`` with
``kill -9`` and with a plain ``kill``; its ranks, the fork server and the resource tracker went on
training and saving (124 iterations in the next 60 s), so a user who restarted had two runs
interleaving iterations in one folder. A launcher's cleanup (``finally``) runs on neither signal's
default action, so the ranks must notice by themselves:

* **the lifeline pipe.** The launcher holds the only write end of a pipe whose read end every rank
  gets; the kernel closes it however the launcher dies, and a thread in each rank that waits on the
  read end sees end-of-file and ends the rank at once (``os._exit``: a rank stuck in a collective
  or in the middle of a save must not finish it). Portable (it needs no Linux call).
* **``PR_SET_PDEATHSIG``** (Linux): the kernel sends SIGKILL to a rank when its parent exits: the
  launcher itself where it forked the rank, else the fork server, which exits as soon as the
  launcher is gone (it watches a pipe of its own). A second path that needs no thread to be scheduled.
* **SIGTERM handled like SIGINT** in the launcher:
  :func:`gtp_format.work.sigterm_raises` (``replace=True``; the writer's own context
  manager) turns it into :class:`gtp_format.work.Terminated` (a ``KeyboardInterrupt``), so
  the launcher's ``finally`` stops every rank and reports, instead of the default action, which
  ends the launcher alone.

The resource tracker needs nothing: it exits when the last process holding its pipe is gone.
"""

from __future__ import annotations

import ctypes
import multiprocessing.connection as mpc
import os
import signal
import sys
import threading
from typing import Any

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
EXIT_LAUNCHER_GONE = 143  # as if SIGTERM ended the rank: it did not finish on its own


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent exits (Linux only); True if set."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def watch_lifeline(conn: Any) -> None:
    """In a rank: end this process as soon as ``conn`` (the read end of the lifeline) reaches EOF.

    The launcher never writes to the pipe, so the only event is its death. Checked once before
    returning too: a launcher that died before this call (or before the parent-death signal was
    set) is noticed here rather than never.
    """
    def wait() -> None:
        try:
            mpc.wait([conn])
        finally:
            os._exit(EXIT_LAUNCHER_GONE)

    set_parent_death_signal()
    if conn.poll(0):
        os._exit(EXIT_LAUNCHER_GONE)
    threading.Thread(target=wait, name="gtp-lifeline", daemon=True).start()
