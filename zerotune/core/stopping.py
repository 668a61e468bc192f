"""Adaptive experiments: when a running experiment has told us enough, and why it ended (D4, D201, D323).

Rules (`StopRule.check`, asked after each new step of the step probe): a run ends, OK with the probe's metric, once it
is **precise** (its 95% interval's relative half-width is at most the target precision) or **cannot beat** the bar
the strategy set (``Experiment.must_beat``, `zerotune.core.noise.cannot_beat`), never before `MIN_STEADY_STEPS`
steady steps. Otherwise it runs to ``end_profile_step`` or the timeout; an adaptive run may go past it (up to
`extended_end_step`) only while the steps cost no more than a new launch and can still reach the precision
(`StopRule._extension_pays`). Each run records why it ended (`EndReason`).
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
    """When to end a running experiment (module docstring): ``precision`` is the target relative half-width of the
    95% interval (0.02 = ±2%; 0: no precision stop); for flops, which the probe does not measure, no run is ended."""

    objective: Objective
    precision: float = DEFAULT_PRECISION
    min_steady_steps: int = MIN_STEADY_STEPS

    def check(self, streams: Streams, bar: float | None = None, cap_step: int | None = None,
              startup_s: float | None = None) -> EndReason | None:
        """`EndReason.PRECISE`, `EndReason.CANNOT_BEAT` or `EndReason.STEP_CAP` (at the cap, an extension does not
        pay) when the run whose probe streams so far are ``streams`` can end now; None to go on.

        Args:
            bar: the run's ``must_beat`` (None: only the precision stop applies).
            cap_step: with an extended exit (`extended_end_step`), the probe's step at which the engine would have
                exited (``end_profile_step + 1``: the exiting step is recorded too); None: the engine's exit.
            startup_s: seconds from the launch to the run's first step, the extension budget (`_extension_pays`);
                None: no extension.
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
        """Past the cap: whether more steps can still make the metric precise (`steps_to_precision`) within the
        budget, the run's own start-up time ``startup_s`` (what a re-measurement would spend again, D201). A script
        whose loop ends meanwhile ends the run short of the precision (`EndReason.SCRIPT_END`, D323)."""
        if not startup_s or startup_s <= 0 or self.precision <= 0 or m is None or not m.rel_half_width:
            return False
        spent = _time_at(streams, _last_step(streams)) - _time_at(streams, cap_step)
        left_steps = (startup_s - spent) / m.mean_step_s
        needed = steps_to_precision(m.steady_steps, m.rel_half_width, self.precision)
        return 0 < needed <= left_steps


def steps_to_precision(steady_steps: int, rel_half_width: float, precision: float) -> float:
    """More steady steps a run of ``steady_steps`` known to ``rel_half_width`` (relative 95% half-width) needs to be
    known to ``precision``: the interval narrows as the square root of the steps, so
    ``steady_steps * ((rel_half_width / precision) ** 2 - 1)``; 0 when already precise or ``precision`` is 0."""
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
