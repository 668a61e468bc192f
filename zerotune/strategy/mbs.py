"""The micro-batch search of one ZeRO stage: which mbs values to try, in what order, and when to stop.

:func:`search_mbs` never launches anything: it hands batches of mbs values to an ``evaluate``
callable and learns from the outcomes (``Status`` and metric). In order: the smallest mbs; a
doubling ladder that lands on the memory model's estimate and may go above it; a binary search
between the last runnable and the first failing mbs; plateau detection (stop when the metric
improves by less than ``threshold``); and a fine pass that bisects around the best mbs. Why it
stopped is a :class:`StopReason`.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Callable, Sequence

from zerotune.core.experiment import Status
from zerotune.core.objective import Objective


class StopReason(str, enum.Enum):
    """Why :func:`search_mbs` stopped climbing."""

    INFEASIBLE = "infeasible"  # the smallest mbs did not run
    PLATEAU = "plateau"  # a step improved the best metric by less than the threshold
    BOUNDARY = "boundary"  # the largest runnable mbs lies between a runnable and a failing one
    CAP = "cap"  # reached the largest mbs allowed

@dataclass(frozen=True)
class Point:
    """One measured micro batch size."""

    mbs: int
    status: Status
    metric: float | None = None

    @property
    def ok(self) -> bool:
        return self.status == Status.OK


@dataclass
class MbsTrace:
    """What :func:`search_mbs` tried, in order, and why it stopped.

    ``stop`` is None until the search stops (a probe-only trace keeps None).
    """

    points: list[Point] = field(default_factory=list)
    stop: StopReason | None = None

    @property
    def ok_points(self) -> list[Point]:
        return [p for p in self.points if p.ok]

    def best(self, objective: Objective) -> Point | None:
        """The runnable point with the best metric (the first one on ties)."""
        return objective.best(self.ok_points, lambda p: p.metric)

    def get(self, mbs: int) -> Point | None:
        return next((p for p in self.points if p.mbs == mbs), None)


Evaluate = Callable[[Sequence[int]], Sequence[Point]]
"""Runs experiments at these mbs values (a batch, possibly in parallel) and returns their points."""


def search_mbs(evaluate: Evaluate, *, lo: int, hi: int, estimate: int, objective: Objective,
               threshold: float = 0.01, num_fine: int = 3, known: Sequence[Point] = ()) -> MbsTrace:
    """Search the micro batch size of one stage.

    Args:
        evaluate: runs a batch of mbs values and returns one :class:`Point` each.
        lo, hi: smallest and largest mbs allowed (``min/max_train_micro_batch_size_per_gpu``,
            and the ``max_train_batch_size`` bound).
        estimate: the memory model's largest fitting mbs; the ladder lands on it exactly and
            may continue above it (doubling) when it runs.
        objective: the metric's direction.
        threshold: plateau threshold: a step that improves the best metric by less than this
            fraction ends the upward search.
        num_fine: experiments allowed in the fine pass around the best mbs.
        known: points already measured for this stage (reused, not re-run). When one of them
            ran, the smallest mbs is not run (memory grows with mbs) and the ladder starts at
            the largest known runnable mbs.

    Returns:
        The trace, in evaluation order (``known`` points first).
    """
    trace = MbsTrace(points=list(known))

    def run(values: Sequence[int]) -> list[Point]:
        todo = [m for m in values if trace.get(m) is None]
        if todo:
            trace.points.extend(evaluate(todo))
        return [trace.get(m) for m in values]

    known_ok = [p.mbs for p in trace.ok_points]
    if known_ok:  # e.g. a probe: memory grows with mbs, so lo runs too; climb from the largest known
        prev = max(known_ok)
    else:
        (first,) = run([lo])
        if not first.ok:
            trace.stop = StopReason.INFEASIBLE
            return trace
        prev = lo
    best = trace.best(objective)
    estimate = max(lo, min(estimate, hi))
    while True:
        if prev >= hi:
            trace.stop = StopReason.CAP
            break
        nxt = next_mbs(prev, estimate, hi)
        (p,) = run([nxt])
        if not p.ok:
            trace.stop = _bisect(run, trace, prev, nxt, objective, threshold)
            break
        improved = objective.gain(p.metric, best.metric)
        if objective.better(p.metric, best.metric):
            best = p
        if improved < threshold:
            trace.stop = StopReason.PLATEAU
            break
        prev = nxt

    _fine_pass(run, trace, objective, num_fine)
    return trace


def next_mbs(prev: int, estimate: int, hi: int) -> int:
    """The ladder's next mbs after a runnable ``prev``: double it, but land on the memory
    estimate when doubling would jump over it, and never exceed ``hi``."""
    nxt = prev * 2
    if prev < estimate < nxt:
        nxt = estimate
    return min(nxt, hi)


def _bisect(run, trace: MbsTrace, ok: int, fail: int, objective: Objective, threshold: float) -> StopReason:
    """Binary search for the largest runnable mbs in (ok, fail); stops early on a plateau."""
    while fail - ok > 1:
        mid = (ok + fail) // 2
        best = trace.best(objective)
        (p,) = run([mid])
        if p.ok:
            ok = mid
            if objective.gain(p.metric, best.metric) < threshold:
                return StopReason.PLATEAU
        else:
            fail = mid
    return StopReason.BOUNDARY


def _fine_pass(run, trace: MbsTrace, objective: Objective, budget: int) -> None:
    """Bisect the gaps next to the best mbs (below and above), up to ``budget`` experiments."""
    while budget > 0:
        best = trace.best(objective)
        below = [p.mbs for p in trace.ok_points if p.mbs < best.mbs]
        above = [p.mbs for p in trace.points if p.mbs > best.mbs]
        candidates = []
        if above:
            candidates.append((best.mbs + min(above)) // 2)
        if below:
            candidates.append((best.mbs + max(below)) // 2)
        candidates = [m for m in candidates if trace.get(m) is None][:budget]
        if not candidates:
            return
        budget -= len(candidates)
        run(candidates)
