"""``python -m gtp_runtime.data prepare ...`` (or ``gtp-data prepare ...``): see :mod:`gtp_runtime.data.prepare`."""

from __future__ import annotations

import sys

from gtp_format import __version__
from gtp_runtime.data.prepare import EXAMPLES, main

USAGE = f"""usage: gtp-data [-h] [--version] {{prepare}} ...   (or: python -m gtp_runtime.data ...)

Data tools of gtp_runtime.

commands:
  prepare    text files (or JSON lines) to a Megatron indexed dataset, PREFIX.bin/.idx
             (gtp-data prepare --help for its flags)

{EXAMPLES}"""


def run(argv: list[str]) -> int:
    """The command ``argv`` names; its exit code (2 without one)."""
    if argv[:1] in (["-h"], ["--help"]):
        print(USAGE, end="")
        return 0
    if argv[:1] == ["--version"]:
        print(f"gtp-data {__version__}")
        return 0
    if argv[:1] != ["prepare"]:
        print(USAGE, file=sys.stderr, end="")
        return 2
    return main(argv[1:])


def cli() -> None:
    """Console-script entry point (``gtp-data`` in pyproject.toml)."""
    sys.exit(run(sys.argv[1:]))


if __name__ == "__main__":
    cli()
