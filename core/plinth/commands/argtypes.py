"""Argparse types with ranges, so every command refuses a bad option at parse time.

Any command (core or plugin) reuses them::

    p.add_argument("--top-p", type=float_range(0.0, 1.0, lo_open=True), default=1.0)
    p.add_argument("-n", type=int_range(1), default=128)

A bad value is argparse's one-line usage error (exit 2) naming the option,
before any plugin code runs or any model loads. Rules between two options go
in a ``check_args(parser, args)`` set with ``parser.set_defaults``; the CLI
calls it right after parsing.
"""

from __future__ import annotations

import argparse
import math
from typing import Any, Callable


def _bound(lo: float | None, hi: float | None, lo_open: bool, hi_open: bool) -> str:
    left = "" if lo is None else f"{'>' if lo_open else '>='} {lo:g}"
    right = "" if hi is None else f"{'<' if hi_open else '<='} {hi:g}"
    return " and ".join(x for x in (left, right) if x)


def int_range(lo: int | None = None, hi: int | None = None) -> Callable[[str], int]:
    """An integer option with ``lo <= v <= hi`` (either end may be open-ended with None)."""

    def parse(text: str) -> int:
        try:
            value = int(text, 10)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            raise argparse.ArgumentTypeError(f"{value} is out of range: must be {_bound(lo, hi, False, False)}")
        return value

    parse.__name__ = "integer"
    return parse


def float_range(lo: float | None = None, hi: float | None = None, *, lo_open: bool = False,
                hi_open: bool = False) -> Callable[[str], float]:
    """A finite float option in ``[lo, hi]`` (``lo_open`` / ``hi_open`` exclude the ends)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text} is not a finite number")
        bad = (lo is not None and (value < lo or (lo_open and value == lo))) or \
              (hi is not None and (value > hi or (hi_open and value == hi)))
        if bad:
            raise argparse.ArgumentTypeError(f"{value:g} is out of range: must be {_bound(lo, hi, lo_open, hi_open)}")
        return value

    parse.__name__ = "number"
    return parse


def nonempty(text: str) -> str:
    """A string option that may not be empty."""
    if not text:
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def require(parser: argparse.ArgumentParser, ok: bool, message: str) -> None:
    """A rule between options: a usage error (exit 2) unless ``ok``."""
    if not ok:
        parser.error(message)


def subparser_of(parser: argparse.ArgumentParser, args: Any) -> argparse.ArgumentParser:
    """The subcommand's parser (for its usage line in errors), or ``parser`` itself."""
    for action in parser._actions:  # noqa: SLF001 - argparse offers no public lookup
        if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
            return action.choices.get(getattr(args, "command", None), parser)
    return parser
