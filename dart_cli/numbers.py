"""Numeric options, checked as the command line is parsed: one rule for every command.

`integer(low, high)` and `real(low, high, ...)` are argparse types. A value that is not a number of the kind, not
finite, or outside its range does not raise inside argparse (that would exit from inside the parser with the whole
usage text): the type returns a `Refused` that says why, and `checked(parser, run)`, the command's run function as
its parser calls it, reports the first one as a `UsageError` before the command does anything else (no model is
loaded, no file touched). `dart-spec` prints it as one line and exits with status 2, like any other bad input.
"""

from __future__ import annotations

import argparse
import math
from typing import Callable, Optional

from dart_cli.errors import UsageError

MAX_SEED = 2**64 - 1  # what torch's generators take; `dart-spec demo` refuses seeds outside 0..2**64-1 alike
MAX_SIZE = 2**31 - 1  # counts, lengths and sizes: past this a value is a typo (and past what a tensor index holds)


class Refused:
    """A value a numeric option did not accept: `reason` completes "--flag ...". Never equal to a number."""

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def __repr__(self) -> str:
        return f"Refused({self.reason!r})"


def _cut(text: str) -> str:
    """`text` as a message shows it: a pasted screenful cut short."""
    return text if len(text) <= 40 else text[:37] + "..."


def _span(low, high) -> str:
    if low is None and high is None:
        return "an integer"
    if high is None:
        return "a positive integer" if low == 1 else f"an integer >= {low}"
    top = "2**64-1" if high == MAX_SEED else str(high)
    return f"an integer <= {top}" if low is None else f"an integer in {low}..{top}"


def integer(low: Optional[int] = 1, high: Optional[int] = MAX_SIZE) -> Callable[[str], object]:
    """An argparse type: a decimal integer in low..high (None: unbounded on that side)."""

    def parse(text: str):
        try:
            value = int(text.strip(), 10)
        except ValueError:
            return Refused(f"must be {_span(low, high)}, got {_cut(text)!r}")
        if low is not None and value < low:  # the usual mistake: say it as the lower bound alone
            return Refused(f"must be {_span(low, None)}, got {value}")
        if high is not None and value > high:
            return Refused(f"must be {_span(low, high)}, got {_cut(str(value))}")
        return value

    parse.__name__ = "integer"
    return parse


def real(low: Optional[float] = None, high: Optional[float] = None, low_open: bool = False,
         high_open: bool = False) -> Callable[[str], object]:
    """An argparse type: a finite number in [low, high] (an end of `*_open` excluded; None: unbounded)."""
    if low is None and high is None:
        span = "a finite number"
    elif high is None:
        span = f"a finite number {'>' if low_open else '>='} {low:g}"
    elif low is None:
        span = f"a finite number {'<' if high_open else '<='} {high:g}"
    else:
        span = f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"

    def parse(text: str):
        try:
            value = float(text)
        except ValueError:
            return Refused(f"must be {span}, got {_cut(text)!r}")
        if not math.isfinite(value):
            return Refused(f"must be {span}, got {_cut(text)!r}")
        if low is not None and (value < low or (low_open and value == low)):
            return Refused(f"must be {span}, got {value:g}")
        if high is not None and (value > high or (high_open and value == high)):
            return Refused(f"must be {span}, got {value:g}")
        return value

    parse.__name__ = "real"
    return parse


def seed() -> Callable[[str], object]:
    """An argparse type: a random seed, 0..2**64-1."""
    return integer(0, MAX_SEED)


def refusal(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Optional[str]:
    """The one-line message of the first refused numeric option of `args` (in the parser's order), or None."""
    for action in parser._actions:  # noqa: SLF001 -- argparse keeps its options here, in definition order
        value = getattr(args, action.dest, None)
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, Refused):
                flag = max(action.option_strings, key=len) if action.option_strings else action.dest
                return f"{flag} {item.reason}"
    return None


def checked(parser: argparse.ArgumentParser, run: Callable[[argparse.Namespace], int]):
    """`run`, preceded by the numeric options' verdict: UsageError (one line, exit status 2) for a refused value."""

    def run_checked(args: argparse.Namespace) -> int:
        message = refusal(parser, args)
        if message is not None:
            raise UsageError(message)
        return run(args)

    run_checked.__name__ = getattr(run, "__name__", "run")
    run_checked.__wrapped__ = run
    return run_checked
