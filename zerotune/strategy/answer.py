"""The answer rule: which measured config is the answer, read with the shape of the throughput curve.

On GPU ranks the runs of one config (ZeRO stage, gas, knobs) that ran calm (:mod:`~zerotune.strategy.capacity`)
count as one curve rising with mbs: away from the capacity a step's time is about affine in mbs (fixed per-step
work plus compute per sample: the roofline view), so a larger mbs that reads under a smaller one reads the noise,
and the two readings together tell the curve's level better than the higher one alone (the best of several noisy
runs reads high: the winner's curse). The curve is worth its run-weighted non-decreasing fit (:func:`rising_top`)
at its largest mbs. A run near the capacity, or of unknown peak, stands alone on its own pooled metric: a
caching allocator's flushes can slow a step there. CPU ranks keep the best pooled reading. The evidence is in
docs/decisions.md, D101.
"""
from __future__ import annotations

from typing import Callable, Iterable, Sequence, TypeVar

from zerotune.core.experiment import Experiment
from zerotune.core.measure import Pooled, pooled_metrics
from zerotune.core.objective import Objective
from zerotune.strategy.capacity import Capacity, capacity, memory_fraction

T = TypeVar("T")


def rising_top(readings: Sequence[tuple[float, int]]) -> float | None:
    """The value at the last of ``readings`` of their run-weighted least-squares non-decreasing fit.

    ``readings`` are (metric, runs) in ascending mbs order: one config's pooled metric at each mbs and how many
    runs it pools. Pool adjacent violators (M. Ayer et al., "An empirical distribution function for sampling
    with incomplete information", Ann. Math. Statist. 26, 1955): a block that reads above the next one is merged
    with it into their run-weighted mean, until the means rise. None when empty.
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
    ones as one curve rising with mbs, worth :func:`rising_top` of their values at the largest of them; each
    other one (near the capacity, or of unknown peak) at its own value."""
    rising = sorted((i for i in items if calm(i)), key=mbs)
    pairs = [(value(i), i) for i in items if not calm(i)]
    if rising:
        pairs.append((rising_top([(value(i), runs(i)) for i in rising]), rising[-1]))
    return pairs


def best_experiment(experiments: Iterable[Experiment], objective: Objective,
                    budget_bytes: int | None = None) -> Experiment | None:
    """The answer: the experiment whose pooled metric (over its re-measurements) is best; on GPU ranks read
    with the shape of the throughput curve (:func:`rising_answer`). None when none succeeded. Failed, OOM and
    timed-out runs are never candidates (they carry no metric).

    Args:
        budget_bytes: the per-device memory budget, bytes, against which a run's measured peak tells how near
            the device's capacity it ran; None (CPU ranks, or unknown): the best pooled metric alone.
    """
    experiments = list(experiments)
    pooled = pooled_metrics(experiments)
    best = objective.best((e for e in experiments if e.replica_of is None and e.name in pooled),
                          lambda e: pooled[e.name].value)
    if best is None or budget_bytes is None or not objective.higher_is_better:
        return best
    return rising_answer(experiments, pooled, budget_bytes, objective) or best


def rising_answer(experiments: Sequence[Experiment], pooled: dict[str, Pooled], budget_bytes: int,
                  objective: Objective) -> Experiment | None:
    """The best throughput where each config's (stage, gas, knobs) calm runs count as one curve rising with
    mbs (:func:`rising_candidates`) and every other run as its own pooled metric (the module docstring).
    The answer is reported with its own runs' metric. None without candidates."""
    configs: dict[tuple, list[Experiment]] = {}
    for e in experiments:
        if e.replica_of is None and e.name in pooled:
            configs.setdefault((e.stage, e.gas, repr(sorted(e.knobs.items()))), []).append(e)
    pairs = [pair for runs in configs.values() for pair in rising_candidates(
        runs, mbs=lambda e: e.mbs, value=lambda e: pooled[e.name].value, runs=lambda e: pooled[e.name].runs,
        calm=lambda e: capacity(memory_fraction(e.peak_memory_bytes, budget_bytes)) is Capacity.CALM)]
    top = objective.best(pairs, lambda c: c[0])
    return None if top is None else top[1]
