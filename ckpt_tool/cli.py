"""The ``ckpt`` command line: a safe reader for ``dp_reshardable`` torch_dist checkpoints.

Each command lives in its own module under :mod:`ckpt_tool.commands` and registers itself via a
``register(app)`` function, so commands written later (``migrate-aliased``, ``verify-roundtrip``)
plug in by adding their module name to :data:`COMMAND_MODULES` (a command group can call
``app.add_typer`` from its ``register``). Command modules import torch lazily, inside the
command, so ``ckpt --help`` stays fast; ``inspect`` and ``verify`` never import it (numpy and the
format's own dtype table, :mod:`gtp_format.dtypes`), which saves them 2-4 s per run.
"""

from __future__ import annotations

import importlib

import typer

from gtp_format.reader import pickle_scan

# A ckpt process lives for one command: the metadata's millions of objects are never garbage
# while it runs, so the cyclic GC need not walk them (see pickle_scan.gc_paused).
pickle_scan.FREEZE_AFTER_LOAD = True

COMMAND_MODULES: tuple[str, ...] = ("inspect", "verify", "show", "diff", "roundtrip", "migrate")

app = typer.Typer(
    name="ckpt",
    help="Inspect, verify, show and diff torch_dist (DCP) checkpoints without trusting them: metadata is "
    "read through an allow-list, never with pickle.load.",
    epilog="Exit codes: 0 ok, 1 check failed or checkpoints differ, 2 usage error or unreadable input. "
    "Run 'ckpt COMMAND --help' for examples.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _register_commands() -> None:
    for name in COMMAND_MODULES:
        importlib.import_module(f"ckpt_tool.commands.{name}").register(app)


_register_commands()


def main() -> None:
    """Console-script entry point (``ckpt = "ckpt_tool.cli:main"`` in pyproject.toml)."""
    app()


if __name__ == "__main__":
    main()
