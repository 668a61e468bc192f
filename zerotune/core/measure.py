"""The metric zerotune decides on, from the step probe's streams: what the user gets, with its uncertainty.

A step's time is the probe's ``step_s`` (from the end of one optimizer step to the end of the next, the whole training
loop included), per step index the slowest rank's: data-parallel ranks wait for each other (`step_stats`). Warm-up
is left out: step 1, leading steps over `WARMUP_FACTOR` times the later steps' median, then MSER's cut (`_mser`).
With ``m`` the steady steps' mean: throughput = ``train_batch_size / m`` samples/s, latency = ``m`` s/step; FLOPS
are not measured (`measure` returns None: DeepSpeed's metric is kept). The uncertainty is the relative half-width
of ``m``'s 95% Student-t interval (`_rel_half_width`). This module measures one run: the run-to-run noise and every
comparison of runs are `zerotune.core.noise`'s.
"""
from __future__ import annotations

import functools
import math
import statistics
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from zerotune.core.experiment import Experiment, ExperimentKind, Status
from zerotune.core.objective import Objective
from zerotune.core.step_record import StepRecord

__all__ = ["CONFIDENCE", "WARMUP_FACTOR", "Measurement", "Pooled", "StepStats", "activation_slope_bytes", "max_seq_len",
           "measure", "peak_bytes", "pool", "pooled_metrics", "seen_seq_lens", "seq_lens", "step_stats"]

WARMUP_FACTOR = 1.5  # a leading step slower than this times the later steps' median is warm-up
CONFIDENCE = 0.95

Streams = Mapping[int, Sequence[StepRecord]]
"""rank -> the probe's step records, in order, each parsed and validated once (`zerotune.probe.read_streams`;
records held in memory, a simulated run's, go through `zerotune.probe.step_records`)."""


@dataclass(frozen=True)
class StepStats:
    """The slowest rank's time per step, with the warm-up found in it.

    Attributes:
        steps: the step indices present on every rank, ascending.
        step_s: per step, the slowest rank's ``step_s``, seconds.
        slowest_rank: per step, that rank (the lowest on ties).
        warmup_steps: how many leading steps are warm-up.
    """

    steps: tuple[int, ...]
    step_s: tuple[float, ...]
    slowest_rank: tuple[int, ...]
    warmup_steps: int

    @property
    def steady_s(self) -> tuple[float, ...]:
        """The steady steps' slowest ``step_s``, seconds."""
        return self.step_s[self.warmup_steps:]


@dataclass(frozen=True)
class Measurement:
    """An experiment's metric from the probe.

    Attributes:
        value: the metric in the objective's unit (samples/s or s/step).
        mean_step_s: mean of the steady steps' slowest ``step_s``, seconds.
        rel_half_width: relative half-width of the 95% confidence interval (0.02 = ±2%); None
            with fewer than 2 steady steps.
        steady_steps, warmup_steps: how many steps were measured and how many left out.
        train_batch_size: global samples per optimizer step.
        slowest_rank_share: rank -> share of the steady steps on which it was the slowest.
        peak_bytes: rank -> its peak memory, bytes (`peak_bytes`).
        boundary_share: the share of the mean step spent in the work done once per optimizer step (optimizer
            step, boundary gradient reduction): the mean over the steady steps of the largest ``boundary_s``
            among the ranks, over ``mean_step_s``; the share a larger gas amortizes, 0..1; None when a steady
            step lacks it on some rank.
    """

    value: float
    mean_step_s: float
    rel_half_width: float | None
    steady_steps: int
    warmup_steps: int
    train_batch_size: int
    slowest_rank_share: dict[int, float]
    peak_bytes: dict[int, int]
    boundary_share: float | None = None


def step_stats(streams: Streams) -> StepStats | None:
    """Align the ranks' streams on the step index and find the warm-up. None when no step is present on every rank.

    Per step index with a ``step_s`` on every rank, the slowest rank's: the job advances at its pace, as
    data-parallel ranks wait for each other in the gradient collectives. Warm-up: step 1 always (compilation,
    first allocations, timed from the first forward); then each leading step over `WARMUP_FACTOR` times the median
    of the steps after it; then `_mser`'s cut, at most half the rest. A rule on the stream itself, so a warm-up
    longer than ``start_profile_step`` is still left out."""
    per_rank = {rank: {r.step: r.step_s for r in records if r.step is not None and r.step_s is not None}
                for rank, records in streams.items()}
    if not per_rank:
        return None
    steps = sorted(set.intersection(*(set(times) for times in per_rank.values())))
    if not steps:
        return None
    ranks = sorted(per_rank)
    slowest = [max(ranks, key=lambda rank: (per_rank[rank][step], -rank)) for step in steps]
    step_s = [per_rank[rank][step] for rank, step in zip(slowest, steps)]
    warmup = 1 if steps[0] == 1 else 0
    while len(step_s) - warmup >= 2 and step_s[warmup] > WARMUP_FACTOR * statistics.median(step_s[warmup + 1:]):
        warmup += 1
    warmup += _mser(step_s[warmup:])
    return StepStats(tuple(steps), tuple(step_s), tuple(slowest), warmup)


def _mser(x: Sequence[float]) -> int:
    """How many leading values of ``x`` to leave out as a slowly decaying warm-up: the truncation
    ``d`` (at most half of ``x``) that minimises the standard error of the mean of what remains,
    ``sum((x_i - mean)^2) / (n - d)^2`` over ``i >= d`` (the Marginal Standard Error Rule, K. P. White,
    "An effective truncation heuristic for bias reduction in simulation output", Simulation 69(6),
    1997). It catches the warm-up that decays too slowly for the `WARMUP_FACTOR` rule
    (docs/decisions.md, D200)."""
    best_d, best = 0, math.inf
    for d in range(len(x) // 2 + 1):
        rest = x[d:]
        if len(rest) < 2:
            break
        mean = statistics.fmean(rest)
        score = sum((v - mean) ** 2 for v in rest) / len(rest) ** 2
        if score < best * (1 - 1e-9):
            best_d, best = d, score
    return best_d


def measure(streams: Streams, objective: Objective) -> Measurement | None:
    """The experiment's metric from the probe's streams (the module's method).

    Args:
        streams: rank -> that rank's probe records in file order
            (`zerotune.probe.read_streams`).
        objective: the metric tuned; only throughput and latency are measured.

    Returns:
        The measurement; None when the probe cannot give this objective (flops), or there is no
        steady step on every rank (no streams: the profile run, a run that failed before its first
        step; a script with too few steps), or
        no ``train_batch_size`` for throughput. The caller then keeps DeepSpeed's metric.
    """
    if objective.name not in ("throughput", "latency"):
        return None
    stats = step_stats(streams)
    if stats is None or not stats.steady_s:
        return None
    steady = stats.steady_s
    mean = statistics.fmean(steady)
    batch = _train_batch_size(streams, stats.steps[stats.warmup_steps])
    if mean <= 0 or (objective.name == "throughput" and batch is None):
        return None
    value = batch / mean if objective.name == "throughput" else mean
    shares = stats.slowest_rank[stats.warmup_steps:]
    return Measurement(value=value, mean_step_s=mean, rel_half_width=_rel_half_width(steady, mean),
                       steady_steps=len(steady), warmup_steps=stats.warmup_steps, train_batch_size=batch or 0,
                       slowest_rank_share={rank: shares.count(rank) / len(shares) for rank in sorted(streams)},
                       peak_bytes=peak_bytes(streams),
                       boundary_share=_boundary_share(streams, stats.steps[stats.warmup_steps:], mean))


def _boundary_share(streams: Streams, steps: Sequence[int], mean_step_s: float) -> float | None:
    """Mean over ``steps`` of the largest ``boundary_s`` among the ranks, over ``mean_step_s``; None
    when a step lacks it on a rank (a probe that did not record it)."""
    per_rank = [{r.step: r.boundary_s for r in records if r.step is not None and r.boundary_s is not None}
                for records in streams.values()]
    if not steps or not per_rank or any(step not in times for times in per_rank for step in steps):
        return None
    return statistics.fmean(max(times[step] for times in per_rank) for step in steps) / mean_step_s


def peak_bytes(streams: Streams) -> dict[int, int]:
    """rank -> the largest peak in its records, bytes: what the per-device budget limits. On CUDA the record's
    ``device_peak_bytes`` (the caching allocator's reserved high-water mark plus what lies outside it: the CUDA
    context, NCCL's buffers), where it holds one, not ``peak_bytes`` (allocated bytes, which leave both out:
    a run can fill the device while its allocated peak reads 0.85 of it); on CPU ``peak_bytes``, the largest
    ``VmData``, sampled every 5 ms (`zerotune.core.step_record.StepRecord.peak`). Ranks without one are absent."""
    peaks = {}
    for rank, records in streams.items():
        values = [r.peak for r in records if r.peak is not None]
        if values:
            peaks[rank] = max(values)
    return peaks


def activation_slope_bytes(streams: Streams, mbs: int) -> int | None:
    """What a run's own step adds per sample on CUDA, bytes: ``(peak_bytes - base_bytes) / mbs`` from the
    last record of each rank after the first optimizer step (``base_bytes`` is then the model states:
    parameters, gradients, optimizer states; ``peak_bytes`` the allocated high-water mark), the largest over
    the ranks. None where no such record holds both (CPU ranks: no ``base_bytes``), or the figure is not
    positive. The step's constants (the reduction's copy, ZeRO-3's gathered module) are in it, over mbs."""
    if mbs < 1:
        return None
    slopes = []
    for records in streams.values():
        last = [r for r in records if r.step is not None and r.step >= 2 and r.base_bytes is not None
                and r.peak_bytes is not None]
        if last:
            slopes.append((last[-1].peak_bytes - last[-1].base_bytes) // mbs)
    return max(slopes) if slopes and max(slopes) > 0 else None


def seq_lens(streams: Streams) -> dict[int, int]:
    """step -> the longest sequence a micro batch of that optimizer step held on any rank, tokens (the records'
    ``seq_len``), every step recorded, warm-up included; steps no rank's record gives one for are absent (no
    token ids in the forward's arguments, a probe older than the field)."""
    longest: dict[int, int] = {}
    for records in streams.values():
        for r in records:
            if r.step is not None and r.seq_len is not None:
                longest[r.step] = max(longest.get(r.step, 0), r.seq_len)
    return dict(sorted(longest.items()))


def max_seq_len(streams: Streams) -> int | None:
    """The longest sequence a micro batch held in the run, on any rank and at any step, tokens
    (`seq_lens`); None where no record gives one. What the run saw, not what the training will: a
    longer batch later in the data needs more activation memory than the run measured."""
    return max(seq_lens(streams).values(), default=None)


def seen_seq_lens(streams: Streams) -> tuple[int | None, int | None]:
    """``(longest, shortest)`` of the run's steps' longest sequences (`seq_lens`), tokens, as ``exp.json``
    keeps them (``max_seq_len_seen``, ``min_seq_len_seen``); None, None where no record gives one. The longest is
    from step 2 on where a record of step 2 or later gives one: step 1's peak lacks the optimizer states (that
    step creates them), so its batch is not the one the run's peak pairs with; the shortest counts every step."""
    lengths = seq_lens(streams)
    later = [n for step, n in lengths.items() if step >= 2] or list(lengths.values())
    return max(later, default=None), min(lengths.values(), default=None)


def _rel_half_width(steady: Sequence[float], mean: float) -> float | None:
    """``t(0.975, n - 1) * s / sqrt(n) / mean``, ``s`` the sample standard deviation of the ``n`` steady steps; None
    under 2 (steady-state benchmarking: Georges, Buytaert, Eeckhout, OOPSLA 2007). Throughput gets the same relative
    half-width (first order). Steps are taken as independent, which they only roughly are: read it as the
    measurement's noise, not a guarantee."""
    n = len(steady)
    if n < 2:
        return None
    return _t_quantile(n - 1) * statistics.stdev(steady) / math.sqrt(n) / mean


def load_quantiles() -> None:
    """Import what a run's interval needs (``scipy.stats``: about 0.7 s of CPU, once per process) now. A backend
    calls it before it launches a run whose steps it watches, so the import does not fall in the steps measured."""
    _t_quantile(1)


@functools.lru_cache(maxsize=1024)
def _t_quantile(df: int) -> float:
    """Student's t quantile at `CONFIDENCE` (two-sided) for ``df`` degrees of freedom. Cached: the stop rule
    asks for it at every step of a running experiment, and ``scipy.stats.t.ppf`` takes about a millisecond."""
    from scipy.stats import t  # imported here: scipy.stats takes a while to import
    return float(t.ppf(0.5 + CONFIDENCE / 2, df))


def _train_batch_size(streams: Streams, step: int) -> int | None:
    for rank in sorted(streams):
        for r in streams[rank]:
            if r.step == step and r.train_batch_size is not None:
                return r.train_batch_size
    return None


@dataclass(frozen=True)
class Pooled:
    """The metric of one config over its runs (the first and its re-measurements).

    Attributes:
        value: the mean of the runs' metrics, in the objective's unit.
        runs: how many runs finished ok.
        rel_spread: (max - min) / mean of the runs' metrics (0.0 for one run): the run-to-run
            noise that one run's interval cannot see.
    """

    value: float
    runs: int
    rel_spread: float


def pool(metrics: Sequence[float]) -> Pooled | None:
    """Pool the ok runs' metrics of one config (their mean); None when there are none."""
    if not metrics:
        return None
    mean = statistics.fmean(metrics)
    return Pooled(mean, len(metrics), (max(metrics) - min(metrics)) / mean if mean else 0.0)


def pooled_metrics(experiments: Iterable[Experiment]) -> dict[str, Pooled]:
    """Experiment name -> its metric pooled over its ok runs (the experiment and its re-measurements,
    `zerotune.core.experiment.Experiment.replica_of`); the profile run and experiments with no
    ok run are absent."""
    runs: dict[str, list[float]] = {}
    for e in experiments:
        if e.status == Status.OK and e.metric is not None and e.kind is not ExperimentKind.PROFILE:
            runs.setdefault(e.replica_of or e.name, []).append(e.metric)
    return {name: pool(values) for name, values in runs.items()}
