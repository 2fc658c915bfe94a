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
import re
import sys
from collections.abc import Callable
from typing import Annotated, Any

import typer
from typer import Abort, Exit
from typer._click.exceptions import NoArgsIsHelpError, UsageError  # typer is pinned to 0.29 (pyproject.toml)

from ckpt_tool.output import os_error_message, safe_text
from gtp_format import __version__
from gtp_format.errors import EXIT_BAD_INPUT, FormatError
from gtp_format.reader import unpickler

# A ckpt process lives for one command: the metadata's millions of objects are never garbage
# while it runs, so the cyclic GC need not walk them (see unpickler.gc_paused).
unpickler.FREEZE_AFTER_LOAD = True

COMMAND_MODULES: tuple[str, ...] = ("inspect", "verify", "show", "diff", "roundtrip", "migrate", "reshard", "export",
                                    "import_hf", "plan", "log")

INTRO = ("Read, check and rewrite gtp_runtime and Megatron checkpoints (torch_dist/DCP and safetensors) "
         "without trusting them: metadata is read through an allow-list, never with pickle.load.")

class _App(typer.Typer):
    """Typer, with every flag's help shown without a ``<bool>`` value (see :func:`_flags_without_metavar`)."""

    _built: tuple[tuple[int, int], Any] | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.click_command()(*args, **kwargs)

    def click_command(self) -> Any:
        """The click command, built once per set of registered commands. Why: Typer rebuilds it from
        the signatures on every call (15-34 ms here, a quarter of a warm ``export`` of a 26.5 MB
        checkpoint from a bucket), and in-process callers (tests, CI jobs, benchmarks) call often."""
        shape = (len(self.registered_commands), len(self.registered_groups))
        if self._built is None or self._built[0] != shape:
            command = typer.main.get_command(self)
            _flags_without_metavar(command)
            self._built = (shape, command)
        return self._built[1]


app = _App(
    name="ckpt",
    help=INTRO,
    epilog="Exit codes: 0 ok, 1 check failed or checkpoints differ, 2 usage error or unreadable input. "
    "Run 'ckpt COMMAND --help' (or -h) for examples. Training and data: gtp-train --help, gtp-data --help.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},  # inherited by every command
)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"ckpt {__version__}")
        raise typer.Exit(0)


@app.callback()
def _main(version: Annotated[bool, typer.Option(
        "--version", callback=_print_version, is_eager=True, help="Print the version and exit.")] = False) -> None:
    """Placeholder: the help text is set from INTRO and the registered commands."""


def command_names() -> list[str]:
    """Every registered command and command group, in registration order."""
    names = [c.name or (c.callback.__name__ if c.callback else "") for c in app.registered_commands]
    return names + [g.name or (g.typer_instance.info.name or "") for g in app.registered_groups]


def _register_commands() -> None:
    for name in COMMAND_MODULES:
        importlib.import_module(f"ckpt_tool.commands.{name}").register(app)
    # The description names every command, so a new one cannot be missing from it.
    app.info.help = f"{INTRO} Commands: {', '.join(command_names())}."


def _flags_without_metavar(command: Any) -> None:
    """An on/off flag takes no value, so its help shows none (Typer would print ``<bool>``)."""
    for param in getattr(command, "params", []):
        if getattr(param, "is_flag", False) and param.metavar is None:
            param.metavar = ""
    for sub in getattr(command, "commands", {}).values():
        _flags_without_metavar(sub)


_register_commands()

# Typer's option errors come in pydantic's words; these say the same in plain ones.
_PLAIN = (
    (re.compile(r"Input should be greater than or equal to (\S+)"), r"must be at least \1"),
    (re.compile(r"Input should be less than or equal to (\S+)"), r"must be at most \1"),
    (re.compile(r"Input should be greater than (\S+)"), r"must be more than \1"),
    (re.compile(r"Input should be less than (\S+)"), r"must be less than \1"),
    (re.compile(r"Input should be a valid integer[^(]*"), "must be a whole number "),
    (re.compile(r"Input should be a valid number[^(]*"), "must be a number "),
    (re.compile(r"Input should be a valid boolean[^(]*"), "must be true or false "),
    (re.compile(r"Value error, "), ""),
    (re.compile(r"Input should be "), "must be "),
)


# click's words (typer without pydantic): "99 is not in the range 1<=x<=64.", "'x' is not a valid int range."
_CLICK_RANGE = re.compile(r"(\S+) is not in the range (\S*)x(\S*?)\.?(?=\s|$)")
_CLICK_PLAIN = (
    (re.compile(r"\S+ is not a valid (int|integer)( range)?\.?"), "must be a whole number"),
    (re.compile(r"\S+ is not a valid float( range)?\.?"), "must be a number"),
    (re.compile(r"\S+ is not a valid boolean\.?"), "must be true or false"),
)


# a bound's kind -> (whether a value breaks it, the words that name it)
_BOUNDS: dict[str, tuple[Callable[[float, float], bool], str]] = {
    ">=": (lambda v, lim: v < lim, "must be at least"), ">": (lambda v, lim: v <= lim, "must be more than"),
    "<=": (lambda v, lim: v > lim, "must be at most"), "<": (lambda v, lim: v >= lim, "must be less than"),
}


def _bound(m: re.Match[str]) -> str:
    """The bound a value breaks, from click's range (``1<=x<=64``, ``x>=1``, ``0<x``, ``x<1``); every bound
    where the value is not a number."""
    value, left, right = m.group(1), m.group(2), m.group(3)
    bounds = []  # (kind as seen from x, limit)
    if left:  # "1<=" before x is x >= 1
        bounds.append((">=" if left.endswith("<=") else ">", left.rstrip("<=")))
    if right[:1] in ("<", ">"):
        op = right[:2] if right[1:2] == "=" else right[:1]
        bounds.append((op, right[len(op):]))
    try:
        number = float(value.strip("'"))
        broken = [(k, lim) for k, lim in bounds if _BOUNDS[k][0](number, float(lim))]
    except ValueError:
        broken = []
    return " and ".join(f"{_BOUNDS[k][1]} {lim}" for k, lim in (broken or bounds))


def plain_words(message: str) -> str:
    """A usage error's message without pydantic's or click's phrasing."""
    for pattern, repl in _PLAIN:
        message = pattern.sub(repl, message)
    message = _CLICK_RANGE.sub(_bound, message)
    for pattern, repl in _CLICK_PLAIN:
        message = pattern.sub(repl, message)
    return " ".join(message.split())


def _line(message: str) -> None:
    print(f"ckpt: error: {safe_text(' '.join(message.splitlines()))[:2000]}", file=sys.stderr, flush=True)


def _describe(e: BaseException) -> str:
    try:
        text = str(e)
    except Exception:  # noqa: BLE001 - str() itself can fail (an int over 4300 digits in the message)
        text = "(message not printable)"
    return f"{type(e).__name__}: {text[:300]}" if text else type(e).__name__


def run(argv: list[str] | None = None) -> int:
    """Run one ``ckpt`` command and return its exit code; the last-resort handler for everything.

    Whatever happens, the user sees at most one ``ckpt: error:`` line on stderr and never a
    traceback: a usage error is that line (not Typer's multi-line box) and exit 2; an exception no
    command anticipated (a bug, or input that found a path nobody checked) is that line naming the
    exception and exit 2, since it means ckpt could not use its input.
    """
    from gtp_format import ranks

    args = sys.argv[1:] if argv is None else argv
    if ranks.under_torchrun() and args[:1] and args[0] in RANKED_COMMANDS and not _ranked:
        return _run_ranked(args)
    try:
        result = app(args=argv, standalone_mode=False, prog_name="ckpt")
    except NoArgsIsHelpError as e:  # bare ``ckpt`` (or a bare group): its help, as Typer would
        where = e.ctx.command_path.split()[1:] if e.ctx else []
        app(args=[*where, "--help"], standalone_mode=False, prog_name="ckpt")
        return EXIT_BAD_INPUT
    except UsageError as e:
        where = e.ctx.command_path if e.ctx else "ckpt"
        _line(f"{plain_words(e.format_message())} (run '{where} --help' for usage and examples)")
        return EXIT_BAD_INPUT
    except Exit as e:
        return e.exit_code
    except (Abort, KeyboardInterrupt):
        _line("interrupted")
        return 130
    except FormatError as e:  # outside a command's own handler (while parsing options, say)
        _line(e.message)
        return e.exit_code
    except OSError as e:
        _line(os_error_message(e))
        return EXIT_BAD_INPUT
    except (Exception, RecursionError, MemoryError) as e:  # noqa: BLE001 - the last resort
        _line(f"unexpected {_describe(e)}; ckpt could not use its input (nothing was modified); please "
              "report this with the command line")
        return EXIT_BAD_INPUT
    return result if isinstance(result, int) else 0


# Commands that share their work over the ranks of a torchrun job (gtp_format.ranks); any other runs whole on
# every rank, as it would alone.
RANKED_COMMANDS = ("reshard", "export", "import", "verify")
_ranked = False  # inside _run_ranked: the command runs as this rank


def _run_ranked(args: list[str]) -> int:
    """One rank of a torchrun job: join the gloo group, run the command (rank 0 alone prints its report; every
    rank prints its one error line), leave. SIGTERM (torchrun's agent stopping the job after a rank died)
    raises here on every rank, so rank 0's writer removes its work folder and each rank names the dead one."""
    import os

    from gtp_format import ranks
    from gtp_format.work import sigterm_raises

    with sigterm_raises(replace=True):
        try:
            group = ranks.join()
        except FormatError as e:
            _line(e.message)
            return e.exit_code
        except KeyboardInterrupt:
            _line("interrupted while joining the torchrun job")
            return 130
        quiet = None
        if group is not None and not group.root:
            quiet = sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - closed below; rank 0 prints the report
        global _ranked
        _ranked = True
        try:
            return run(args)
        finally:
            _ranked = False
            if quiet is not None:
                sys.stdout = sys.__stdout__
                quiet.close()
            try:
                ranks.leave()
            except Exception:  # noqa: BLE001, S110 - a broken group at exit changes nothing of the outcome
                pass


def main() -> None:
    """Console-script entry point (``ckpt = "ckpt_tool.cli:main"`` in pyproject.toml)."""
    sys.exit(run())


if __name__ == "__main__":
    main()
