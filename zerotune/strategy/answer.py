"""The answer rule: which measured config is the answer, read with the shape of the throughput curve.

On GPU ranks a config's (ZeRO stage, gas, knobs) calm runs (`capacity`) count as one curve rising with mbs, worth its
non-decreasing fit at its largest mbs; a run near the capacity, or of unknown peak, stands alone on its pooled
samples/s; CPU ranks keep the best pooled reading (`answer_readings`). A tie is an answer: configs within the target
precision (``--precision``) of the best are not told apart by another run; the tie order takes one (`tie_order`,
`tie_reading`). Decisions: D101, D307, D313, D321.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence, TypeVar

from zerotune.core.experiment import Experiment, Status
from zerotune.core.measure import Pooled, pooled_metrics
from zerotune.core.noise import mean_half_width, run_noise, tie
from zerotune.core.objective import Objective

T = TypeVar("T")

NEAR_CAPACITY = 0.9
"""A run whose measured peak is at least this fraction of the per-device budget runs near the device's
capacity, where a caching allocator flushes and retries and a step can be slower than at a smaller mbs."""


class Capacity(str, enum.Enum):
    """Where a run's measured peak sits against the per-device budget."""

    CALM = "calm"  # under NEAR_CAPACITY of the budget: throughput rises with mbs there
    NEAR = "near"  # at least NEAR_CAPACITY: the allocator's flushes may slow a step
    UNKNOWN = "unknown"  # no measured peak, or no budget (CPU ranks)


def memory_fraction(peak_bytes: int | None, budget_bytes: int | None) -> float | None:
    """A run's measured peak over the per-device budget; None without a peak or a budget (0 counts as none)."""
    if not peak_bytes or not budget_bytes:
        return None
    return peak_bytes / budget_bytes


def capacity(fraction: float | None) -> Capacity:
    """The `Capacity` of a run whose peak is ``fraction`` of the budget (`memory_fraction`)."""
    if fraction is None:
        return Capacity.UNKNOWN
    return Capacity.CALM if fraction < NEAR_CAPACITY else Capacity.NEAR


def rising_top(readings: Sequence[tuple[float, int]]) -> float | None:
    """The last value of the run-weighted least-squares non-decreasing fit of ``readings``; None when empty.

    ``readings``: (metric, runs) in ascending mbs order. Pool adjacent violators (M. Ayer et al., "An empirical
    distribution function for sampling with incomplete information", Ann. Math. Statist. 26, 1955)."""
    blocks: list[tuple[float, int]] = []  # (mean, runs)
    for value, runs in readings:
        blocks.append((value, max(1, runs)))
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m2, w2), (m1, w1) = blocks.pop(), blocks.pop()
            blocks.append(((m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2))
    return blocks[-1][0] if blocks else None


def rising_candidates(items: Sequence[T], *, mbs: Callable[[T], int], value: Callable[[T], float],
                      runs: Callable[[T], int], calm: Callable[[T], bool]) -> list[tuple[float, T]]:
    """(value, item) answer candidates among one config's mbs values: the calm ones as one rising curve, worth
    `rising_top` at the largest of them; each other one at its own value."""
    rising = sorted((i for i in items if calm(i)), key=mbs)
    pairs = [(value(i), i) for i in items if not calm(i)]
    if rising:
        pairs.append((rising_top([(value(i), runs(i)) for i in rising]), rising[-1]))
    return pairs


HEADROOM_MARGIN = 0.05
"""Two tied configs' measured peaks closer than this fraction of the larger leave the headroom undecided."""
IMPRECISE = 3
"""A tied reading whose 95% half-width is over this many times the target precision counts at its lower bound."""
TIE_ORDER = ("more memory headroom where a tied config runs near the device's capacity, else the better reading, "
             f"a reading known only to more than {IMPRECISE}x the precision counting at its lower bound (less its 95% "
             "half-width)")
"""The tie order (`tie_order`) in words, as the summary and the report state it."""


@dataclass(frozen=True)
class Tie:
    """Configs within the target precision of the best reading (`zerotune.core.noise.tie`), and the one taken.

    Attributes:
        answer, value: the config taken and its metric (pooled, or its curve's level).
        others: the tied configs not taken, each with its metric, best first.
        reason: ``"more memory headroom"``, ``"the better reading"`` or ``"the better lower bound"`` (`tie_reading`).
        half_widths: config name -> the relative 95% half-width of its reading (`half_widths`), every tied config.
    """

    answer: Experiment
    value: float
    others: tuple[tuple[Experiment, float], ...]
    reason: str
    half_widths: dict[str, float] = field(default_factory=dict, compare=False)


def tie_order(a: Experiment, b: Experiment, budget_bytes: int | None = None) -> tuple[Experiment, str]:
    """Of two tied configs, ``a`` first by `tie_reading`, the one the answer takes, and why (D313).

    More memory headroom decides where the larger peak is at least `NEAR_CAPACITY` of ``budget_bytes`` (there the
    allocator flushes and longer batches can run out of memory) and the other's is lower by more than
    `HEADROOM_MARGIN` of it; else, and without a budget (CPU ranks), ``a``, the better reading."""
    pa, pb = a.peak_memory_bytes, b.peak_memory_bytes
    if (pa and pb and capacity(memory_fraction(max(pa, pb), budget_bytes)) is Capacity.NEAR
            and abs(pa - pb) > HEADROOM_MARGIN * max(pa, pb)):
        return (a if pa < pb else b), "more memory headroom"
    return a, "the better reading"


def best_experiment(experiments: Iterable[Experiment], objective: Objective,
                    budget_bytes: int | None = None, precision: float | None = None) -> Experiment | None:
    """The answer (`decide`); None when none succeeded."""
    return decide(experiments, objective, budget_bytes, precision)[0]


def decide(experiments: Iterable[Experiment], objective: Objective, budget_bytes: int | None = None,
           precision: float | None = None) -> tuple[Experiment | None, Tie | None]:
    """The answer, and the tie it was taken from (None: no other config within ``precision`` of it).

    The best reading is the best pooled metric (over re-measurements), on GPU ranks read with the curve's shape
    (`answer_readings`). Readings within ``precision`` of it tie (`zerotune.core.noise.tie`); `tie_order` takes one
    without a launch, ranked by `tie_reading` with the half-widths of `half_widths`. Failed, OOM and timed-out runs
    carry no metric and are never candidates.

    Args:
        budget_bytes: the per-device memory budget, bytes, that tells how near the capacity a run ran; None (CPU
            ranks, or unknown): the best pooled metric alone.
        precision: the target precision, relative (``--precision``); None: no tie.
    """
    experiments = list(experiments)
    readings = answer_readings(experiments, pooled_metrics(experiments), objective, budget_bytes)
    top = objective.best(readings, lambda r: r[0])
    if top is None:
        return None, None
    tied = [r for r in readings if r[1] is not top[1] and tie(objective.gain(r[0], top[0]), precision)]
    if not tied:
        return top[1], None
    widths = half_widths(experiments, [e for _, e in [top] + tied])
    sign = 1 if objective.higher_is_better else -1
    order = sorted([top] + tied, key=lambda r: tie_reading(r[0], widths[r[1].name], precision, sign), reverse=sign > 0)
    (value, taken), reasons = order[0], []
    for v, e in order[1:]:
        winner, why = tie_order(taken, e, budget_bytes)
        taken, value = (e, v) if winner is e else (taken, value)
        reasons.append(why)
    reason = next((r for r in reversed(reasons) if r != "the better reading"), "the better reading")
    if reason == "the better reading" and taken is not top[1]:
        reason = "the better lower bound"  # the best reading was known only to more than IMPRECISE x the precision
    others = tuple((e, v) for v, e in sorted([top] + tied, key=lambda r: r[0], reverse=sign > 0) if e is not taken)
    return taken, Tie(taken, value, others, reason, widths)


def tie_reading(value: float, half_width: float, precision: float | None, sign: int = 1) -> float:
    """A tied reading's worth in the tie order: itself where its half-width is within `IMPRECISE` times the
    precision, else its lower bound ``value * (1 - sign * half_width)`` (``sign`` -1: lower is better)."""
    return value * (1 - sign * half_width) if half_width > IMPRECISE * (precision or 0.0) else value


def half_widths(experiments: Sequence[Experiment], configs: Sequence[Experiment]) -> dict[str, float]:
    """Config name -> the relative 95% half-width of its reading over its ok runs and re-measurements
    (`zerotune.core.noise.mean_half_width`, with the run-to-run noise of ``experiments``)."""
    sigma = run_noise(experiments).sigma
    runs: dict[str, list[float | None]] = {c.name: [] for c in configs}
    for e in experiments:
        name = e.replica_of or e.name
        if name in runs and e.status is Status.OK and e.metric is not None:
            runs[name].append(e.metric_rel_half_width)
    return {name: mean_half_width(hws or [None], sigma) for name, hws in runs.items()}


def answer_readings(experiments: Sequence[Experiment], pooled: dict[str, Pooled], objective: Objective,
                    budget_bytes: int | None) -> list[tuple[float, Experiment]]:
    """(reading, experiment) per answer candidate (a first run with an ok pooled metric). For throughput on GPU
    ranks (``budget_bytes`` known) each config's calm runs form one curve rising with mbs (`rising_candidates`): a
    step's time is about affine in mbs away from the capacity, so the curve reads the level better than the higher
    reading alone (the winner's curse). Every other run counts as its own pooled metric."""
    bases = [e for e in experiments if e.replica_of is None and e.name in pooled]
    if budget_bytes is None or not objective.higher_is_better:
        return [(pooled[e.name].value, e) for e in bases]
    configs: dict[tuple, list[Experiment]] = {}
    for e in bases:
        configs.setdefault((e.stage, e.gas, repr(sorted(e.knobs.items()))), []).append(e)
    return [pair for runs in configs.values() for pair in rising_candidates(
        runs, mbs=lambda e: e.mbs, value=lambda e: pooled[e.name].value, runs=lambda e: pooled[e.name].runs,
        calm=lambda e: capacity(memory_fraction(e.peak_memory_bytes, budget_bytes)) is Capacity.CALM)]
