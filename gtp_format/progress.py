"""The one progress type of every engine, and how an engine that learns its total late gets one.

Every engine (verify ``--data``, reshard, export, import, migrate-aliased) reports what it has
done through :data:`Progress`, ``advance(n)`` with the amount just done (bytes, chunks or keys, as
the engine's unit says); the CLI draws it (``ckpt_tool.output.progress``) and a library caller
passes nothing. Four modules used to declare their own alias of the same type, under one name with
three meanings.
"""

from __future__ import annotations

from collections.abc import Callable

Progress = Callable[[int], None]
"""``advance(n)``: ``n`` more units done."""

ProgressOpener = Callable[[int], Progress]
"""``open(total)`` -> :data:`Progress`: for an engine that knows its total only once it has planned
(reshard, export, import); the CLI starts its bar then (``ckpt_tool.output.progress_opener``)."""
