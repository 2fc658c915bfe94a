"""The one parser of numbers written by people: flags of the launcher and the data tools, and environment
variables. ASCII, finite and bounded, before anything uses them.

Why not ``int()``/``float()``: both take any script's digits (``float("\\u0665")`` is 5.0, so a timeout
written in Arabic-Indic digits was accepted as a number nobody typed), ``float`` takes ``nan``,
``inf`` and ``1e999`` (a NaN weight in ``--split`` reached ``int(nan)`` as a last-resort line),
and ``int`` takes 4,300 digits (a rank count of 10^12 ran the launcher out of file descriptors).
So a number here is ``[+-]?digits[.digits][e[+-]digits]`` in ASCII, at most :data:`MAX_CHARS`
characters, finite, and inside the bounds the caller gives; anything else is :class:`NumberError`,
whose message names the flag or variable and what it accepts. Nothing may stand around it, not
even spaces: one rule for every flag and variable, so ``" 8"`` is refused alike as
``CKPT_MAX_HOLE_RATIO`` and as a launcher timeout (a list flag such as ``--split 98,2`` strips its
items before they get here).
"""

from __future__ import annotations

import argparse
import math
import os
import re

MAX_CHARS = 40
_INT = re.compile(r"[+-]?[0-9]{1,30}", re.ASCII)
_FLOAT = re.compile(r"[+-]?(?:[0-9]{1,30}(?:\.[0-9]{0,30})?|\.[0-9]{1,30})(?:[eE][+-]?[0-9]{1,3})?", re.ASCII)
INT64_MAX = (1 << 63) - 1


class NumberError(ValueError):
    """A number from a flag or the environment that is not one (the message is one line)."""


def _shown(text: str) -> str:
    return repr(text[:MAX_CHARS] + ("..." if len(text) > MAX_CHARS else ""))


def parse_int(text: str, what: str, low: int = -INT64_MAX, high: int = INT64_MAX) -> int:
    """An integer written in ASCII digits, in ``[low, high]``."""
    if not _INT.fullmatch(text):
        raise NumberError(f"{what} {_shown(text)} is not a whole number in ASCII digits")
    value = int(text)
    if not low <= value <= high:
        raise NumberError(f"{what} {_shown(text)} is outside [{low}, {high}]")
    return value


def parse_float(text: str, what: str, low: float = -math.inf, high: float = math.inf) -> float:
    """A finite number written in ASCII (``1e-3``, ``0.5``, ``98``), in ``[low, high]``."""
    if not _FLOAT.fullmatch(text):
        raise NumberError(f"{what} {_shown(text)} is not a finite number in ASCII digits")
    value = float(text)
    if not math.isfinite(value):  # 1e999
        raise NumberError(f"{what} {_shown(text)} is not a finite number")
    if not low <= value <= high:
        raise NumberError(f"{what} {_shown(text)} is outside [{low:g}, {high:g}]")
    return value


def env_int(name: str, default: int, low: int = -INT64_MAX, high: int = INT64_MAX) -> int:
    """``$name`` as :func:`parse_int` reads it; ``default`` when it is unset or empty."""
    raw = os.environ.get(name)
    return default if not raw else parse_int(raw, name, low, high)


def env_float(name: str, default: float, low: float = -math.inf, high: float = math.inf) -> float:
    """``$name`` as :func:`parse_float` reads it; ``default`` when it is unset or empty."""
    raw = os.environ.get(name)
    return default if not raw else parse_float(raw, name, low, high)


def int_flag(low: int = -INT64_MAX, high: int = INT64_MAX):  # noqa: ANN201 - an argparse ``type``
    """An argparse ``type=`` for integers (argparse prints the message in its usage error, exit 2)."""
    def convert(text: str) -> int:
        try:
            return parse_int(text, "value", low, high)
        except NumberError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    convert.__name__ = "ASCII integer"
    return convert


def float_flag(low: float = -math.inf, high: float = math.inf):  # noqa: ANN201 - an argparse ``type``
    """An argparse ``type=`` for finite numbers."""
    def convert(text: str) -> float:
        try:
            return parse_float(text, "value", low, high)
        except NumberError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    convert.__name__ = "finite ASCII number"
    return convert


class OneLineParser(argparse.ArgumentParser):
    """argparse with a usage error in one line (``PROG: error: ...``, exit 2), not the usage block first."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())} (run with --help for usage)\n")
