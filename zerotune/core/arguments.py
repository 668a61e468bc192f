"""Command-line values: every option rejects the empty string and values its type cannot hold (D304).

`reject_empty` makes every argument of a parser refuse the empty string (an unset shell variable,
``--results-dir "$DIR"``) and a NUL character before its type reads them; `whole` is the type of an option that
counts. argparse then names the option and the value and exits with status 2, as for any bad input.
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
    """The argparse type of an option that takes a whole number from ``lo`` to ``hi`` (``"8"``, not ``"8.0"``).

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
    """Make every argument of ``parser`` and its subcommands refuse the empty string and a NUL character, except
    ``argparse.REMAINDER`` ones (a training script's own arguments) and flags without a value. A string default is
    read through the type too, so a default is None or non-empty."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):
                reject_empty(sub)
        elif action.nargs not in (0, argparse.REMAINDER):
            action.type = _nonempty(action.type)
