"""Writing the report's files, and ``zerotune report RESULTS_DIR``.

`write_report` writes ``results.json``, ``results.csv`` and ``report.html``, each whole or not at all
(`zerotune.run.store.write_text_atomic`). The tuner calls it through `Refresher` as experiments finish and when it
ends; there a failure is logged, never raised: the report never fails a tuning. ``zerotune report`` builds the same
files from a results dir on disk (`zerotune.report.disk.load`), finished, running or interrupted.
"""
from __future__ import annotations

import argparse
import logging
import threading
import time
from pathlib import Path
from typing import Callable

from zerotune.core.errors import ConfigError
from zerotune.report import html, table_export
from zerotune.report.data import RESULTS_JSON, ReportData, TrainingPlan
from zerotune.report.disk import load
from zerotune.run.store import write_text_atomic

logger = logging.getLogger(__name__)

REPORT_HTML = "report.html"
RESULTS_CSV = "results.csv"
REFRESH_S = 5.0
"""While tuning, the report is rewritten at most this often, seconds (each write holds plotly.js, about 5 MB);
the last write, when the tuning ends, is never skipped."""


def write_report(results_dir: Path, data: ReportData) -> list[Path]:
    """Write ``results.json``, ``results.csv`` and ``report.html`` into ``results_dir`` (created if missing), every
    text made before the first file is written; returns the paths written.

    Raises:
        OSError: a file cannot be written (that file is left as it was).
    """
    results_dir = Path(results_dir)
    texts = {RESULTS_JSON: table_export.json_text(data), RESULTS_CSV: table_export.csv_text(data),
             REPORT_HTML: html.page(data)}
    results_dir.mkdir(parents=True, exist_ok=True)
    for name, text in texts.items():
        write_text_atomic(results_dir / name, text)
    return [results_dir / name for name in texts]


class Refresher:
    """Keeps a running tuning's report up to date (thread-safe; the scheduler's threads call `refresh`).

    Args:
        gather: ``gather(state) -> ReportData`` of the tuning now, ``state`` one of `zerotune.report.data.STATES`.
        clock: seconds, monotonic.
    """

    def __init__(self, results_dir: Path, gather: Callable[[str], ReportData],
                 clock: Callable[[], float] = time.monotonic):
        self.results_dir = Path(results_dir)
        self._gather = gather
        self._clock = clock
        self._lock = threading.Lock()
        self._last = -float("inf")
        self.failures = 0

    def refresh(self, state: str = "running", force: bool = False) -> bool:
        """Rewrite the report unless one was written less than `REFRESH_S` ago (``force``: always); True when written.
        A failure is logged (the first as a warning) and counted, never raised."""
        with self._lock:
            if not force and self._clock() - self._last < REFRESH_S:
                return False
            self._last = self._clock()
            try:
                write_report(self.results_dir, self._gather(state))
            except Exception as e:  # the report is an extra: it never fails the tuning
                self.failures += 1
                log = logger.warning if self.failures == 1 else logger.debug
                log(f"zerotune: cannot write the report in {self.results_dir}: {e!r} (the tuning goes on)")
                return False
            return True


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register the ``report`` subcommand on the CLI's subparsers."""
    p = sub.add_parser("report", help="write report.html, results.csv and results.json from a results dir "
                                      "(finished, still running, or interrupted)")
    p.add_argument("results_dir", help="the tuning's results dir (autotuning.results_dir or --results-dir)")
    p.add_argument("--exps-dir", default=None, help="where its experiments are (default: the one results.json names, "
                                                    "else RESULTS_DIR/exps)")
    add_projection_options(p)


def add_projection_options(p: argparse.ArgumentParser) -> None:
    """``--train-samples``/``--train-steps``, ``--cost-per-device-hour`` and ``--peak-tflops``, on ``tune``, ``run``
    and ``report``."""
    g = p.add_argument_group("projection of the full training run (in report.html and results.json)")
    length = g.add_mutually_exclusive_group()
    length.add_argument("--train-samples", type=_positive_int, default=None, metavar="N",
                        help="samples the full training run will see")
    length.add_argument("--train-steps", type=_positive_int, default=None, metavar="N",
                        help="optimizer steps of the full training run")
    g.add_argument("--cost-per-device-hour", type=_non_negative, default=None, metavar="PRICE",
                   help="price of one device for one hour, e.g. 2.5: the projection gives the run's cost")
    g.add_argument("--peak-tflops", type=_positive, default=None, metavar="TFLOPS",
                   help="one device's peak TFLOP/s for MFU, e.g. 989 (default: by the CUDA device's name, "
                        "dense 16-bit; none on CPU)")


def training_plan(args: argparse.Namespace) -> TrainingPlan:
    """The `TrainingPlan` the projection options give."""
    return TrainingPlan(args.train_samples, args.train_steps, args.cost_per_device_hour, args.peak_tflops)


def run(args: argparse.Namespace) -> int:
    """``zerotune report``: write the files, print their paths; 0.

    Raises:
        ConfigError: not a results dir (exit status 2, naming it).
    """
    data = load(Path(args.results_dir), Path(args.exps_dir) if args.exps_dir else None, training_plan(args))
    try:
        paths = write_report(Path(args.results_dir), data)
    except OSError as e:
        raise ConfigError(f"{args.results_dir}: cannot write the report there: {e.strerror or e}") from None
    done = sum(1 for e in data.experiments if e.status is not None)
    print(f"zerotune: report of {done} launch(es) ({data.state}): " + ", ".join(str(p) for p in paths))
    return 0


def _positive_int(text: str) -> int:
    try:
        value = int(float(text)) if "e" in text.lower() else int(text)
    except (ValueError, OverflowError):  # OverflowError: 1e400 is inf
        raise argparse.ArgumentTypeError(f"{text!r}: expected a positive whole number, e.g. 1000000 or 1e6") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a positive whole number")
    return value


def _non_negative(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a price, e.g. 2.5") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a non-negative price")
    return value


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected TFLOP/s, e.g. 989") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a positive, finite TFLOP/s")
    return value
