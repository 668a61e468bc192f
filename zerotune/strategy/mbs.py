"""The micro-batch search of one ZeRO stage: which mbs values to try, in what order, and when to stop.

:func:`search_mbs` never launches anything: it hands batches of mbs values to an ``evaluate``
callable and learns from the outcomes (``Status`` and metric). Why it stopped is a
:class:`StopReason`. Two directions, after the metric's:

- **Throughput** (a larger mbs tends to win, until memory runs out): top-down. The first run is
  at the memory model's largest fitting mbs (the estimate), where the answer usually is, not at
  the smallest mbs, whose runs teach little. If it fails, the search halves until a size runs and
  bisects up to the failure. If it runs, the search climbs above it by doubling while it runs and
  gains (a failure: binary search for the boundary; a gain under ``threshold``: plateau). It looks
  below the best only where the best ran near the device's capacity (its measured peak at least
  :data:`NEAR_CAPACITY` of the budget), where a caching allocator's flushes can slow a step: at the
  largest mbs the memory model puts under that fraction (``Point.calm_mbs``), and further down only
  while that pays by ``threshold``. Away from the capacity throughput rises with mbs (fixed per-step
  work amortized over more samples), so nothing below can win; where no peak is given (unknown, or
  CPU ranks, whose caches can make a smaller micro-batch faster anywhere), one halving below is
  checked instead.
- **Latency** (a smaller mbs tends to win): bottom-up. The smallest mbs, then a doubling ladder
  that lands on the estimate and may go above it; a binary search between the last runnable and
  the first failing mbs; plateau detection (stop when the metric improves by less than
  ``threshold``; the short step onto the memory estimate is not tested, it only positions the
  ladder).

Then a fine pass bisects around the best mbs (``num_fine``; :func:`refine_mbs` runs it alone, as the
stage exploration does once the stages are compared). For throughput it bisects a gap only where it may
pay: a step time affine in mbs (fixed per-step work plus compute per sample) puts no peak between two
measured points, so the gap above is skipped where that line predicts no gain the runs can resolve, and
the gap below unless the best ran near capacity. Its "best" is the one the answer rule picks
(:meth:`MbsTrace.answer`): away from the capacity the readings count as one curve rising with mbs
(:func:`rising_top`), whose value is at its largest mbs; the points between hold nothing that beats it.
The search moves over a sorted set of allowed mbs values: every integer in ``lo..hi``, or fewer when the
global batch is fixed (the divisors that keep ``mbs * gas * DP = train_batch_size``) or the user lists
them; "doubling", "halving" and "bisecting" pick from that set.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Callable, Sequence, TypeVar

from zerotune.core.experiment import Status
from zerotune.core.measure import RUN_NOISE, comparison_noise
from zerotune.core.objective import Objective


T = TypeVar("T")

NEAR_CAPACITY = 0.9
"""A run whose measured peak is at least this fraction of the per-device budget runs near the device's
capacity, where a caching allocator flushes and retries and a step can be slower than at a smaller mbs."""


def rising_top(readings: Sequence[tuple[float, int]]) -> float | None:
    """The value at the last of ``readings`` of their run-weighted least-squares non-decreasing fit.

    ``readings`` are (metric, runs) in ascending mbs order: one config's pooled metric at each mbs and how many
    runs it pools. Pool adjacent violators (M. Ayer et al., "An empirical distribution function for sampling
    with incomplete information", Ann. Math. Statist. 26, 1955): a block that reads above the next one is merged
    with it into their run-weighted mean, until the means rise. Where throughput rises with mbs (away from the
    device's capacity: a step time affine in mbs, the assumption that already keeps the search from looking
    below a calm best, :func:`_below_may_pay`), a larger mbs that reads under a smaller one reads the noise, and
    both runs count towards the larger one's value; where the readings rise, each keeps its own. None when empty.
    """
    blocks: list[tuple[float, int]] = []  # (mean, runs)
    for value, runs in readings:
        blocks.append((value, max(1, runs)))
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m2, w2), (m1, w1) = blocks.pop(), blocks.pop()
            blocks.append(((m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2))
    return blocks[-1][0] if blocks else None


def rising_candidates(items: Sequence[T], *, mbs: Callable[[T], int], value: Callable[[T], float],
                      runs: Callable[[T], int], calm: Callable[[T], bool]) -> list[tuple[float, T]]:
    """(value, item) pairs an answer is chosen from among one config's measured mbs values (``items``): the calm
    ones (away from the device's capacity) as one curve rising with mbs, worth :func:`rising_top` of their values
    at the largest of them; each other one (near the capacity, or of unknown peak) at its own value."""
    rising = sorted((i for i in items if calm(i)), key=mbs)
    pairs = [(value(i), i) for i in items if not calm(i)]
    if rising:
        pairs.append((rising_top([(value(i), runs(i)) for i in rising]), rising[-1]))
    return pairs


class StopReason(str, enum.Enum):
    """Why :func:`search_mbs` stopped climbing."""

    INFEASIBLE = "infeasible"  # the smallest mbs did not run
    PLATEAU = "plateau"  # a step improved the best metric by less than the threshold
    BOUNDARY = "boundary"  # the largest runnable mbs lies between a runnable and a failing one
    CAP = "cap"  # reached the largest mbs allowed

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

    @property
    def ok(self) -> bool:
        return self.status == Status.OK


def within_noise(gain: float, a: Point, b: Point, threshold: float) -> bool:
    """Whether a relative difference ``gain`` between two measured points could be noise: smaller in
    size than their :func:`~zerotune.core.measure.comparison_noise` (each point's interval, an unknown
    or pooled one counting as ``threshold``, plus the run-to-run noise, less for pooled points; the
    larger of the two points' ``run_noise``)."""
    return abs(gain) < comparison_noise([a.rel_half_width, b.rel_half_width], [a.runs, b.runs], floor=threshold,
                                        run_noise=max(a.run_noise, b.run_noise))


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

    def answer(self, objective: Objective) -> Point | None:
        """The point the answer rule picks among this stage's (:func:`zerotune.report.results.best_experiment`):
        for throughput, the points that ran away from the device's capacity (measured peaks under
        :data:`NEAR_CAPACITY` of the budget) count as one curve rising with mbs, worth :func:`rising_top` at the
        largest of them; a point near the capacity (or of unknown peak) counts as its own reading; the best of
        these. For latency, or without calm points, the best reading (:meth:`best`)."""
        best = self.best(objective)
        if best is None or not objective.higher_is_better:
            return best
        pairs = rising_candidates(self.ok_points, mbs=lambda p: p.mbs, value=lambda p: p.metric, runs=lambda p: p.runs,
                                  calm=lambda p: p.memory_fraction is not None and p.memory_fraction < NEAR_CAPACITY)
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


def search_mbs(evaluate: Evaluate, *, lo: int, hi: int, estimate: int, objective: Objective,
               threshold: float = 0.01, num_fine: int = 3, known: Sequence[Point] = (),
               allowed: Sequence[int] | None = None, confirm: Confirm | None = None,
               precision: float | None = None) -> MbsTrace:
    """Search the micro batch size of one stage (the module docstring gives the order).

    Args:
        evaluate: runs a batch of mbs values and returns one :class:`Point` each.
        lo, hi: smallest and largest mbs allowed (``min/max_train_micro_batch_size_per_gpu``,
            and the train batch bounds).
        estimate: the memory model's largest fitting mbs: where a throughput search starts (the
            largest allowed value within it), and where a latency ladder lands exactly; both may
            go above it when it runs.
        objective: the metric's direction (which way the search goes).
        threshold: plateau threshold: a step that improves the best metric by less than this
            fraction ends the upward search (except a latency ladder's step onto the estimate);
            a throughput search goes below its best only while a step down gains this much.
        num_fine: experiments allowed in the fine pass around the best mbs.
        known: points already measured for this stage (reused, not re-run). A throughput search
            starts at the largest known runnable mbs when it is above the estimate. For latency,
            when one of them ran, the smallest mbs is not run (memory grows with mbs) and the
            ladder starts at the largest known runnable mbs. A known failure is never re-run.
        allowed: the mbs values the search may try (None: every integer in ``lo..hi``); only
            those within ``lo..hi`` are used.
        confirm: when given, a step that would end the climb as a plateau by a difference within
            the two runs' noise (:func:`within_noise`) is not decided on one run: the step and the
            best so far are re-measured once (interleaved) and the plateau test is made on the
            pooled metrics.
        precision: the runs' target precision (relative half-width, e.g. 0.02): the fine pass skips
            the gap below the best when both ends are known to it and tie (:func:`_plateau`);
            None: it never skips.

    Returns:
        The trace, in evaluation order (``known`` points first).
    """
    values = allowed_values(lo, hi, allowed)
    trace = MbsTrace(points=list(known))
    if not values:
        trace.stop = StopReason.INFEASIBLE
        return trace

    run = _runner(trace, evaluate)
    if objective.higher_is_better:
        _top_down(run, trace, values, estimate, objective, threshold, confirm)
        if trace.stop is not StopReason.INFEASIBLE:
            _fine_pass(run, trace, values, objective, num_fine, threshold, precision)
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
    trace.stop = _climb(run, trace, values, prev, estimate, objective, threshold, confirm)
    _fine_pass(run, trace, values, objective, num_fine, threshold, precision)
    return trace


def _runner(trace: MbsTrace, evaluate: Evaluate) -> Callable[[Sequence[int]], list[Point]]:
    """``run(batch)``: the points of ``trace`` at these mbs values, evaluating (and recording) those not
    measured yet."""
    def run(batch: Sequence[int]) -> list[Point]:
        todo = [m for m in batch if trace.get(m) is None]
        if todo:
            trace.points.extend(evaluate(todo))
        return [trace.get(m) for m in batch]
    return run


def refine_mbs(evaluate: Evaluate, trace: MbsTrace, *, lo: int, hi: int, objective: Objective, num_fine: int,
               threshold: float = 0.01, allowed: Sequence[int] | None = None, precision: float | None = None) -> None:
    """The fine pass alone, on a trace :func:`search_mbs` left with ``num_fine=0``: bisect the gaps next to
    its best mbs, up to ``num_fine`` experiments (recorded in ``trace``). Arguments as in :func:`search_mbs`."""
    if trace.best(objective) is not None:
        _fine_pass(_runner(trace, evaluate), trace, allowed_values(lo, hi, allowed), objective, num_fine, threshold,
                   precision)


def _climb(run, trace: MbsTrace, values: Sequence[int], prev: int, estimate: int, objective: Objective,
           threshold: float, confirm: Confirm | None) -> StopReason:
    """Climb from the runnable ``prev`` by :func:`next_mbs` steps until the cap, a failure (then
    :func:`_bisect` to the boundary) or a plateau (a step gaining less than ``threshold``; not the
    step onto ``estimate``; one within the runs' noise is re-measured first when ``confirm`` is given)."""
    best = trace.best(objective)
    while True:
        step = next_mbs(prev, estimate, values)
        if step is None:
            return StopReason.CAP
        nxt, landing = step
        (p,) = run([nxt])
        if not p.ok:
            return _bisect(run, trace, values, prev, nxt, objective, threshold)
        improved = objective.gain(p.metric, best.metric)
        if (improved < threshold and not landing and confirm is not None and min(p.runs, best.runs) < 2
                and within_noise(improved, p, best, threshold)):
            trace.update(confirm(sorted({nxt, best.mbs})))  # a plateau is not decided on one sample
            p, best = trace.get(nxt), trace.get(best.mbs)
            improved = objective.gain(p.metric, best.metric)
        if objective.better(p.metric, best.metric):
            best = p
        if improved < threshold and not landing:
            return StopReason.PLATEAU
        prev = nxt


def _top_down(run, trace: MbsTrace, values: Sequence[int], estimate: int, objective: Objective, threshold: float,
              confirm: Confirm | None) -> None:
    """The search where a larger mbs tends to win (throughput): start at the memory model's estimate
    (or the largest known runnable mbs above it), climb above it by doubling while it runs and gains
    (a failure: bisect to the boundary), then look below (the module docstring says where): the search
    goes down only while a smaller mbs is better by ``threshold`` and by more than the noise
    (:func:`within_noise`). On the SIMULATED clusters (6 noise draws, benchmarks/README.md, session 13)
    looking below only near the capacity, at the calm mbs, cut the GPU-hours from 0.80x to 0.70x
    DeepSpeed's at 1% noise and from 0.94x to 0.86x at 5%, with more answers within 1% of the optimum
    (187 -> 198 and 120 -> 144 of 216) and the same worst case."""
    known_ok = [p.mbs for p in trace.ok_points]
    start = largest_within(values, estimate)
    start = max(start, *known_ok) if known_ok else start
    (p,) = run([start])
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
        trace.stop = _bisect(run, trace, values, start, fail, objective, threshold)
    else:
        trace.stop = _climb(run, trace, values, start, start, objective, threshold, confirm)  # above the estimate
    best = trace.best(objective)
    while True:  # below: only from near the device's capacity, and only while it clearly pays
        below = _halving(values, best.mbs)
        if best.memory_fraction is None:  # unknown: one halving below, where nothing below was measured
            if any(q.mbs < best.mbs for q in trace.ok_points):
                break
        elif best.memory_fraction < NEAR_CAPACITY or (best.calm_mbs is not None and best.mbs <= best.calm_mbs):
            break  # throughput rises with mbs away from the device's capacity: nothing below can win
        else:  # near capacity: the largest mbs the memory model puts under it, unless one ran there
            calm = [m for m in values if best.calm_mbs is not None and m <= best.calm_mbs and m < best.mbs]
            below = calm[-1:] or below
            if below and any(q.mbs <= below[-1] or (q.memory_fraction or 1.0) < NEAR_CAPACITY
                             for q in trace.ok_points if q.mbs < best.mbs):
                break
        if not below:
            break
        (p,) = run([below[-1]])
        gain = objective.gain(p.metric, best.metric) if p.ok else None
        if gain is None or gain < threshold or within_noise(gain, p, best, threshold):
            break  # a larger mbs is the prior for throughput: going down takes more than noise
        best = p


def _halving(values: Sequence[int], mbs: int) -> list[int]:
    """The allowed values at most half of ``mbs`` (the last is the halving), or else the one just below it;
    empty when none is below ``mbs``."""
    return [m for m in values if m <= mbs // 2] or [m for m in values if m < mbs][-1:]


def largest_within(values: Sequence[int], bound: int) -> int:
    """The largest of the sorted, non-empty ``values`` at most ``bound`` (the smallest value when none is)."""
    return max([m for m in values if m <= bound], default=values[0])


def allowed_values(lo: int, hi: int, allowed: Sequence[int] | None = None) -> list[int]:
    """The sorted mbs values a search may try: ``allowed`` (or every integer) within ``lo..hi``."""
    if allowed is None:
        return list(range(lo, hi + 1))
    return sorted({m for m in allowed if lo <= m <= hi})


def next_mbs(prev: int, estimate: int, values: Sequence[int]) -> tuple[int, bool] | None:
    """The ladder's next mbs after a runnable ``prev``, and whether it is the step onto the memory
    estimate: the smallest allowed value at least double ``prev`` (the largest allowed when none
    is), but the largest allowed value within the estimate when doubling would jump over it.
    None when ``prev`` is the largest allowed value (the cap)."""
    above = [m for m in values if m > prev]
    if not above:
        return None
    nxt = next((m for m in above if m >= 2 * prev), above[-1])
    within = [m for m in above if m <= estimate]
    if within and within[-1] < nxt:
        return within[-1], True
    return nxt, False


def _middle(values: Sequence[int], low: int, high: int) -> int | None:
    """The allowed value halfway strictly between ``low`` and ``high`` (``(low + high) // 2`` when
    every integer is allowed); None when there is none."""
    inside = [m for m in values if low < m < high]
    return inside[(len(inside) - 1) // 2] if inside else None


def _bisect(run, trace: MbsTrace, values: Sequence[int], ok: int, fail: int, objective: Objective,
            threshold: float) -> StopReason:
    """Binary search for the largest runnable mbs in (ok, fail); stops early on a plateau."""
    while (mid := _middle(values, ok, fail)) is not None:
        best = trace.best(objective)
        (p,) = run([mid])
        if p.ok:
            ok = mid
            if objective.gain(p.metric, best.metric) < threshold:
                return StopReason.PLATEAU
        else:
            fail = mid
    return StopReason.BOUNDARY


def _plateau(a: Point, best: Point, threshold: float, precision: float | None) -> bool:
    """True when the measured point ``a`` and ``best`` are both known to ``precision`` (their runs'
    interval half-widths; None: never) and tie within their noise (:func:`within_noise`): the curve is
    flat between them, so the gap between them holds no mbs better by more than one run can tell.
    A tie of imprecise points is ignorance, not a plateau."""
    if precision is None or not a.ok:
        return False
    precise = all(p.rel_half_width is not None and p.rel_half_width <= precision for p in (a, best))
    return precise and within_noise(abs(a.metric - best.metric) / best.metric, a, best, threshold)


def affine_gain(low: Point, best: Point, mbs: int) -> float | None:
    """The relative throughput gain over ``best`` that an affine step time predicts at ``mbs``: the step
    time per micro-batch (``mbs / throughput``, up to the constant DP x gas) taken as ``a + b * mbs`` through
    the measured ``low`` (a smaller mbs) and ``best`` (fixed per-step work plus compute per sample: the
    roofline view of a step away from memory pressure). None when they do not give one (``a + b * mbs``
    not positive at ``mbs``, or no metric)."""
    if not (low.ok and best.ok and low.metric and best.metric and low.mbs < best.mbs):
        return None
    s_low, s_best = low.mbs / low.metric, best.mbs / best.metric
    slope = (s_best - s_low) / (best.mbs - low.mbs)
    step = s_best + slope * (mbs - best.mbs)
    if step <= 0:
        return None
    return (mbs / step) / best.metric - 1


def _above_may_pay(trace: MbsTrace, best: Point, mid: int, threshold: float) -> bool:
    """Whether the gap above the best (throughput) may hold a better mbs at its middle ``mid``.

    Not when the affine step time through the best and the nearest runnable point below it that ran away
    from the device's capacity (:func:`affine_gain`) predicts there a gain under ``threshold``, or one within
    the noise of the two points it comes from (:func:`within_noise`). Extended above the best, that line is
    what the step's fixed work still has to amortize; the allocator's flushes near capacity only slow a step,
    so the gap gains more only where a step's efficiency still grows with mbs, and then by what two runs can
    hardly tell. With no such point below, or no prediction, it may. On the SIMULATED clusters (6 noise draws)
    this cut the GPU-hours from 0.64x to 0.58x DeepSpeed's at 1% noise and from 0.79x to 0.72x at 5%, for the
    same worst case (benchmarks/README.md, session 14); on this machine's CPU curve, flat from mbs 8 to 28, it
    skips the two fine-pass runs (mbs 24 and 20) that bought nothing in session 13."""
    lows = [p for p in trace.ok_points if p.mbs < best.mbs and (p.memory_fraction or 0.0) < NEAR_CAPACITY]
    if not lows:
        return True
    low = max(lows, key=lambda p: p.mbs)
    gain = affine_gain(low, best, mid)
    return gain is None or (gain >= threshold and not within_noise(gain, low, best, threshold))


def _below_may_pay(best: Point) -> bool:
    """Whether the gap below the best may hold a better mbs: only where the best ran near the device's
    capacity (a step there can be slowed by the allocator's flushes) or its peak is unknown; away from it
    throughput rises with mbs (affine step time), so nothing between a smaller runnable mbs and the best wins."""
    return best.memory_fraction is None or best.memory_fraction >= NEAR_CAPACITY


def _fine_pass(run, trace: MbsTrace, values: Sequence[int], objective: Objective, budget: int,
               threshold: float = 0.01, precision: float | None = None) -> None:
    """Bisect the gaps next to the best mbs (:meth:`MbsTrace.answer`: the best reading, or the largest calm mbs
    where the calm readings, fitted as a rising curve, beat it): above, and below unless the best and the point
    below it are a precise plateau (:func:`_plateau`); up to ``budget`` experiments. On the SIMULATED clusters
    (12 noise draws, benchmarks/README.md, session 17) bisecting next to that answer instead of the best reading
    cut the GPU-hours from 0.477x to 0.450x DeepSpeed's at 1% noise and from 0.583x to 0.528x at 5%, for the same
    answers (336 within 1% of the optimum of 432 at 5%, against 335). A best at the memory
    boundary (the next allowed mbs failed) is no end of a plateau: a step there can be slowed by the
    allocator's flushes near the device's capacity, so a tie with the point below hides a peak between.
    For throughput a gap is bisected only where it may pay: above, unless the affine step time predicts no
    gain the runs can tell (:func:`_above_may_pay`); below, only from a best near the capacity or of unknown
    peak (:func:`_below_may_pay`)."""
    while budget > 0:
        best = trace.answer(objective)  # the gaps next to what the answer rule would pick
        below = [p.mbs for p in trace.ok_points if p.mbs < best.mbs]
        above = [p.mbs for p in trace.points if p.mbs > best.mbs]
        candidates = []
        up = _middle(values, best.mbs, min(above)) if above else None
        gated = objective.higher_is_better  # throughput: a gap is bisected only where it may pay
        if up is not None and (not gated or _above_may_pay(trace, best, up, threshold)):
            candidates.append(up)
        at_boundary = bool(above) and not trace.get(min(above)).ok and up is None
        if (below and (at_boundary or not _plateau(trace.get(max(below)), best, threshold, precision))
                and (not gated or _below_may_pay(best))):
            candidates.append(_middle(values, max(below), best.mbs))
        candidates = [m for m in candidates if m is not None and trace.get(m) is None][:budget]
        if not candidates:
            return
        budget -= len(candidates)
        run(candidates)
