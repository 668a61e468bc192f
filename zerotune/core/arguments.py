"""Command-line values: every option rejects the empty string and values its type cannot hold.

argparse passes each option's text through the option's ``type``. `reject_empty` wraps the type of
every option of a parser (its subcommands' too, positional arguments included, a script's own arguments
excepted) so that the empty string, what an unset shell variable gives (``--results-dir "$DIR"``), and text
holding a NUL character are refused before the type reads them; `whole` is the type of an option that
counts. argparse then prints ``zerotune tune: error: argument --results-dir: '': ...``, naming the option and
the value, and exits with status 2, as for any bad input (docs/decisions.md D304).
"""
from __future__ import annotations

import argparse
import functools
import math
from typing import Any, Callable

__all__ = ["MAX_COUNT", "reject_empty", "whole"]

MAX_COUNT = 2**20
"""The largest count of devices per node, nodes or model-parallel ranks an option takes (1,048,576): more than any
cluster has; zerotune lists a node's slots, so a larger count would take all of memory before any check."""


def whole(lo: int, hi: int) -> Callable[[str], int]:
    """The argparse type of an option that takes a whole number from ``lo`` to ``hi`` (``"8"``, not ``"8.0"`` or
    ``"1e3"``).

    Raises (from the returned function):
        argparse.ArgumentTypeError: ``"'70000': expected a whole number from 0 to 65535"``.
    """
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number from {lo} to {hi}")
        return value
    parse.__name__ = "int"
    return parse


def positive_number(text: str) -> float:
    """The argparse type of an option that takes a finite number above 0 (``"0.5"``, ``"2"``).

    Raises:
        argparse.ArgumentTypeError: ``"'0': expected a number above 0, e.g. 0.5"``.
    """
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number above 0, e.g. 0.5")
    return value


def _nonempty(kind: Callable[[str], Any] | None) -> Callable[[str], Any]:
    """``kind`` (None: the text itself), refusing the empty string and a NUL character first."""
    inner = kind or str

    @functools.wraps(inner)
    def parse(text: str) -> Any:
        if text == "":
            raise argparse.ArgumentTypeError("'': expected a value, not the empty string (an unset shell variable?)")
        if "\0" in text:
            raise argparse.ArgumentTypeError(f"{text!r}: holds a NUL character, which no argument can")
        return inner(text)
    return parse


def reject_empty(parser: argparse.ArgumentParser) -> None:
    """Make every option and positional argument of ``parser`` and of its subcommands refuse the empty string
    and a NUL character (argparse's exit status 2 naming the option and the value), except arguments taken as
    they are (``argparse.REMAINDER``: a training script's own arguments) and flags without a value.

    An option's default is read through its type too when it is a string, so a default is None or non-empty.
    """
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):
                reject_empty(sub)
        elif action.nargs not in (0, argparse.REMAINDER):
            action.type = _nonempty(action.type)
