"""zerotune's log on a rich console: every module logs through ``logging.getLogger(__name__)``, under the
``zerotune`` logger; `to_console` sends those lines to a console while a tuning runs.

Levels: decisions (the memory model's verdicts, each stage's decision, re-measurements) are INFO; what a user should
act on (a stale lock, results that cannot be written) is WARNING. ``--quiet`` shows warnings only, ``--verbose``
adds DEBUG; to silence one module: ``logging.getLogger("zerotune.strategy.gas_phase").setLevel(logging.WARNING)``.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Iterator

from rich.console import Console

ROOT = "zerotune"
"""The logger every zerotune module's logger sits under."""


class ConsoleHandler(logging.Handler):
    """Prints each record's message as one plain line on a rich console (no markup, no highlighting)."""

    def __init__(self, console: Console):
        super().__init__()
        self.console = console

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.console.print(self.format(record), markup=False, highlight=False)
        except Exception:  # a log line never stops a tuning
            self.handleError(record)


@contextlib.contextmanager
def to_console(console: Console) -> Iterator[None]:
    """While inside, zerotune's log lines go to ``console``; INFO shows where the ``zerotune`` logger has no level."""
    logger = logging.getLogger(ROOT)
    handler = ConsoleHandler(console)
    level = logger.level
    if level == logging.NOTSET:
        logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def set_verbosity(quiet: bool = False, verbose: bool = False) -> None:
    """``--quiet`` (warnings and errors only) or ``--verbose`` (DEBUG too) for every zerotune module."""
    if quiet or verbose:
        logging.getLogger(ROOT).setLevel(logging.WARNING if quiet else logging.DEBUG)
