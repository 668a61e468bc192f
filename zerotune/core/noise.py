"""Noise and precision: whether two metrics differ by more than noise, whether one is known precisely enough, and
whether a candidate can still beat the best; every decision between runs reads its rule here (D3, D6, D18, D108).

Rules: a metric's noise (relative, at 95%) is its run's interval ``hw`` plus the run-to-run noise, about ``2 * sigma``
(`RUN_NOISE`, then `run_noise`'s estimate), added in quadrature and shrinking as runs are pooled (`comparison_noise`).
A difference within the target precision (``--precision``) is a tie (`tie`) that no run is spent to break. A
candidate is raced against the incumbent's pessimistic bound (`must_beat`), ended once it `cannot_beat`, and not
launched where the throughput model bounds it under the best samples/s plus the precision (`can_beat`).
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
    """How far apart (relative, at 95%) metrics can be by noise alone:
    ``sqrt(sum of (hw ** 2 + (2 * run_noise) ** 2 / runs))``, ``hw`` each one's interval half-width (None, unknown
    or pooled: ``floor``), ``runs`` how many runs each pools (default 1), ``run_noise`` a relative sigma."""
    runs = list(runs) or [1] * len(rel_half_widths)
    return math.sqrt(sum((hw or floor) ** 2 + (2 * run_noise) ** 2 / max(1, n) for hw, n in zip(rel_half_widths, runs)))


def pair_noise(a: NoisyMetric, b: NoisyMetric, floor: float, with_runs: bool = True) -> float:
    """`comparison_noise` of two measured metrics, an unknown or pooled interval counting as ``floor``;
    ``with_runs`` adds the larger of their ``run_noise``."""
    return comparison_noise([a.rel_half_width, b.rel_half_width], [a.runs, b.runs], floor=floor,
                            run_noise=max(a.run_noise, b.run_noise) if with_runs else 0.0)


def within_noise(gain: float, a: NoisyMetric, b: NoisyMetric, floor: float) -> bool:
    """Whether a relative difference ``gain`` between two measured metrics is within their `pair_noise`."""
    return abs(gain) < pair_noise(a, b, floor)


def replica_decides(gain: float, a: NoisyMetric, b: NoisyMetric, floor: float, precision: float | None) -> bool:
    """Whether another run can decide between two measured metrics ``gain`` apart (relative), and it matters
    (D307, D311): no `tie`; their own intervals alone (unknown or pooled: ``floor``) tell them apart, so the
    run-to-run noise, which only another launch samples, blocks (else steps decide: the stop rule buys them); and
    the difference's 95% interval (``|gain| +- noise``) reaches past zero by more than ``precision``, so the reading
    could be wrong by more than a tie."""
    own = pair_noise(a, b, floor, with_runs=False)
    stake = pair_noise(a, b, floor) - abs(gain)  # how far past zero the difference's interval reaches on the other side
    return not tie(gain, precision) and own <= abs(gain) and stake > (precision or 0.0)


def typical_half_width(rel_half_widths: Iterable[float | None]) -> float | None:
    """What one more run's own interval will be (relative 95% half-width): the median of the intervals of runs of
    the same length (the script's and the stop rule's) so far, unknown ones left out; None when none is known."""
    known = sorted(hw for hw in rel_half_widths if hw is not None)
    return statistics.median(known) if known else None


def resolvable(gain_high: float, expected_noise: float, precision: float | None) -> bool:
    """Whether a launch can move the answer beyond ``precision`` (None: 0): ``gain_high``, the most the candidate
    could truly beat the incumbent by (relative), is over the precision and over ``expected_noise``, the
    `comparison_noise` of one run of it against the incumbent; else it reads within the incumbent's noise (D322)."""
    return gain_high > max(precision or 0.0, expected_noise)


def tie(gain: float, precision: float | None) -> bool:
    """Whether a relative difference ``gain`` is within ``precision`` (None: never): a tie, which no re-measurement
    is run to break, since either side moves the answer by no more than the precision promised."""
    return precision is not None and abs(gain) < precision


def precise(rel_half_width: float | None, precision: float) -> bool:
    """Whether a run's interval (relative 95% half-width; None: unknown) is within the target ``precision``."""
    return rel_half_width is not None and rel_half_width <= precision


def known_to_precision(rel_half_width: float | None, precision: float, run_noise: float) -> bool:
    """Whether one run tells its metric to ``precision``: its interval is that narrow (`precise`), and so is the
    run-to-run noise it cannot show (``2 * run_noise`` at 95%)."""
    return precise(rel_half_width, precision) and 2 * run_noise <= precision * (1 + 1e-9)


def must_beat(objective: Objective, incumbent: float, rel_half_width: float | None, runs: int = 1,
              run_noise: float = RUN_NOISE) -> float:
    """The bar for a run racing ``incumbent`` (known to ``rel_half_width``, pooled over ``runs`` runs): its
    pessimistic bound, ``incumbent * (1 - n)`` where higher is better, ``incumbent * (1 + n)`` where lower is, with
    ``n = sqrt(hw ** 2 + (2 r) ** 2 / runs + (2 r) ** 2)``, ``r = run_noise``: the incumbent's interval and run term,
    and the racing run's run term. A run ended below it (`cannot_beat`) is a clear loss by `within_noise`, not a tie
    to re-measure."""
    n = math.sqrt((rel_half_width or 0.0) ** 2 + (2 * run_noise) ** 2 / max(1, runs) + (2 * run_noise) ** 2)
    return incumbent * (1 - n) if objective.higher_is_better else incumbent * (1 + n)


def cannot_beat(objective: Objective, value: float, rel_half_width: float, bar: float) -> bool:
    """Whether a run's whole interval lies on the losing side of ``bar`` (`must_beat`): its optimistic bound,
    ``value * (1 + rel_half_width)`` where higher is better (``1 - rel_half_width`` where lower), misses the bar."""
    higher = objective.higher_is_better
    optimistic = value * (1 + rel_half_width) if higher else value * (1 - rel_half_width)
    return (optimistic < bar) if higher else (optimistic > bar)


def can_beat(bounds_high: float, best_value: float, precision: float) -> bool:
    """Whether a candidate whose throughput is at most ``bounds_high`` may beat ``best_value`` (both samples/s) by
    more than ``precision`` (relative): launch it only then; within the precision it would be a tie."""
    return bounds_high > best_value * (1 + precision)


@dataclass(frozen=True)
class RunNoise:
    """The run-to-run noise of this tuning's runs (`run_noise`): ``sigma``, the relative standard deviation of one
    run's metric around its config's mean beyond its own interval (0.03 = 3%), the value the decisions use; from
    ``configs`` configs run ok more than once (0: ``sigma`` is `RUN_NOISE`) with ``df`` degrees of freedom (their runs
    less one, summed); ``measured``, the runs' estimate before the prior and the floor (None: no config ran twice)."""

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
    """The run-to-run noise from the configs that ran ok more than once (a first run and its replicas,
    ``Experiment.replica_of``; the profile run left out).

    On the log of the metric, per config with ``k >= 2`` runs: the squared deviations from its mean, less what the
    runs' own intervals explain (``(hw / 2) ** 2`` each, times ``(k - 1) / k``), over ``df = sum(k - 1)``: the
    between-run variance ``v >= 0``, the one-way random-effects ANOVA estimate (method of moments). Pooled with
    `RUN_NOISE` as a prior worth ``p =`` `RUN_NOISE_PRIOR_RUNS` degrees of freedom,
    ``sigma ** 2 = (p * RUN_NOISE ** 2 + df * v) / (p + df)``, so one pair of runs does not swing it; never below
    `RUN_NOISE`.
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
    """The relative 95% half-width of the mean of ``k`` runs' metrics of one config (the summary's, with the
    answer): ``sqrt((mean(hw ** 2) + (2 * sigma) ** 2) / k)``, ``hw`` each run's interval half-width (None: 0) and
    ``sigma`` the run-to-run noise (`run_noise`).

    Raises:
        ValueError: no runs.
    """
    if not rel_half_widths:
        raise ValueError("mean_half_width needs at least one run")
    k = len(rel_half_widths)
    within = statistics.fmean((hw or 0.0) ** 2 for hw in rel_half_widths)
    return math.sqrt((within + (2 * sigma) ** 2) / k)
