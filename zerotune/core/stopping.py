"""Adaptive experiments: when a running experiment has told us enough, and why it ended.

A backend reads the step probe's streams while an experiment runs and asks `StopRule.check`
after each new step; when it answers, the backend stops the run with the same clean process-group
stop as a timeout, and the experiment is OK with the probe's metric (`zerotune.core.measure`).
The experiment records why it ended (`EndReason`). The rule ends a run as soon as either:

- **precise**: its metric is known to the target precision: the 95% interval's relative
  half-width is at most `StopRule.precision` (2% by default,
  `zerotune.core.noise.DEFAULT_PRECISION`), after at least `StopRule.min_steady_steps`
  steady steps; or
- **cannot beat**: its whole interval lies on the losing side of the bar the strategy set for it
  (``Experiment.must_beat``: the incumbent's pessimistic bound, run-to-run noise included,
  `zerotune.core.noise.must_beat`). Its optimistic bound, the metric times ``1 + half-width``
  (``1 - half-width`` where lower is better), cannot beat the incumbent
  (`zerotune.core.noise.cannot_beat`), so more steps would only sharpen a number that loses. This
  is the median-stopping and successive-halving idea of Ray Tune's and Optuna's pruners (stop a trial
  whose intermediate result cannot win), applied inside one experiment, with the interval instead of a
  quantile.

Otherwise the run goes on to its cap: DeepSpeed's engine exits after ``end_profile_step`` (its
autotuning protocol), or the experiment timeout. The rule never ends a run before
``min_steady_steps`` steady steps, whatever the bar: one step's interval is not an interval.

**Extension.** A run that reaches ``end_profile_step`` without being precise may go on (the backend
writes a later engine exit, `extended_end_step`) while more steps cost less than a new launch
would: the steps past the cap may take at most the run's own start-up time (launcher, rank start,
model and engine construction: what a re-measurement would spend again before its first step), and
only while the interval can still reach the precision within that time (it narrows as the square
root of the steps: ``n * (hw / precision) ** 2`` steady steps are needed). The run then ends
``step_cap`` at the cap or as soon as it is precise. Where a launch costs much more than a step, a noisy
run gets more steps instead of a second run; where a step costs as much as a launch, it gets none
(docs/decisions.md, D201). A script whose own loop ends during an extension ends the run there, short of the
precision (`EndReason.SCRIPT_END`): the summary says how many more steps it needed
(`steps_to_precision`), and ``autotuning.max_steps_arg`` raises the script's steps for the runs (D323).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

from zerotune.core.measure import Measurement, Streams, measure
from zerotune.core.noise import DEFAULT_PRECISION, cannot_beat, precise
from zerotune.core.objective import Objective

__all__ = ["EARLY_ENDS", "EXTENSION_FACTOR", "EndReason", "MIN_STEADY_STEPS", "StopRule", "extended_end_step",
           "steps_to_precision"]

MIN_STEADY_STEPS = 3
"""Steady steps (warm-up left out) before the rule may end a run."""


EXTENSION_FACTOR = 5
"""With adaptive runs, DeepSpeed's engine exits at this many times ``end_profile_step`` (the hard cap);
the stop rule ends each run at ``end_profile_step`` unless the extension pays (module docstring)."""


def extended_end_step(end_profile_step: int) -> int:
    """The ``end_profile_step`` written into an adaptive run's config: the hard cap of an extension."""
    return EXTENSION_FACTOR * end_profile_step


class EndReason(str, enum.Enum):
    """Why an experiment's run ended (``Experiment.ended``)."""

    PRECISE = "precise"  # zerotune ended it: its metric reached the target precision
    CANNOT_BEAT = "cannot_beat"  # zerotune ended it: its interval lies wholly below the incumbent's bar
    STEP_CAP = "step_cap"  # it ran to the cap: end_profile_step (or past it, while an extension paid)
    SCRIPT_END = "script_end"  # past the cap on an extension, the script's own last step came before the precision
    EXITED = "exited"  # it ended on its own otherwise (a failure, an OOM, the script's end)
    STOPPED = "stopped"  # the backend killed it: timeout, hang, or the tuner interrupted

    @property
    def early(self) -> bool:
        """True when zerotune ended a healthy run before its cap (its steps were enough)."""
        return self in (EndReason.PRECISE, EndReason.CANNOT_BEAT)

    @property
    def by_rule(self) -> bool:
        """True when the stop rule ended the run (early, or at the cap after an extension did not pay):
        the run is OK from the probe's metric, without DeepSpeed's ``metrics.json``."""
        return self in (EndReason.PRECISE, EndReason.CANNOT_BEAT, EndReason.STEP_CAP, EndReason.SCRIPT_END)


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

    def check(self, streams: Streams, bar: float | None = None, cap_step: int | None = None,
              startup_s: float | None = None) -> EndReason | None:
        """Whether the run whose probe streams are ``streams`` (so far) can end now.

        Args:
            streams: rank -> the probe's step records so far (`zerotune.probe.read_streams`).
            bar: the run's ``must_beat`` (None: no incumbent, only the precision stop applies).
            cap_step: the probe's step at which DeepSpeed's engine would have exited
                (``end_profile_step + 1``: the exiting step is recorded too) when the run was launched
                with an extended exit (`extended_end_step`); None: the engine's exit is the cap.
            startup_s: seconds from the launch to the start of the run's first step (the extension
                budget, see the module docstring); None: no extension.

        Returns:
            `EndReason.PRECISE`, `EndReason.CANNOT_BEAT`, `EndReason.STEP_CAP` (the
            cap reached and an extension does not pay), or None to go on.
        """
        m = measure(streams, self.objective)
        if m is not None and m.steady_steps >= self.min_steady_steps and m.rel_half_width is not None:
            if precise(m.rel_half_width, self.precision):
                return EndReason.PRECISE
            if bar is not None and cannot_beat(self.objective, m.value, m.rel_half_width, bar):
                return EndReason.CANNOT_BEAT
        if cap_step is None or m is None or _last_step(streams) < cap_step:
            return None  # no measurement at the cap: the engine's own exit (or the script's end) ends it
        return None if self._extension_pays(streams, m, cap_step, startup_s) else EndReason.STEP_CAP

    def _extension_pays(self, streams: Streams, m: Measurement | None, cap_step: int,
                        startup_s: float | None) -> bool:
        """Past the cap: whether more steps can still make the metric precise within the budget
        (``startup_s`` of steps past the cap, see the module docstring)."""
        if not startup_s or startup_s <= 0 or self.precision <= 0 or m is None or not m.rel_half_width:
            return False
        spent = _time_at(streams, _last_step(streams)) - _time_at(streams, cap_step)
        left_steps = (startup_s - spent) / m.mean_step_s
        needed = steps_to_precision(m.steady_steps, m.rel_half_width, self.precision)
        return 0 < needed <= left_steps


def steps_to_precision(steady_steps: int, rel_half_width: float, precision: float) -> float:
    """How many more steady steps a run of ``steady_steps`` steps known to ``rel_half_width`` (relative 95%
    half-width) needs to be known to ``precision``: the interval narrows as the square root of the steps (their
    times' variance as measured), so ``steady_steps * ((rel_half_width / precision) ** 2 - 1)``; 0 when it is
    already known to the precision (and for a ``precision`` of 0, which never stops a run)."""
    if precision <= 0 or rel_half_width <= precision:
        return 0.0
    return steady_steps * ((rel_half_width / precision) ** 2 - 1)


def _last_step(streams: Streams) -> int:
    """The latest step every rank has recorded (0 before any)."""
    if not streams:
        return 0
    return min(max((r.step for r in records if r.step is not None), default=0) for records in streams.values())


def _time_at(streams: Streams, step: int) -> float:
    """When step ``step`` ended on the slowest rank (the probe's ``t``, seconds)."""
    return max((r.t for records in streams.values() for r in records if r.step == step and r.t is not None),
               default=0.0)
