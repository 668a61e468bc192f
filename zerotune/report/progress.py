"""Live progress of a tuning run: experiments done / running / queued, the current best, the time.

`Progress` is fed by the scheduler's ``on_update(exp, event)`` callbacks. It prints one log line per experiment
start and end, the same whether or not the console is a terminal (logs and CI output read the same), and on a
terminal keeps a live status line under them (``rich.live.Live``).
"""
from __future__ import annotations

import threading
import time
from typing import Callable

from rich.console import Console
from rich.live import Live
from rich.spinner import Spinner
from rich.text import Text

from zerotune.core.experiment import Experiment, ExperimentKind, Status
from zerotune.core.objective import Objective
from zerotune.core.stopping import EARLY_ENDS
from zerotune.core.units import format_bytes

EVENTS = ("queued", "start", "end", "cached")


class Progress:
    """Progress display of one tuning run (thread-safe): use as a context manager (or ``start()``/``stop()``) around
    the run, with `update` as the scheduler's ``on_update``.

    Args:
        console: on a terminal (``console.is_terminal``) a live status line is shown under the log lines.
        objective: the metric and its direction, for "the current best".
        clock: seconds, monotonic.
        refresh_per_second: live redraws per second (the elapsed time ticks between events).
    """

    def __init__(self, console: Console, objective: Objective, clock: Callable[[], float] = time.monotonic,
                 refresh_per_second: float = 4):
        self.console = console
        self.objective = objective
        self._clock = clock
        self._refresh = refresh_per_second
        self._lock = threading.Lock()
        self._t0 = clock()
        self._live: Live | None = None
        self.done = 0
        self.ok = 0
        self.running = 0
        self.queued = 0
        self.best: Experiment | None = None

    # -- lifecycle ----------------------------------------------------------------------------------
    def start(self, t0: float | None = None) -> None:
        """Start the clock (at ``t0`` if given, from ``clock``) and, on a terminal, the live line."""
        self._t0 = self._clock() if t0 is None else t0
        if self.console.is_terminal and self._live is None:
            self._live = Live(console=self.console, get_renderable=self.render, refresh_per_second=self._refresh,
                              transient=True, redirect_stdout=False, redirect_stderr=False)
            self._live.start()

    def stop(self) -> None:
        """Remove the live line (log lines stay). Safe to call twice or without ``start``."""
        live, self._live = self._live, None
        if live is not None:
            live.stop()

    def __enter__(self) -> "Progress":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def elapsed_s(self) -> float:
        """Seconds since ``start``."""
        return self._clock() - self._t0

    # -- the scheduler's callback -----------------------------------------------------------------
    def update(self, exp: Experiment, event: str) -> None:
        """Count the event and print its log line: ``start``, ``end`` and ``cached`` (``exp.status`` set); ``queued``
        only counts. An event not in `EVENTS` raises ValueError."""
        if event not in EVENTS:
            raise ValueError(f"unknown progress event {event!r}; expected one of {', '.join(EVENTS)}")
        with self._lock:
            if event == "queued":
                self.queued += 1
            elif event == "start":
                self.queued = max(0, self.queued - 1)
                self.running += 1
            else:
                if event == "end":
                    self.running = max(0, self.running - 1)
                self.done += 1
                if exp.status == Status.OK:
                    self.ok += 1
                if (exp.status == Status.OK and exp.metric is not None and exp.kind is not ExperimentKind.PROFILE
                        and (self.best is None or self.objective.better(exp.metric, self.best.metric))):
                    self.best = exp
            line = None if event == "queued" else self.line(exp, event)
        if line is not None:
            self.console.print(line, markup=False, highlight=False, soft_wrap=True)  # whole in a CI log too
        if self._live is not None:
            self._live.refresh()

    # -- what is shown ------------------------------------------------------------------------------
    def line(self, exp: Experiment, event: str) -> str:
        """The log line of an event, e.g. ``[  40.1s] done z1_mbs4_gas1: ok throughput=612.4 (27.8 s)``."""
        stamp = f"[{self.elapsed_s:6.1f}s]"
        if event == "start":
            est = f", estimate {format_bytes(exp.memory_bytes)}/rank" if exp.memory_bytes else ""
            return f"{stamp} start {exp.name}{est}"
        tag = "cached" if event == "cached" else "done"
        status = exp.status.value if exp.status is not None else "?"
        value = f"{exp.metric:.4g}" if exp.metric is not None else "-"
        if exp.metric is not None and exp.metric_rel_half_width is not None:
            value += f" ±{exp.metric_rel_half_width:.1%}"
        peak = f", peak {format_bytes(exp.peak_memory_bytes)}" if exp.peak_memory_bytes else ""
        ended = f", ended: {exp.ended.replace('_', ' ')}" if exp.ended in EARLY_ENDS else ""
        error = f" {exp.error}" if exp.error else ""
        return (f"{stamp} {tag} {exp.name}: {status} {self.objective.name}={value} "
                f"({exp.wall_s or 0:.1f} s{peak}{ended}){error}")

    def status_text(self) -> str:
        """The status line without decoration:
        ``done 3 (2 ok) · running 1 · queued 2 · best z1_mbs4_gas1 throughput=612.4 samples/s · 41.0 s``."""
        with self._lock:
            best = (f"best {self.best.name} {self.objective.name}={self.best.metric:.4g} "
                    f"{self.objective.unit}" if self.best is not None else "best -")
            return (f"done {self.done} ({self.ok} ok) · running {self.running} · queued {self.queued} · {best} · "
                    f"{self.elapsed_s:.1f} s")

    def render(self):
        """The live renderable: a spinner and `status_text`."""
        return Spinner("dots", text=Text(self.status_text()))
