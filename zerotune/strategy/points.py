"""Measured micro batch sizes: a `Point` per mbs, a stage's `MbsTrace`, the helpers the mbs search and its fine pass
share, and `SearchBounds`, the one frozen record of where every mbs search of a tuning may go.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

from zerotune.core.experiment import Experiment, Status
from zerotune.core.measure import Pooled
from zerotune.core.noise import RUN_NOISE
from zerotune.core.objective import Objective
from zerotune.strategy.answer import Capacity, capacity, rising_candidates


@dataclass(frozen=True)
class SearchBounds:
    """Where and how an mbs search may go (stage probes, mbs search, fine pass).

    Attributes:
        lo, hi: the smallest and largest mbs allowed (``min/max_train_micro_batch_size_per_gpu``, batch bounds).
        objective: the metric's direction.
        allowed: the mbs values to try (None: every integer), those within ``lo..hi`` only.
        threshold: the plateau threshold, a fraction: a step gaining less ends the upward search; a throughput
            search goes below its best only while a step down gains this much.
        precision: the target precision (relative half-width): a difference within it is a tie; None: never.
        num_fine: experiments allowed in the fine pass around the best mbs (0: none).
    """

    lo: int
    hi: int
    objective: Objective
    allowed: Sequence[int] | None = None
    threshold: float = 0.01
    precision: float | None = None
    num_fine: int = 3

    @property
    def values(self) -> list[int]:
        """The sorted mbs values a search may try: `allowed` (or every integer) within ``lo..hi``."""
        if self.allowed is None:
            return list(range(self.lo, self.hi + 1))
        return sorted({m for m in self.allowed if self.lo <= m <= self.hi})

    def coarse(self, cap: int) -> SearchBounds:
        """These bounds up to ``cap`` (below a variant's OOM run), without the fine pass: while stages are compared."""
        return replace(self, hi=min(self.hi, cap), num_fine=0)


class StopReason(str, enum.Enum):
    """Why `search_mbs` stopped climbing."""

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
        """How near the device's capacity it ran (`zerotune.strategy.answer.capacity`)."""
        return capacity(self.memory_fraction)


def refusals(points: Sequence[Point]) -> list[str]:
    """``probe at mbs=M`` and its refusal for each of ``points`` the memory model refused, in order."""
    return [f"probe at mbs={p.mbs} {p.refusal}" for p in points if p.status is Status.REFUSED]


def launched(points: Sequence[Point]) -> bool:
    """Whether any of ``points`` was launched (neither ``REFUSED`` nor ``SKIPPED``)."""
    return any(p.status not in (Status.REFUSED, Status.SKIPPED) for p in points)


def pooled_point(exp: Experiment, pooled: Pooled, run_noise: float) -> Point:
    """``exp``'s point on its metric pooled over its ok runs: one run keeps its interval, pooled ones count as the
    noise rules' floor (`zerotune.core.noise.within_noise`); ``run_noise`` the run-to-run noise known now."""
    return Point(exp.mbs, Status.OK, pooled.value, pooled.runs,
                 exp.metric_rel_half_width if pooled.runs == 1 else None, run_noise=run_noise)


@dataclass
class MbsTrace:
    """What `search_mbs` tried, in order, and why it stopped (``stop``: None until then, and in a probe-only trace)."""

    points: list[Point] = field(default_factory=list)
    stop: StopReason | None = None

    @property
    def ok_points(self) -> list[Point]:
        return [p for p in self.points if p.ok]

    def best(self, objective: Objective) -> Point | None:
        """The runnable point with the best metric (the first one on ties)."""
        return objective.best(self.ok_points, lambda p: p.metric)

    def answer(self, objective: Objective) -> Point | None:
        """The point the answer rule (`zerotune.strategy.answer`) picks among this stage's: for throughput the calm
        points as one rising curve, the others on their own reading; for latency the best reading (`best`)."""
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
    """``run(batch)``: ``trace``'s points at these mbs values, evaluating and recording the unmeasured ones."""
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
