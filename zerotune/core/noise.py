"""Noise and precision: whether two metrics differ by more than noise, whether one is known precisely enough,
and whether a candidate can still beat the best. Every decision between runs reads its rule here.

Rules: a metric's noise (relative, at 95%) is its run's interval ``hw`` plus the run-to-run noise, about ``2 * sigma``
(`RUN_NOISE`, then `run_noise`'s estimate), added in quadrature and shrinking as runs are pooled (`comparison_noise`).
A difference within the target precision (``--precision``) is a tie (`tie`) that no run is spent to break. A
candidate is raced against the incumbent's pessimistic bound (`must_beat`), ended once it `cannot_beat`, and not
launched where the throughput model bounds it under the best samples/s plus the precision (`can_beat`).
Evidence: docs/decisions.md, D3, D6, D18, D108.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Iterable, Protocol, Sequence

from zerotune.core.experiment import Experiment, ExperimentKind, Status
from zerotune.core.objective import Objective

__all__ = ["DEFAULT_PRECISION", "RUN_NOISE", "RUN_NOISE_PRIOR_RUNS", "NoisyMetric", "RunNoise", "can_beat",
           "cannot_beat", "comparison_noise", "known_to_precision", "mean_half_width", "must_beat", "pair_noise",
           "precise", "replica_decides", "resolvable", "run_noise", "tie", "typical_half_width", "within_noise"]

DEFAULT_PRECISION = 0.02
"""Target relative half-width of a metric's 95% interval (0.02 = ±2%)."""

RUN_NOISE = 0.01
"""The run-to-run noise assumed before any config has run twice, and its floor: relative standard
deviation (1%). One run's interval sees only the jitter of its own steps; a whole run can be faster
or slower (placement, the machine's other load, clocks). Comparing two runs, each carries a run term
of about ``2 * sigma`` at 95% (`comparison_noise`). Once configs are re-measured, the tuner
uses `run_noise`'s estimate from their runs instead, never below this."""

RUN_NOISE_PRIOR_RUNS = 2
"""The weight of `RUN_NOISE` in `run_noise`'s estimate, in degrees of freedom (as many
as three runs of one config would give)."""


class NoisyMetric(Protocol):
    """What `within_noise` reads of a measured metric (a strategy's measured point)."""

    rel_half_width: float | None  # of one run's 95% interval (None: unknown, or pooled)
    runs: int  # how many runs the metric pools
    run_noise: float  # the run-to-run noise (relative sigma) known when it was measured


def comparison_noise(rel_half_widths: Sequence[float | None], runs: Sequence[int] = (), floor: float = RUN_NOISE,
                     run_noise: float = RUN_NOISE) -> float:
    """How far apart (relative, at 95%) two or more metrics can be by noise alone:
    ``sqrt(sum over metrics of (hw ** 2 + (2 * run_noise) ** 2 / runs))``, with ``hw`` each one's
    interval half-width (None, unknown or pooled: ``floor``) and ``runs`` how many runs each pools
    (default 1). Independent errors add in quadrature; the run term is the run-to-run noise
    ``run_noise`` (a relative standard deviation: `RUN_NOISE`, or `run_noise`'s estimate),
    which shrinks as runs are pooled."""
    runs = list(runs) or [1] * len(rel_half_widths)
    return math.sqrt(sum((hw or floor) ** 2 + (2 * run_noise) ** 2 / max(1, n) for hw, n in zip(rel_half_widths, runs)))


def pair_noise(a: NoisyMetric, b: NoisyMetric, floor: float, with_runs: bool = True) -> float:
    """The `comparison_noise` of two measured metrics (relative, at 95%): each one's interval, an unknown or
    pooled one counting as ``floor``, plus, ``with_runs``, the run-to-run noise (the larger of the two's
    ``run_noise``), less for pooled metrics."""
    return comparison_noise([a.rel_half_width, b.rel_half_width], [a.runs, b.runs], floor=floor,
                            run_noise=max(a.run_noise, b.run_noise) if with_runs else 0.0)


def within_noise(gain: float, a: NoisyMetric, b: NoisyMetric, floor: float) -> bool:
    """Whether a relative difference ``gain`` between two measured metrics could be noise: smaller in
    size than their `pair_noise`."""
    return abs(gain) < pair_noise(a, b, floor)


def replica_decides(gain: float, a: NoisyMetric, b: NoisyMetric, floor: float, precision: float | None) -> bool:
    """Whether another run can decide between two measured metrics whose relative difference is ``gain``, and it
    matters: no tie (`tie`); their own runs' intervals alone (an unknown or pooled one counting as ``floor``)
    would tell them apart, so the run-to-run noise, which only another launch samples, is what blocks (where the
    runs' own intervals are wider than the difference, steps would decide, not a launch: the stop rule buys them
    while a run goes on, up to what a launch costs, `zerotune.core.stopping`); and the difference's 95%
    interval (`comparison_noise`, ``|gain| +- noise``) reaches past zero by more than ``precision``, so the
    reading could be wrong by more than a tie. Where it reaches no further, the worse side is at most a tie with the
    better one: a launch cannot move the answer by more than the precision promised, and the better reading stands
    (docs/decisions.md, D307, D311)."""
    own = pair_noise(a, b, floor, with_runs=False)
    stake = pair_noise(a, b, floor) - abs(gain)  # how far past zero the difference's interval reaches on the other side
    return not tie(gain, precision) and own <= abs(gain) and stake > (precision or 0.0)


def typical_half_width(rel_half_widths: Iterable[float | None]) -> float | None:
    """What one more run's own interval will be (relative 95% half-width): the median of the intervals of runs of
    the same length (the script's and the stop rule's) so far, unknown ones left out; None when none is known."""
    known = sorted(hw for hw in rel_half_widths if hw is not None)
    return statistics.median(known) if known else None


def resolvable(gain_high: float, expected_noise: float, precision: float | None) -> bool:
    """Whether a launch can move the answer beyond the ``precision`` (None: 0): the most the candidate could truly
    beat the incumbent by, ``gain_high`` (relative), is over the precision (else it is at best a tie) and over
    ``expected_noise``, the `comparison_noise` of one run of it against the incumbent as runs of this length
    read. Where it is not, even the candidate at its best would read within the noise of the incumbent: its reading
    could move the answer only by chance, and the two are tied to what a run can resolve (docs/decisions.md, D322)."""
    return gain_high > max(precision or 0.0, expected_noise)


def tie(gain: float, precision: float | None) -> bool:
    """Whether a relative difference ``gain`` is within the target ``precision`` (None: never): a tie, which no
    re-measurement is run to break, since either side moves the answer by no more than the precision promised."""
    return precision is not None and abs(gain) < precision


def precise(rel_half_width: float | None, precision: float) -> bool:
    """Whether a run's interval (relative 95% half-width; None: unknown) is within the target ``precision``."""
    return rel_half_width is not None and rel_half_width <= precision


def known_to_precision(rel_half_width: float | None, precision: float, run_noise: float) -> bool:
    """Whether one run tells its metric to the target ``precision``: its interval (``rel_half_width``) is that
    narrow (`precise`), and the run-to-run noise it cannot show (``2 * run_noise`` at 95%, ``run_noise`` a
    relative sigma) is no wider."""
    return precise(rel_half_width, precision) and 2 * run_noise <= precision * (1 + 1e-9)


def must_beat(objective: Objective, incumbent: float, rel_half_width: float | None, runs: int = 1,
              run_noise: float = RUN_NOISE) -> float:
    """The bar for a run racing ``incumbent`` (a metric known to ``rel_half_width``, 0.02 = ±2%, pooled
    over ``runs`` runs): the incumbent's pessimistic bound with the run-to-run noise of a comparison,
    ``incumbent * (1 - n)`` where higher is better and ``incumbent * (1 + n)`` where lower is, with
    ``n = sqrt(hw ** 2 + (2 r) ** 2 / runs + (2 r) ** 2)``, ``r`` the run-to-run noise ``run_noise``
    (a relative standard deviation: `RUN_NOISE`, or the tuning's estimate, `run_noise`): the
    incumbent's interval and run term, and the racing run's run term.
    A run ended below it (`cannot_beat`) differs from the incumbent by more than their comparison
    noise, so `within_noise` reads it as a clear loss, not a tie to re-measure."""
    n = math.sqrt((rel_half_width or 0.0) ** 2 + (2 * run_noise) ** 2 / max(1, runs) + (2 * run_noise) ** 2)
    return incumbent * (1 - n) if objective.higher_is_better else incumbent * (1 + n)


def cannot_beat(objective: Objective, value: float, rel_half_width: float, bar: float) -> bool:
    """Whether a run's whole interval lies on the losing side of ``bar`` (`must_beat`): its optimistic
    bound, ``value * (1 + rel_half_width)`` where higher is better (``value * (1 - rel_half_width)`` where lower
    is), does not reach the bar, so more steps would only sharpen a number that loses."""
    higher = objective.higher_is_better
    optimistic = value * (1 + rel_half_width) if higher else value * (1 - rel_half_width)
    return (optimistic < bar) if higher else (optimistic > bar)


def can_beat(bounds_high: float, best_value: float, precision: float) -> bool:
    """Whether a candidate whose throughput is at most ``bounds_high`` (samples/s) may beat the best so far,
    ``best_value`` (samples/s), by more than ``precision`` (relative, 0.01 is 1%): launch it only then; within
    the precision it would be a tie."""
    return bounds_high > best_value * (1 + precision)


@dataclass(frozen=True)
class RunNoise:
    """The run-to-run noise of this tuning's runs (`run_noise`).

    Attributes:
        sigma: the relative standard deviation of one run's metric around its config's mean, beyond
            what the run's own interval shows (0.03 = 3%): the value the decisions use.
        configs: how many configs ran ok more than once (0: ``sigma`` is `RUN_NOISE`).
        df: the estimate's degrees of freedom, the sum over those configs of their runs less one.
        measured: the estimate from the runs alone, before the prior and the floor (None: no config
            ran twice).
    """

    sigma: float
    configs: int = 0
    df: int = 0
    measured: float | None = None

    def describe(self) -> str:
        """One line for the log and the summary."""
        if not self.configs:
            return f"run-to-run noise: sigma {self.sigma:.1%} assumed (no config ran twice)"
        return (f"run-to-run noise: sigma {self.sigma:.1%}, from {self.configs} config(s) run more than once "
                f"({self.df} degree(s) of freedom; the runs alone give {self.measured:.1%})")


def run_noise(experiments: Iterable[Experiment]) -> RunNoise:
    """Estimate the run-to-run noise from the configs that ran ok more than once (a first run and its
    replicas, `zerotune.core.experiment.Experiment.replica_of`; the profile run is left out).

    On the log of the metric (relative deviations), per config with ``k >= 2`` runs: the squared
    deviations from the config's mean, summed over configs, less the part the runs' own intervals
    explain (each run's mean has a variance of about ``(hw / 2) ** 2``; a deviation from a mean of
    ``k`` carries ``(k - 1) / k`` of it); over the degrees of freedom ``df = sum(k - 1)`` that is the
    between-run variance ``v`` (at least 0): the one-way random-effects ANOVA estimate (method of
    moments). It is pooled with the assumed `RUN_NOISE` as a prior worth
    `RUN_NOISE_PRIOR_RUNS` degrees of freedom, ``sigma ** 2 = (p * RUN_NOISE ** 2 + df * v) /
    (p + df)``, so one pair of runs does not swing it, and never below `RUN_NOISE`.

    Returns:
        The estimate (`RunNoise`); ``sigma`` is `RUN_NOISE` while no config ran twice.
    """
    runs: dict[str, list[Experiment]] = {}
    for e in experiments:
        if e.status == Status.OK and e.metric and e.metric > 0 and e.kind is not ExperimentKind.PROFILE:
            runs.setdefault(e.replica_of or e.name, []).append(e)
    squares, explained, df, configs = 0.0, 0.0, 0, 0
    for group in runs.values():
        k = len(group)
        if k < 2:
            continue
        logs = [math.log(e.metric) for e in group]
        mean = statistics.fmean(logs)
        squares += sum((x - mean) ** 2 for x in logs)
        explained += sum(((e.metric_rel_half_width or 0.0) / 2) ** 2 for e in group) * (k - 1) / k
        df += k - 1
        configs += 1
    if not df:
        return RunNoise(RUN_NOISE)
    between = max(0.0, squares - explained) / df
    prior = RUN_NOISE_PRIOR_RUNS
    sigma = math.sqrt((prior * RUN_NOISE ** 2 + df * between) / (prior + df))
    return RunNoise(max(RUN_NOISE, sigma), configs, df, math.sqrt(between))


def mean_half_width(rel_half_widths: Sequence[float | None], sigma: float) -> float:
    """The relative half-width (95%) of the mean of ``k`` runs' metrics of one config, as an estimate
    of what a run of it gives on average: ``sqrt((mean(hw ** 2) + (2 * sigma) ** 2) / k)``, with ``hw``
    each run's own interval half-width (None counts as 0) and ``sigma`` the run-to-run noise
    (`run_noise`). What the summary reports with the answer.

    Raises:
        ValueError: no runs.
    """
    if not rel_half_widths:
        raise ValueError("mean_half_width needs at least one run")
    k = len(rel_half_widths)
    within = statistics.fmean((hw or 0.0) ** 2 for hw in rel_half_widths)
    return math.sqrt((within + (2 * sigma) ** 2) / k)
