"""The fine pass of the mbs search: a few bisections next to a stage's best mbs, only where they may pay.

It bisects the gaps next to the mbs the answer rule picks (`zerotune.strategy.points.MbsTrace.answer`), up to
``bounds.num_fine`` runs (`fine_pass`). For throughput the gap above is bisected unless the affine step time through
the best predicts no gain the runs can resolve (`_above_may_pay`); the gap below only where the best ran near or of
unknown capacity (`_below_may_pay`) and is no precise plateau (`_plateau`); neither where its far point could at most
tie the best (`_at_most_a_tie`). The plateau and tie skips do not hold at the memory boundary (an OOM point above, or
one near the capacity): a tie there may hide a peak. Decisions: D105, D311, D322.
"""
from __future__ import annotations

from zerotune.core.experiment import Status
from zerotune.core.noise import comparison_noise, pair_noise, precise, resolvable, typical_half_width, within_noise
from zerotune.strategy.answer import Capacity
from zerotune.strategy.points import Evaluate, MbsTrace, Point, SearchBounds, middle, runner


def refine_mbs(evaluate: Evaluate, trace: MbsTrace, bounds: SearchBounds) -> None:
    """`fine_pass` alone, on a trace `zerotune.strategy.mbs.search_mbs` left without one (`SearchBounds.coarse`);
    its runs are recorded in ``trace``."""
    if trace.best(bounds.objective) is not None:
        fine_pass(runner(trace, evaluate), trace, bounds)


def fine_gaps(trace: MbsTrace, bounds: SearchBounds) -> list[int]:
    """The mbs values (of ``bounds.values``) in the gaps `fine_pass` bisects on ``trace``: strictly between
    the nearest mbs run ok below the point the answer rule picks and the nearest run ok or out of memory above it,
    that point left out; [] when the trace has no best. What a stop before the fine pass leaves undecided."""
    if trace.best(bounds.objective) is None:
        return []
    best = trace.answer(bounds.objective)
    low = max([p.mbs for p in trace.ok_points if p.mbs < best.mbs], default=best.mbs)
    high = min([p.mbs for p in trace.points if p.mbs > best.mbs and p.status in (Status.OK, Status.OOM)],
               default=best.mbs)
    return [m for m in bounds.values if low < m < high and m != best.mbs]


def fine_pass(run, trace: MbsTrace, bounds: SearchBounds) -> None:
    """Bisect the gaps next to the best mbs (the module docstring), up to ``bounds.num_fine`` experiments."""
    values, objective, threshold, precision = bounds.values, bounds.objective, bounds.threshold, bounds.precision
    budget = bounds.num_fine
    while budget > 0:
        best = trace.answer(objective)  # the gaps next to what the answer rule would pick
        below = [p.mbs for p in trace.ok_points if p.mbs < best.mbs]
        above = [p.mbs for p in trace.points if p.mbs > best.mbs]
        candidates = []
        up = middle(values, best.mbs, min(above)) if above else None
        gated = objective.higher_is_better  # throughput: a gap is bisected only where it may pay
        high = trace.get(min(above)) if above else None
        if up is not None and (not gated or _above_may_pay(trace, best, up, threshold) and not (
                high.ok and high.capacity is not Capacity.NEAR and _at_most_a_tie(high, best, trace, threshold,
                                                                                  precision))):
            candidates.append(up)
        at_boundary = bool(above) and not trace.get(min(above)).ok and up is None
        low = trace.get(max(below)) if below else None
        if (low is not None and (at_boundary or not (_plateau(low, best, threshold, precision)
                                                      or gated and _at_most_a_tie(low, best, trace, threshold, precision)))
                and (not gated or _below_may_pay(best))):
            candidates.append(middle(values, max(below), best.mbs))
        candidates = [m for m in candidates if m is not None and trace.get(m) is None][:budget]
        if not candidates:
            return
        budget -= len(candidates)
        run(candidates)


def _plateau(a: Point, best: Point, threshold: float, precision: float | None) -> bool:
    """Whether ``a`` and ``best`` are both known to ``precision`` (`zerotune.core.noise.precise`; None: never) and tie
    within their noise: the curve is flat between them, so the gap holds no mbs better by more than one run can tell.
    A tie of imprecise points is ignorance, not a plateau."""
    if precision is None or not a.ok:
        return False
    both_precise = all(precise(p.rel_half_width, precision) for p in (a, best))
    return both_precise and within_noise(abs(a.metric - best.metric) / best.metric, a, best, threshold)


def _at_most_a_tie(low: Point, best: Point, trace: MbsTrace, threshold: float, precision: float | None) -> bool:
    """Whether ``low``, the measured neighbour of the best (throughput), could beat it by no more than ``precision``
    (None: never) or than one run between them could resolve, even at the far end of their noise (D322): its gain
    plus their `zerotune.core.noise.pair_noise` is not `zerotune.core.noise.resolvable` against one more run of the
    trace's typical half-width. A bisection there would find at best a tie, or move the answer only by chance. Above
    the best it is asked only of a neighbour that ran ok off the capacity (an OOM one is the memory boundary)."""
    if precision is None or not (low.ok and best.ok and low.metric and best.metric):
        return False
    gain_high = low.metric / best.metric - 1 + pair_noise(low, best, threshold)
    hw = typical_half_width(p.rel_half_width for p in trace.ok_points)
    noise = comparison_noise([hw, best.rel_half_width], [1, best.runs], floor=threshold, run_noise=best.run_noise)
    return not resolvable(gain_high, noise, precision)


def affine_gain(low: Point, best: Point, mbs: int) -> float | None:
    """The relative throughput gain over ``best`` an affine step time predicts at ``mbs``: the time per micro-batch
    (``mbs / throughput``, up to the constant DP x gas) as ``a + b * mbs`` through ``low`` (a smaller mbs) and
    ``best``; None without metrics or where ``a + b * mbs`` is not positive at ``mbs``."""
    if not (low.ok and best.ok and low.metric and best.metric and low.mbs < best.mbs):
        return None
    s_low, s_best = low.mbs / low.metric, best.mbs / best.metric
    slope = (s_best - s_low) / (best.mbs - low.mbs)
    step = s_best + slope * (mbs - best.mbs)
    if step <= 0:
        return None
    return (mbs / step) / best.metric - 1


def _above_may_pay(trace: MbsTrace, best: Point, mid: int, threshold: float) -> bool:
    """Whether the gap above the best (throughput) may hold a better mbs at its middle ``mid``: not where the affine
    step time (`affine_gain`) through the best and the nearest runnable point below it off the capacity predicts a
    gain under ``threshold`` or within the two points' noise (the line is what the step's fixed work still has to
    amortize). With no such point or no prediction, it may."""
    lows = [p for p in trace.ok_points if p.mbs < best.mbs and p.capacity is not Capacity.NEAR]
    if not lows:
        return True
    low = max(lows, key=lambda p: p.mbs)
    gain = affine_gain(low, best, mid)
    return gain is None or (gain >= threshold and not within_noise(gain, low, best, threshold))


def _below_may_pay(best: Point) -> bool:
    """Whether the gap below the best may hold a better mbs: not where the best ran calm (throughput rises there)."""
    return best.capacity is not Capacity.CALM
