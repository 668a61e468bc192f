"""The search strategy: which ZeRO stages and micro batch sizes to try, in what order.

It never launches anything: it hands batches of configurations to an ``evaluate`` callable and
learns from the outcomes (``Status`` and metric). Two pieces:

- :func:`search_mbs`: for one stage, the smallest runnable mbs, a doubling ladder that lands on
  the memory model's estimate and may go above it, a binary search between the last runnable
  and the first failing mbs, plateau detection (stop when the metric improves by less than
  ``threshold``), and a fine pass that bisects around the best mbs.
- :func:`explore_stages`: one loop over the candidate ZeRO stages, lowest first. A higher stage
  is explored only when the memory model says it fits and it could beat the best metric so far:
  either its larger memory headroom lets it reach an mbs whose optimistic metric (the best
  stage's curve extrapolated with its last observed gain per doubling) beats the best by the
  threshold, or a single probe at the best mbs measures it faster. Once a stage has measured
  slower than the best at the same mbs by more than the threshold, later stages (more
  communication) are not probed again; a tie within the threshold is noise and the next stage is
  probed too.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

from zerotune.core.experiment import Status
from zerotune.core.objective import Objective


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

    ``stop`` is one of ``infeasible`` (the smallest mbs did not run), ``plateau``, ``boundary``
    (largest runnable mbs found between a runnable and a failing one), ``cap`` (reached the
    largest mbs allowed).
    """

    points: list[Point] = field(default_factory=list)
    stop: str = ""

    @property
    def ok_points(self) -> list[Point]:
        return [p for p in self.points if p.ok]

    def best(self, objective: Objective) -> Point | None:
        best = None
        for p in self.ok_points:
            if best is None or objective.better(p.metric, best.metric):
                best = p
        return best

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
            trace.stop = "infeasible"
            return trace
        prev = lo
    best = trace.best(objective)
    estimate = max(lo, min(estimate, hi))
    while True:
        if prev >= hi:
            trace.stop = "cap"
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
            trace.stop = "plateau"
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


def mbs_ladder(lo: int, hi: int, estimate: int) -> list[int]:
    """The mbs values :func:`search_mbs` climbs when every one runs and improves: ``lo``, then
    :func:`next_mbs` up to the memory estimate, and the first value above it (the search tries
    one step past a cautious estimate). What ``--dry-run`` lists; ``[]`` when ``estimate < lo``
    (the stage is pruned).

    >>> mbs_ladder(1, 1024, 5)
    [1, 2, 4, 5, 10]
    """
    if estimate < lo:
        return []
    estimate = min(estimate, hi)
    ladder = [lo]
    while ladder[-1] < hi and ladder[-1] <= estimate:
        ladder.append(next_mbs(ladder[-1], estimate, hi))
    return ladder


def _bisect(run, trace: MbsTrace, ok: int, fail: int, objective: Objective, threshold: float) -> str:
    """Binary search for the largest runnable mbs in (ok, fail); stops early on a plateau."""
    while fail - ok > 1:
        mid = (ok + fail) // 2
        best = trace.best(objective)
        (p,) = run([mid])
        if p.ok:
            ok = mid
            if objective.gain(p.metric, best.metric) < threshold:
                return "plateau"
        else:
            fail = mid
    return "boundary"


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


@dataclass
class StageResult:
    """How one ZeRO stage was handled: ``explored``, ``probed`` (one experiment, slower),
    ``pruned`` (memory model: cannot fit at the smallest mbs), or ``skipped`` (could not beat)."""

    stage: int
    decision: str
    reason: str
    estimate: int = 0
    trace: MbsTrace = field(default_factory=MbsTrace)


@dataclass
class StagePlan:
    """What the memory model says of a stage: the largest fitting mbs (0 = does not fit)."""

    stage: int
    max_mbs_estimate: int


StageEvaluate = Callable[[int, Sequence[int]], Sequence[Point]]
"""Runs a batch of mbs values for a ZeRO stage and returns their points."""


def explore_stages(evaluate: StageEvaluate, plans: Sequence[StagePlan], *, lo: int, hi: int,
                   objective: Objective, threshold: float = 0.01, num_fine: int = 3) -> list[StageResult]:
    """Progressive ZeRO-stage exploration, lowest stage first (see the module docstring).

    Args:
        evaluate: ``evaluate(stage, [mbs, ...]) -> [Point, ...]``.
        plans: one per candidate stage, ascending, with the memory model's largest fitting mbs.
        lo, hi, objective, threshold, num_fine: as in :func:`search_mbs`.

    Returns:
        One :class:`StageResult` per plan, in order.
    """
    results: list[StageResult] = []
    best: tuple[int, Point] | None = None  # (stage, point)
    slower_seen = False
    for plan in plans:
        stage = plan.stage
        result = StageResult(stage, "", "", estimate=plan.max_mbs_estimate)
        results.append(result)
        if plan.max_mbs_estimate < lo:
            result.decision, result.reason = "pruned", f"memory model: mbs={lo} does not fit"
            continue
        if best is not None:
            bound_mbs = max(plan.max_mbs_estimate * _headroom(results), plan.max_mbs_estimate)
            bound = _optimistic_metric(results, best, min(int(bound_mbs), hi), objective)
            if bound is not None and objective.gain(bound, best[1].metric) >= threshold:
                result.reason = (f"could beat: optimistic {objective.name} {bound:.4g} at mbs={int(min(bound_mbs, hi))} "
                                 f"vs best {best[1].metric:.4g}")
            elif slower_seen:
                result.decision = "skipped"
                result.reason = ("cannot beat: a lower stage was already slower at the same mbs and the memory "
                                 "headroom gives no better optimistic metric")
                continue
            else:
                probe_mbs = min(best[1].mbs, max(plan.max_mbs_estimate, lo))
                (probe,) = evaluate(stage, [probe_mbs])
                result.trace.points.append(probe)
                if not (probe.ok and objective.better(probe.metric, best[1].metric)):
                    result.decision = "probed"
                    result.reason = (f"probe at mbs={probe_mbs}: {probe.status.value} "
                                     f"{'' if probe.metric is None else f'{probe.metric:.4g} '}"
                                     f"not better than best {best[1].metric:.4g}")
                    # within the plateau threshold it is a tie (noise), not evidence that the higher
                    # stages are slower: the next stage is still probed
                    slower_seen = slower_seen or not (probe.ok and abs(objective.gain(probe.metric, best[1].metric))
                                                      < threshold)
                    continue
                result.reason = f"probe at mbs={probe_mbs} beat the best ({probe.metric:.4g} > {best[1].metric:.4g})"
        else:
            result.reason = "first feasible stage"
        result.decision = "explored"
        result.trace = search_mbs(lambda ms, s=stage: evaluate(s, ms), lo=lo, hi=hi, estimate=plan.max_mbs_estimate,
                                  objective=objective, threshold=threshold, num_fine=num_fine,
                                  known=result.trace.points)
        top = result.trace.best(objective)
        if top is not None and (best is None or objective.better(top.metric, best[1].metric)):
            best = (stage, top)
    return results


def _headroom(results: Sequence[StageResult]) -> float:
    """How far above its estimate an explored stage actually ran (>= 1): the estimate's caution."""
    ratio = 1.0
    for r in results:
        ok = r.trace.ok_points
        if r.decision == "explored" and ok and r.estimate > 0:
            ratio = max(ratio, max(p.mbs for p in ok) / r.estimate)
    return ratio


def _optimistic_metric(results: Sequence[StageResult], best: tuple[int, Point], mbs: int,
                       objective: Objective) -> float | None:
    """Best metric a higher stage could reach at ``mbs``, by extrapolating the best stage's curve.

    Step time never shrinks as mbs grows and a higher stage is assumed no faster at equal mbs,
    so beyond the best stage's largest runnable mbs ``m`` the metric can grow at most by the
    last gain per doubling ``g`` observed there: ``T(m) * (1 + g) ** log2(mbs / m)``, with ``g``
    measured from the largest runnable mbs at most ``m / 1.5`` (else the next runnable below ``m``). For a
    metric where lower is better (latency) a larger mbs never helps: None.
    """
    if not objective.higher_is_better:
        return None
    stage_result = next(r for r in results if r.stage == best[0])
    ok = sorted(stage_result.trace.ok_points, key=lambda p: p.mbs)
    top = ok[-1]
    if mbs <= top.mbs:
        return None
    if len(ok) < 2:
        return top.metric * mbs / top.mbs  # no curve yet: linear scaling is the only safe bound
    # the gain from a point at least 1.5x below: neighbours near the memory boundary (bisection
    # points a few mbs apart) differ by noise more than by the curve
    apart = [p for p in ok if p.mbs * 3 <= top.mbs * 2]
    prev = apart[-1] if apart else ok[-2]
    doublings = math.log2(top.mbs / prev.mbs)
    g = max(0.0, (top.metric / prev.metric) ** (1 / doublings) - 1) if prev.metric > 0 else 0.0
    return top.metric * (1 + g) ** math.log2(mbs / top.mbs)
