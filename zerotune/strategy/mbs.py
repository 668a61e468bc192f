"""The micro-batch search of one ZeRO stage: which mbs values to try, in what order, and when to stop.

`search_mbs` never launches: it hands batches of mbs values to ``evaluate`` and learns from their ``Status`` and
metric; why it stopped is a `StopReason`. Throughput searches top-down from the memory estimate and looks below the
best only near the device's capacity (`_top_down`, D5, D104); latency climbs bottom-up by a doubling ladder
(`next_mbs`); then the fine pass (`zerotune.strategy.fine`) bisects around the best. The allowed mbs values are sorted:
every integer in ``lo..hi``, the divisors that keep ``mbs * gas * DP = train_batch_size``, or the user's list. A step
the throughput model skips ends the climb.
"""
from __future__ import annotations

from typing import Sequence

from zerotune.core.experiment import Status
from zerotune.core.noise import replica_decides, within_noise
from zerotune.strategy.answer import Capacity
from zerotune.strategy.fine import fine_pass
from zerotune.strategy.points import (
    Confirm,
    Evaluate,
    MbsTrace,
    Point,
    SearchBounds,
    StopReason,
    largest_within,
    middle,
    runner,
)

__all__ = ["next_mbs", "search_mbs"]


def search_mbs(evaluate: Evaluate, bounds: SearchBounds, *, estimate: int, known: Sequence[Point] = (),
               confirm: Confirm | None = None) -> MbsTrace:
    """Search the micro batch size of one stage; return the trace, in evaluation order (``known`` points first).

    Throughput: `_top_down`, `_look_below`. Latency: the smallest mbs, then a doubling ladder (`next_mbs`) that lands
    on the estimate and may go above it, a binary search between the last runnable and the first failing mbs, and a
    plateau test (not on the step onto the estimate, which only positions the ladder). Then the fine pass.

    Args:
        bounds: the allowed mbs values, the objective, the plateau threshold, the target precision (the fine pass
            skips a gap whose ends tie to it; None: never) and the fine pass's budget.
        estimate: the memory model's largest fitting mbs: a throughput search starts at the largest allowed value
            within it, a latency ladder lands on it; both may go above it.
        known: points already measured for this stage, never re-run. A throughput search starts at the largest known
            runnable mbs above the estimate; a latency one climbs from the largest known runnable mbs, skipping the
            smallest (memory grows with mbs).
        confirm: re-measures, once and interleaved, a plateau step within the two runs' noise (`within_noise`) and
            the best so far; the plateau is then tested on the pooled metrics, unless the difference is a tie.
    """
    values = bounds.values
    trace = MbsTrace(points=list(known))
    if not values:
        trace.stop = StopReason.INFEASIBLE
        return trace

    run = runner(trace, evaluate)
    if bounds.objective.higher_is_better:
        _top_down(run, trace, bounds, estimate, confirm)
        if trace.stop is not StopReason.INFEASIBLE:
            fine_pass(run, trace, bounds)
        return trace
    known_ok = [p.mbs for p in trace.ok_points]
    if known_ok:  # e.g. a probe: memory grows with mbs, so lo runs too; climb from the largest known
        prev = max(known_ok)
    else:
        (first,) = run([values[0]])
        if not first.ok:
            trace.stop = StopReason.INFEASIBLE
            return trace
        prev = values[0]
    trace.stop = _climb(run, trace, bounds, prev, estimate, confirm)
    fine_pass(run, trace, bounds)
    return trace


def _climb(run, trace: MbsTrace, bounds: SearchBounds, prev: int, estimate: int,
           confirm: Confirm | None) -> StopReason:
    """Climb from the runnable ``prev`` by `next_mbs` steps until the cap, a failure (then `_bisect`) or a plateau
    (not on the step onto ``estimate``); a plateau step is first re-measured by ``confirm`` where another run can
    decide (`zerotune.core.noise.replica_decides`)."""
    values, objective, threshold, precision = bounds.values, bounds.objective, bounds.threshold, bounds.precision
    best = trace.best(objective)
    while True:
        step = next_mbs(prev, estimate, values)
        if step is None:
            return StopReason.CAP
        nxt, landing = step
        (p,) = run([nxt])
        if p.status is Status.SKIPPED:  # its upper bound rises with mbs: nothing below it can win either
            return StopReason.PREDICTED
        if not p.ok:
            return _bisect(run, trace, bounds, prev, nxt)
        improved = objective.gain(p.metric, best.metric)
        if (improved < threshold and not landing and confirm is not None and min(p.runs, best.runs) < 2
                and replica_decides(improved, p, best, threshold, precision)):
            trace.update(confirm(sorted({nxt, best.mbs})))  # a plateau is not decided on one sample
            p, best = trace.get(nxt), trace.get(best.mbs)
            improved = objective.gain(p.metric, best.metric)
        if objective.better(p.metric, best.metric):
            best = p
        if improved < threshold and not landing:
            return StopReason.PLATEAU
        prev = nxt


def _top_down(run, trace: MbsTrace, bounds: SearchBounds, estimate: int, confirm: Confirm | None) -> None:
    """The throughput search (D5, D104): start at the estimate (or the largest known runnable mbs above it); if it
    fails, halve until one runs and bisect up to the failure; if it runs, `_climb` from it; then `_look_below`."""
    values = bounds.values
    known_ok = [p.mbs for p in trace.ok_points]
    start = largest_within(values, estimate)
    start = max(start, *known_ok) if known_ok else start
    (p,) = run([start])
    if p.status is Status.SKIPPED:
        trace.stop = StopReason.PREDICTED
        return
    fail = None
    while not p.ok:  # the estimate was optimistic: halve until a size runs, then bisect up to the failure
        fail = start
        known_below = [q.mbs for q in trace.ok_points if q.mbs < start]
        if known_below:  # one ran below already (a stage probe): bisect from it
            start = max(known_below)
            break
        below = _halving(values, start)
        if not below:
            trace.stop = StopReason.INFEASIBLE
            return
        start = below[-1]
        (p,) = run([start])
    if fail is not None:
        trace.stop = _bisect(run, trace, bounds, start, fail)
    else:
        trace.stop = _climb(run, trace, bounds, start, start, confirm)  # above the estimate
    _look_below(run, trace, bounds)


def _look_below(run, trace: MbsTrace, bounds: SearchBounds) -> None:
    """Look below the best, each step down only for a gain of the threshold beyond the noise (D104). A calm best
    stops (nothing below can win); a best near the capacity tries the largest mbs the memory model puts under it
    (``calm_mbs``) unless one ran there; a best of unknown capacity (CPU ranks, whose caches can make a smaller mbs
    faster) tries one halving where nothing below was measured."""
    values, objective, threshold = bounds.values, bounds.objective, bounds.threshold
    best = trace.best(objective)
    while True:
        below = _halving(values, best.mbs)
        if best.capacity is Capacity.UNKNOWN:
            if any(q.mbs < best.mbs for q in trace.ok_points):
                break
        elif best.capacity is Capacity.CALM or (best.calm_mbs is not None and best.mbs <= best.calm_mbs):
            break
        else:  # near capacity: the largest mbs the memory model puts under it, unless one ran there
            calm = [m for m in values if best.calm_mbs is not None and m <= best.calm_mbs and m < best.mbs]
            below = calm[-1:] or below
            if below and any(q.mbs <= below[-1] or q.capacity is Capacity.CALM
                             for q in trace.ok_points if q.mbs < best.mbs):
                break
        if not below:
            break
        (p,) = run([below[-1]])
        gain = objective.gain(p.metric, best.metric) if p.ok else None
        if gain is None or gain < threshold or within_noise(gain, p, best, threshold):
            break
        best = p


def _halving(values: Sequence[int], mbs: int) -> list[int]:
    """The allowed values at most half of ``mbs`` (the last is the halving), or else the one just below it;
    empty when none is below ``mbs``."""
    return [m for m in values if m <= mbs // 2] or [m for m in values if m < mbs][-1:]


def next_mbs(prev: int, estimate: int, values: Sequence[int]) -> tuple[int, bool] | None:
    """The ladder's step after a runnable ``prev`` and whether it lands on ``estimate``: the smallest allowed value
    at least double ``prev`` (else the largest), or the largest within ``estimate`` where doubling jumps over it;
    None at the cap."""
    above = [m for m in values if m > prev]
    if not above:
        return None
    nxt = next((m for m in above if m >= 2 * prev), above[-1])
    within = [m for m in above if m <= estimate]
    if within and within[-1] < nxt:
        return within[-1], True
    return nxt, False


def _bisect(run, trace: MbsTrace, bounds: SearchBounds, ok: int, fail: int) -> StopReason:
    """Binary search for the largest runnable mbs in (ok, fail); stops early on a plateau."""
    values, objective, threshold = bounds.values, bounds.objective, bounds.threshold
    while (mid := middle(values, ok, fail)) is not None:
        best = trace.best(objective)
        (p,) = run([mid])
        if p.status is Status.SKIPPED:
            return StopReason.PREDICTED
        if p.ok:
            ok = mid
            if objective.gain(p.metric, best.metric) < threshold:
                return StopReason.PLATEAU
        else:
            fail = mid
    return StopReason.BOUNDARY
