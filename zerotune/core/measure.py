"""The metric zerotune decides on, from the step probe's streams: what the user gets, with its uncertainty.

A step's time is the probe's ``step_s`` (end of one optimizer step to end of the next, the whole loop included), per
step index the slowest rank's (`step_stats`), warm-up left out (step 1, leading steps over `WARMUP_FACTOR` times the
later steps' median, then MSER's cut). With ``m`` the steady steps' mean: throughput = ``train_batch_size / m``
samples/s, latency = ``m`` s/step, tokens/s = the steady steps' mean tokens summed over the ranks / ``m``; FLOPS
are not measured (DeepSpeed's metric is kept; MFU is `zerotune.model.flops`'s). The uncertainty is ``m``'s
95% Student-t relative half-width. One run only: the run-to-run noise and comparisons are `zerotune.core.noise`'s.
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
    """The slowest rank's time per step, with the warm-up found in it: the ``steps`` present on every rank,
    ascending; per step the slowest rank's ``step_s`` (seconds) and that rank (the lowest on ties); and how many
    leading steps are warm-up."""

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
        value: the metric in the objective's unit; mean_step_s: the steady steps' mean slowest ``step_s``, seconds.
        rel_half_width: relative half-width of the 95% confidence interval (0.02 = ±2%); None under 2 steady steps.
        steady_steps, warmup_steps, train_batch_size: steps measured and left out; samples per optimizer step.
        slowest_rank_share: rank -> share of the steady steps on which it was the slowest.
        peak_bytes: rank -> its peak memory, bytes (`peak_bytes`).
        boundary_share: the share of ``mean_step_s`` spent in once-per-optimizer-step work (optimizer step,
            boundary reduction), which a larger gas amortizes, 0..1: the steady steps' mean of the ranks' largest
            ``boundary_s``; None when a steady step lacks it on some rank.
        tokens_per_s: tokens all ranks' forwards held per second (`_tokens_per_step` / ``mean_step_s``, padding
            included); None when a steady step lacks ``tokens`` on some rank.
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
    tokens_per_s: float | None = None


def step_stats(streams: Streams) -> StepStats | None:
    """Align the ranks' streams on the step index, per step the slowest rank's ``step_s`` (data-parallel ranks wait
    for each other), and find the warm-up: step 1 (compilation, first allocations), then each leading step over
    `WARMUP_FACTOR` times the median of the later ones, then `_mser`'s cut. A rule on the stream itself, so a warm-up
    longer than ``start_profile_step`` is still left out. None when no step is present on every rank."""
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
    """How many leading values of ``x`` to leave out as a slowly decaying warm-up: the ``d`` (at most half of ``x``)
    minimising ``sum((x_i - mean)^2) / (n - d)^2`` over ``i >= d``, the Marginal Standard Error Rule (K. P. White,
    Simulation 69(6), 1997), which catches a warm-up too slow for the `WARMUP_FACTOR` rule (D200)."""
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
    """The experiment's metric from the probe's streams (the module's method); None (the caller then keeps
    DeepSpeed's metric) for flops, with no steady step on every rank (no streams: the profile run, a run failed
    before its first step; too few steps), or without a ``train_batch_size`` for throughput."""
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
    tokens = _tokens_per_step(streams, stats.steps[stats.warmup_steps:])
    return Measurement(value=value, mean_step_s=mean, rel_half_width=_rel_half_width(steady, mean),
                       steady_steps=len(steady), warmup_steps=stats.warmup_steps, train_batch_size=batch or 0,
                       slowest_rank_share={rank: shares.count(rank) / len(shares) for rank in sorted(streams)},
                       peak_bytes=peak_bytes(streams),
                       boundary_share=_boundary_share(streams, stats.steps[stats.warmup_steps:], mean),
                       tokens_per_s=None if tokens is None else tokens / mean)


def _boundary_share(streams: Streams, steps: Sequence[int], mean_step_s: float) -> float | None:
    """`Measurement.boundary_share` over ``steps``; None when a step lacks ``boundary_s`` on a rank."""
    per_rank = [{r.step: r.boundary_s for r in records if r.step is not None and r.boundary_s is not None}
                for records in streams.values()]
    if not steps or not per_rank or any(step not in times for times in per_rank for step in steps):
        return None
    return statistics.fmean(max(times[step] for times in per_rank) for step in steps) / mean_step_s


def _tokens_per_step(streams: Streams, steps: Sequence[int]) -> float | None:
    """The mean over ``steps`` of the ranks' ``tokens`` summed, tokens; None when a step lacks it on a rank. Under
    sequence parallelism each rank holds its share of a sample's tokens, so the sum counts each token once; an AutoTP
    group's ranks hold the same tokens, each counted over its ``autotp_size``."""
    per_rank = [{r.step: r.tokens / (r.autotp_size or 1) for r in records
                 if r.step is not None and r.tokens is not None} for records in streams.values()]
    if not steps or not per_rank or any(step not in tokens for tokens in per_rank for step in steps):
        return None
    return statistics.fmean(sum(tokens[step] for tokens in per_rank) for step in steps)


def peak_bytes(streams: Streams) -> dict[int, int]:
    """rank -> the largest peak in its records (`zerotune.core.step_record.StepRecord.peak`), bytes: what the
    per-device budget limits (on CUDA the device's, context and NCCL included, not the allocated peak; on CPU
    ``VmData``). Ranks without one are absent."""
    peaks = {}
    for rank, records in streams.items():
        values = [r.peak for r in records if r.peak is not None]
        if values:
            peaks[rank] = max(values)
    return peaks


def activation_slope_bytes(streams: Streams, mbs: int) -> int | None:
    """What a run's own step adds per sample on CUDA, bytes: the ranks' largest ``(peak_bytes - base_bytes) / mbs``
    in their last record after the first optimizer step (``base_bytes`` then the model states); the step's
    constants (the reduction's copy, ZeRO-3's gathered module) are in it. None without such a record (CPU) or
    when not positive."""
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
    """step -> the longest sequence a micro batch of that step held on any rank (``seq_len``), tokens, warm-up
    included; steps no record gives one for are absent."""
    longest: dict[int, int] = {}
    for records in streams.values():
        for r in records:
            if r.step is not None and r.seq_len is not None:
                longest[r.step] = max(longest.get(r.step, 0), r.seq_len)
    return dict(sorted(longest.items()))


def max_seq_len(streams: Streams) -> int | None:
    """The longest sequence a micro batch held in the run, tokens (`seq_lens`); None without one. What the run
    saw: a longer batch later in the data needs more activation memory than the run measured."""
    return max(seq_lens(streams).values(), default=None)


def seen_seq_lens(streams: Streams) -> tuple[int | None, int | None]:
    """``(longest, shortest)`` of the steps' longest sequences (`seq_lens`), tokens, as ``exp.json`` keeps them;
    None, None without one. The longest is from step 2 on where there is one: step 1's peak lacks the optimizer
    states, so its batch is not the one the run's peak pairs with."""
    lengths = seq_lens(streams)
    later = [n for step, n in lengths.items() if step >= 2] or list(lengths.values())
    return max(later, default=None), min(lengths.values(), default=None)


def _rel_half_width(steady: Sequence[float], mean: float) -> float | None:
    """``t(0.975, n - 1) * s / sqrt(n) / mean`` over the ``n`` steady steps (Georges, Buytaert, Eeckhout, OOPSLA
    2007), None under 2; throughput's too, to first order. Steps are only roughly independent: read it as the
    measurement's noise, not a guarantee."""
    n = len(steady)
    if n < 2:
        return None
    return _t_quantile(n - 1) * statistics.stdev(steady) / math.sqrt(n) / mean


def load_quantiles() -> None:
    """Import ``scipy.special`` (about 0.4 s, once per process) now: a backend calls it before launching a run whose
    steps it watches, so the import does not fall in the steps measured."""
    _t_quantile(1)


@functools.lru_cache(maxsize=1024)
def _t_quantile(df: int) -> float:
    """Student's t quantile at `CONFIDENCE` (two-sided) for ``df`` degrees of freedom (``scipy.special.stdtrit``,
    the inverse of the t distribution's CDF that ``scipy.stats.t.ppf`` calls, without scipy.stats' 1.5 s import);
    cached for the stop rule, which asks at every step."""
    from scipy.special import stdtrit  # imported here, once: a process that reads no steps never pays for it
    return float(stdtrit(df, 0.5 + CONFIDENCE / 2))


def _train_batch_size(streams: Streams, step: int) -> int | None:
    """The samples of optimizer step ``step``: its record's ``train_batch_size`` over its ``autotp_size`` (an AutoTP
    group's ranks hold one batch, and DeepSpeed counts each at ZeRO 0-2, D331)."""
    for rank in sorted(streams):
        for r in streams[rank]:
            if r.step == step and r.train_batch_size is not None:
                return r.train_batch_size // (r.autotp_size or 1)
    return None


@dataclass(frozen=True)
class Pooled:
    """The metric of one config over its ok runs (the first and its re-measurements): ``value`` their mean, in the
    objective's unit; ``runs`` their count; ``rel_spread`` their (max - min) / mean (0.0 for one run), the run-to-run
    noise one run's interval cannot see."""

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
    """Experiment name -> its metric pooled over its ok runs and re-measurements (``replica_of``); the profile run
    and experiments without an ok run are absent."""
    runs: dict[str, list[float]] = {}
    for e in experiments:
        if e.status == Status.OK and e.metric is not None and e.kind is not ExperimentKind.PROFILE:
            runs.setdefault(e.replica_of or e.name, []).append(e.metric)
    return {name: pool(values) for name, values in runs.items()}
