"""Measured micro batch sizes: a :class:`Point` per mbs, a stage's :class:`MbsTrace`, and the value helpers the
mbs search (:mod:`~zerotune.strategy.mbs`) and its fine pass (:mod:`~zerotune.strategy.fine`) share.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Callable, Sequence

from zerotune.core.experiment import Experiment, Status
from zerotune.core.measure import RUN_NOISE, Pooled, comparison_noise
from zerotune.core.objective import Objective
from zerotune.strategy.answer import rising_candidates
from zerotune.strategy.capacity import Capacity, capacity


class StopReason(str, enum.Enum):
    """Why :func:`search_mbs` stopped climbing."""

    INFEASIBLE = "infeasible"  # the smallest mbs did not run
    PLATEAU = "plateau"  # a step improved the best metric by less than the threshold
    BOUNDARY = "boundary"  # the largest runnable mbs lies between a runnable and a failing one
    CAP = "cap"  # reached the largest mbs allowed
    PREDICTED = "predicted"  # the throughput model: no larger mbs can beat the best by the precision


@dataclass(frozen=True)
class Point:
    """One measured micro batch size: its metric pooled over ``runs`` runs (re-measurements)."""

    mbs: int
    status: Status
    metric: float | None = None
    runs: int = 1
    rel_half_width: float | None = None  # of one run's 95% interval (None: unknown, or pooled)
    run_noise: float = RUN_NOISE  # the run-to-run noise (relative sigma) known when it was measured
    memory_fraction: float | None = None  # its measured peak over the per-device budget (None: unknown)
    calm_mbs: int | None = None  # the largest mbs the memory model puts under NEAR_CAPACITY (None: unknown)
    refusal: str = ""  # Status.REFUSED: why it was not launched ("not launched: predicted ... over the budget")

    @property
    def ok(self) -> bool:
        return self.status == Status.OK

    @property
    def capacity(self) -> Capacity:
        """How near the device's capacity it ran (:func:`~zerotune.strategy.capacity.capacity`)."""
        return capacity(self.memory_fraction)


def refusals(points: Sequence[Point]) -> list[str]:
    """What the memory model refused among ``points``, in order, for a decision's reason: ``probe at mbs=16 not
    launched: predicted 2.61 GiB per rank, ... over the 2.50 GiB budget`` each."""
    return [f"probe at mbs={p.mbs} {p.refusal}" for p in points if p.status is Status.REFUSED]


def launched(points: Sequence[Point]) -> bool:
    """Whether any of ``points`` was launched: neither refused by the memory model nor skipped by the throughput
    model."""
    return any(p.status not in (Status.REFUSED, Status.SKIPPED) for p in points)


def within_noise(gain: float, a: Point, b: Point, threshold: float) -> bool:
    """Whether a relative difference ``gain`` between two measured points could be noise: smaller in
    size than their :func:`~zerotune.core.measure.comparison_noise` (each point's interval, an unknown
    or pooled one counting as ``threshold``, plus the run-to-run noise, less for pooled points; the
    larger of the two points' ``run_noise``)."""
    return abs(gain) < comparison_noise([a.rel_half_width, b.rel_half_width], [a.runs, b.runs], floor=threshold,
                                        run_noise=max(a.run_noise, b.run_noise))


def pooled_point(exp: Experiment, pooled: Pooled, run_noise: float) -> Point:
    """``exp``'s point on its metric pooled over its ok runs: one run keeps its interval, pooled ones count as
    :func:`within_noise`'s ``threshold``; ``run_noise`` the run-to-run noise known now."""
    return Point(exp.mbs, Status.OK, pooled.value, pooled.runs,
                 exp.metric_rel_half_width if pooled.runs == 1 else None, run_noise=run_noise)


def replica_decides(gain: float, a: Point, b: Point, threshold: float, precision: float | None) -> bool:
    """Whether another run can decide between two measured points whose relative difference is ``gain``: it is
    within their noise (:func:`within_noise`), no tie (:func:`tie`), and their own runs' intervals alone (an
    unknown or pooled one counting as ``threshold``) would tell them apart, so the run-to-run noise, which only
    another launch samples, is what blocks. Where the runs' own intervals are wider than the difference, steps
    would decide, not a launch: the stop rule buys them while a run goes on, up to what a launch costs
    (:mod:`zerotune.core.stopping`); beyond that, the better reading stands (docs/decisions.md, D307)."""
    own = comparison_noise([a.rel_half_width, b.rel_half_width], [a.runs, b.runs], floor=threshold, run_noise=0.0)
    return within_noise(gain, a, b, threshold) and not tie(gain, precision) and abs(gain) >= own


def tie(gain: float, precision: float | None) -> bool:
    """Whether a relative difference ``gain`` is within the target ``precision`` (None: never): a tie, which no
    re-measurement is run to break, since either side moves the answer by no more than the precision promised."""
    return precision is not None and abs(gain) < precision


@dataclass
class MbsTrace:
    """What :func:`search_mbs` tried, in order, and why it stopped (``stop`` is None until the search stops;
    a probe-only trace keeps None)."""

    points: list[Point] = field(default_factory=list)
    stop: StopReason | None = None

    @property
    def ok_points(self) -> list[Point]:
        return [p for p in self.points if p.ok]

    def best(self, objective: Objective) -> Point | None:
        """The runnable point with the best metric (the first one on ties)."""
        return objective.best(self.ok_points, lambda p: p.metric)

    def answer(self, objective: Objective) -> Point | None:
        """The point the answer rule (:mod:`zerotune.strategy.answer`) picks among this stage's: for
        throughput, the calm points as one curve rising with mbs, each other point on its own reading; for
        latency, or without calm points, the best reading (:meth:`best`)."""
        best = self.best(objective)
        if best is None or not objective.higher_is_better:
            return best
        pairs = rising_candidates(self.ok_points, mbs=lambda p: p.mbs, value=lambda p: p.metric, runs=lambda p: p.runs,
                                  calm=lambda p: p.capacity is Capacity.CALM)
        return objective.best(pairs, lambda c: c[0])[1]

    def get(self, mbs: int) -> Point | None:
        return next((p for p in self.points if p.mbs == mbs), None)

    def update(self, points: Sequence[Point]) -> None:
        """Replace the points at these points' mbs (re-measured, pooled), keeping their order."""
        new = {p.mbs: p for p in points}
        self.points = [new.get(p.mbs, p) for p in self.points]


Evaluate = Callable[[Sequence[int]], Sequence[Point]]
"""Runs experiments at these mbs values (a batch, possibly in parallel) and returns their points."""

Confirm = Callable[[Sequence[int]], Sequence[Point]]
"""Re-measures these (already measured) mbs values once more, interleaved, and returns their points
pooled over all their runs."""


def runner(trace: MbsTrace, evaluate: Evaluate) -> Callable[[Sequence[int]], list[Point]]:
    """``run(batch)``: the points of ``trace`` at these mbs values, evaluating (and recording) those not
    measured yet."""
    def run(batch: Sequence[int]) -> list[Point]:
        todo = [m for m in batch if trace.get(m) is None]
        if todo:
            trace.points.extend(evaluate(todo))
        return [trace.get(m) for m in batch]
    return run


def largest_within(values: Sequence[int], bound: int) -> int:
    """The largest of the sorted, non-empty ``values`` at most ``bound`` (the smallest value when none is)."""
    return max([m for m in values if m <= bound], default=values[0])


def middle(values: Sequence[int], low: int, high: int) -> int | None:
    """The allowed value halfway strictly between ``low`` and ``high`` (``(low + high) // 2`` when
    every integer is allowed); None when there is none."""
    inside = [m for m in values if low < m < high]
    return inside[(len(inside) - 1) // 2] if inside else None
