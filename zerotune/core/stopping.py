"""Adaptive experiments: when a running experiment has told us enough, and why it ended.

A backend reads the step probe's streams while an experiment runs and asks :meth:`StopRule.check`
after each new step; when it answers, the backend stops the run with the same clean process-group
stop as a timeout, and the experiment is OK with the probe's metric (:mod:`zerotune.core.measure`).
The experiment records why it ended (:class:`EndReason`). The rule ends a run as soon as either:

- **precise**: its metric is known to the target precision: the 95% interval's relative
  half-width is at most :attr:`StopRule.precision` (2% by default), after at least
  :attr:`StopRule.min_steady_steps` steady steps; or
- **cannot beat**: its whole interval lies on the losing side of the bar the strategy set for it
  (``Experiment.must_beat``: the incumbent's pessimistic bound, run-to-run noise included). Its optimistic bound, the
  metric times ``1 + half-width`` (``1 - half-width`` where lower is better), cannot beat the
  incumbent, so more steps would only sharpen a number that loses. This is the median-stopping
  and successive-halving idea of Ray Tune's and Optuna's pruners (stop a trial whose intermediate
  result cannot win), applied inside one experiment, with the interval instead of a quantile.

Otherwise the run goes on to its cap: DeepSpeed's engine exits after ``end_profile_step`` (its
autotuning protocol), or the experiment timeout. The rule never ends a run before
``min_steady_steps`` steady steps, whatever the bar: one step's interval is not an interval.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from zerotune.core.measure import RUN_NOISE, Streams, measure
from zerotune.core.objective import Objective

__all__ = ["DEFAULT_PRECISION", "EARLY_ENDS", "EndReason", "MIN_STEADY_STEPS", "StopRule", "must_beat"]

DEFAULT_PRECISION = 0.02
"""Target relative half-width of a metric's 95% interval (0.02 = ±2%)."""

MIN_STEADY_STEPS = 3
"""Steady steps (warm-up left out) before the rule may end a run."""


class EndReason(str, enum.Enum):
    """Why an experiment's run ended (``Experiment.ended``)."""

    PRECISE = "precise"  # zerotune ended it: its metric reached the target precision
    CANNOT_BEAT = "cannot_beat"  # zerotune ended it: its interval lies wholly below the incumbent's bar
    STEP_CAP = "step_cap"  # it ran to the cap: DeepSpeed's engine exited after end_profile_step
    EXITED = "exited"  # it ended on its own otherwise (a failure, an OOM, the script's end)
    STOPPED = "stopped"  # the backend killed it: timeout, hang, or the tuner interrupted

    @property
    def early(self) -> bool:
        """True when zerotune ended a healthy run before its cap (its steps were enough)."""
        return self in (EndReason.PRECISE, EndReason.CANNOT_BEAT)


EARLY_ENDS = frozenset(r.value for r in EndReason if r.early)
"""The ``Experiment.ended`` values of runs zerotune ended early (they told enough)."""


@dataclass(frozen=True)
class StopRule:
    """When to end a running experiment (see the module docstring).

    Attributes:
        objective: the metric tuned; only throughput and latency are measured by the probe, so
            for flops the rule never ends a run.
        precision: target relative half-width of the 95% interval (0.02 = ±2%); 0 turns the
            precision stop off.
        min_steady_steps: steady steps needed before any stop.
    """

    objective: Objective
    precision: float = DEFAULT_PRECISION
    min_steady_steps: int = MIN_STEADY_STEPS

    def check(self, streams: Streams, bar: float | None = None) -> EndReason | None:
        """Whether the run whose probe streams are ``streams`` (so far) can end now.

        Args:
            streams: rank -> the probe's step records so far (:func:`zerotune.probe.read_streams`).
            bar: the run's ``must_beat`` (None: no incumbent, only the precision stop applies).

        Returns:
            :attr:`EndReason.PRECISE`, :attr:`EndReason.CANNOT_BEAT`, or None to go on.
        """
        m = measure(streams, self.objective)
        if m is None or m.steady_steps < self.min_steady_steps or m.rel_half_width is None:
            return None
        if m.rel_half_width <= self.precision:
            return EndReason.PRECISE
        if bar is not None:
            higher = self.objective.higher_is_better
            optimistic = m.value * (1 + m.rel_half_width) if higher else m.value * (1 - m.rel_half_width)
            if (optimistic < bar) if higher else (optimistic > bar):
                return EndReason.CANNOT_BEAT
        return None


def must_beat(objective: Objective, incumbent: float, rel_half_width: float | None, runs: int = 1) -> float:
    """The bar for a run racing ``incumbent`` (a metric known to ``rel_half_width``, 0.02 = ±2%, pooled
    over ``runs`` runs): the incumbent's pessimistic bound with the run-to-run noise of a comparison,
    ``incumbent * (1 - n)`` where higher is better and ``incumbent * (1 + n)`` where lower is, with
    ``n = sqrt(hw ** 2 + (2 r) ** 2 / runs + (2 r) ** 2)``, ``r`` the run-to-run noise
    (:data:`~zerotune.core.measure.RUN_NOISE`): the incumbent's interval and run term, and the racing
    run's run term.
    A run ended below it (its optimistic bound, value times ``1 + hw``, under the bar) differs from the
    incumbent by more than their comparison noise, so the strategy's noise tests
    (:func:`zerotune.strategy.mbs.within_noise`) read it as a clear loss, not a tie to re-measure."""
    n = math.sqrt((rel_half_width or 0.0) ** 2 + (2 * RUN_NOISE) ** 2 / max(1, runs) + (2 * RUN_NOISE) ** 2)
    return incumbent * (1 - n) if objective.higher_is_better else incumbent * (1 + n)
