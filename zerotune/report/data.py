"""The report's one model (`ReportData`): the runs, the answer, the runner-up, what was not run, the cost, the
projection. The tuner builds it from what it holds (`ReportData.from_tuning`), ``zerotune report`` from a results
dir on disk (`zerotune.report.disk.load`); both give the same figures for the same runs.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from zerotune.core.experiment import Experiment, ExperimentKind, Status
from zerotune.core.measure import Pooled, pooled_metrics
from zerotune.core.noise import RunNoise, comparison_noise, mean_half_width, run_noise
from zerotune.core.objective import Objective
from zerotune.core.stopping import EARLY_ENDS
from zerotune.model.flops import FlopsModel
from zerotune.model.zero_options import samples_per_step
from zerotune.strategy.answer import best_experiment

if TYPE_CHECKING:
    from zerotune.strategy.result import StrategyResult

RESULTS_JSON = "results.json"

ORIGINS = ("launched", "cached", "not launched")
"""Where an entry of the report comes from: launched by this tuning, read back from an earlier one's records (a
resumed tuning reuses what finished), or never launched (`NotRun`: pruned, skipped or refused)."""

OUTCOMES = ("ok", "stopped early", "oom", "failed", "timed out", "interrupted")
"""How a launch ended, as the report names it (`outcome`), in the legend's order."""

STATES = ("running", "finished", "interrupted", "failed")
"""The tuning's state when the report was written: still running (or killed without a word), finished with an
answer, stopped by a signal, or ended without an answer."""


def outcome(exp: Experiment) -> str:
    """How ``exp``'s launch ended, one of `OUTCOMES`: ``stopped early`` is an ok run zerotune ended once its metric
    was known or could not win (`zerotune.core.stopping.EARLY_ENDS`); ``interrupted`` a run the tuner was stopped in
    (or, while the tuning runs, one still running)."""
    status = exp.status or Status.INTERRUPTED
    if status is Status.OK:
        return "stopped early" if exp.ended in EARLY_ENDS else "ok"
    return {Status.TIMEOUT: "timed out", Status.SKIPPED: "interrupted"}.get(status, status.value)


@dataclass(frozen=True)
class NotRun:
    """A ZeRO stage, memory saver or candidate config that was never launched, and why (human text)."""

    what: str
    reason: str


@dataclass(frozen=True)
class TrainingPlan:
    """The full training run the report projects with the answer (``--train-samples``/``--train-steps``,
    ``--cost-per-device-hour``; all None: no projection) and its devices' peak, TFLOP/s (``--peak-tflops``; None:
    by the device's name, `zerotune.model.flops`)."""

    train_samples: int | None = None
    train_steps: int | None = None
    cost_per_device_hour: float | None = None
    peak_tflops: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {"train_samples": self.train_samples, "train_steps": self.train_steps,
                "cost_per_device_hour": self.cost_per_device_hour, "peak_tflops": self.peak_tflops}

    def over(self, other: "TrainingPlan") -> "TrainingPlan":
        """This plan where it says something, else ``other``'s (the command line's options over the tuner's)."""
        samples, steps = (self.train_samples, self.train_steps) if (self.train_samples or self.train_steps) else (
            other.train_samples, other.train_steps)
        cost = self.cost_per_device_hour if self.cost_per_device_hour is not None else other.cost_per_device_hour
        peak = self.peak_tflops if self.peak_tflops is not None else other.peak_tflops
        return TrainingPlan(samples, steps, cost, peak)


@dataclass(frozen=True)
class RunnerUp:
    """The best config other than the answer, and how far the answer is from it.

    Attributes:
        value/answer_value: the two pooled metrics, in the objective's unit.
        gain: the answer's relative improvement over it (0.05: 5% better; negative where the answer rule read the
            curve's shape over a higher single reading, D101).
        noise: the relative 95% gap two such readings can show by noise alone (`zerotune.core.noise.comparison_noise`).
        tie: the two read within the target precision of each other, a tie the tie order decided without a launch
            (`zerotune.strategy.answer.tie_order`).
    """

    name: str
    value: float
    answer_value: float
    gain: float
    noise: float
    tie: bool = False

    @property
    def beyond_noise(self) -> bool:
        """True when the answer is better by more than the noise can explain."""
        return self.gain > self.noise


@dataclass(frozen=True)
class Projection:
    """The full training run with the answer's config: ``samples`` or ``steps`` as given, the other from the global
    batch; ``seconds``, its wall time, carrying the answer's relative 95% interval ``rel_half_width``;
    ``device_hours``: ``seconds * devices / 3600``; ``cost``: device-hours times the price per device-hour (None
    without one)."""

    samples: int
    steps: int
    seconds: float
    rel_half_width: float
    devices: int
    device_hours: float
    cost: float | None


@dataclass
class ReportData:
    """The one model every report file renders: ``summary.txt`` (`zerotune.report.results`), ``report.html``
    (`zerotune.report.html`), ``results.csv`` and ``results.json`` (`zerotune.report.table_export`).

    Attributes:
        experiments: this tuning's launches and the runs read back from an earlier one (`origin`), the profile
            included, in launch order.
        budget_bytes: the per-device memory budget, bytes.
        capacity_bytes: the budget the answer rule reads capacity against (None on CPU ranks,
            `zerotune.inputs.job.Job.capacity_bytes`).
        answer: the ledger's (`zerotune.strategy.ledger.Ledger.answer`); None: none ran ok yet.
        not_run: stages, savers and candidates never launched, with why. notes: the tuner's other notes.
        state: one of `STATES`. context: the runs' resume context (`zerotune.run.resume.resume_context`).
        strategy_known: ``not_run`` and ``notes`` are the tuner's (False: read from a results dir without the
            tuner's ``results.json``, where they are unknown).
        written_at: when this was gathered; since: when this tuning started (None: unknown); seconds since the epoch.
        precision: the target relative precision within which two configs tie (None: unknown).
        cached: the names of the runs read back from an earlier tuning's records.
        elapsed_s: the tuning time so far, s (None: unknown).
    """

    experiments: list[Experiment]
    objective: Objective
    budget_bytes: int | None
    capacity_bytes: int | None
    answer: Experiment | None
    exps_dir: Path
    not_run: list[NotRun] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    state: str = "running"
    context: dict[str, Any] = field(default_factory=dict)
    plan: TrainingPlan = field(default_factory=TrainingPlan)
    strategy_known: bool = True
    written_at: float = field(default_factory=time.time)
    precision: float | None = None
    cached: frozenset[str] = frozenset()
    since: float | None = None
    elapsed_s: float | None = None

    @classmethod
    def from_tuning(cls, experiments: list[Experiment], result: "StrategyResult", *, objective: Objective,
                    budget_bytes: int | None, capacity_bytes: int | None, exps_dir: Path, context: dict[str, Any],
                    notes: list[str], state: str, plan: TrainingPlan, cached: frozenset[str] = frozenset(),
                    since: float | None = None, elapsed_s: float | None = None) -> "ReportData":
        """The report of a tuning in progress or just ended: ``experiments`` is the scheduler's history (launched, and
        ``cached`` from disk), ``result`` the strategy's record (the ledger's answer, what it did not run)."""
        launched = {e.name for e in experiments}
        runs = sorted(experiments, key=launch_order)
        answer = result.answer if result.answer is not None and result.answer.name in launched else None
        precision = result.ledger.precision
        return cls(runs, objective, budget_bytes, capacity_bytes,
                   answer or best_experiment(runs, objective, capacity_bytes, precision), Path(exps_dir),
                   not_run_of(result, launched), list(notes), state, dict(context), plan, precision=precision,
                   cached=frozenset(cached) & launched, since=since, elapsed_s=elapsed_s)

    def origin(self, exp: Experiment) -> str:
        """Where ``exp`` comes from: ``launched`` by this tuning or ``cached`` (`ORIGINS`)."""
        return "cached" if exp.name in self.cached else "launched"

    @property
    def launched(self) -> int:
        """How many of the experiments this tuning launched."""
        return sum(1 for e in self.experiments if e.name not in self.cached)

    @cached_property
    def pooled(self) -> dict[str, Pooled]:
        """Experiment name -> its metric pooled over its ok runs (`zerotune.core.measure.pooled_metrics`)."""
        return pooled_metrics(self.experiments)

    @cached_property
    def flops(self) -> FlopsModel | None:
        """The model's FLOPs per token and the device's peak, for MFU (`zerotune.model.flops.FlopsModel`); None
        without a profile run."""
        return FlopsModel.from_profile(self.experiments, self.plan.peak_tflops)

    def mfu(self, exp: Experiment) -> float | None:
        """``exp``'s model FLOPs utilisation, 0..1 (`FlopsModel.mfu`); None where unknown."""
        return None if self.flops is None else self.flops.mfu(exp, self.objective.name)

    @cached_property
    def noise(self) -> RunNoise:
        """The run-to-run noise of the configs run more than once (`zerotune.core.noise.run_noise`)."""
        return run_noise(self.experiments)

    @property
    def answer_runs(self) -> list[Experiment]:
        """The answer's ok runs with a metric: its first run and its re-measurements (none without an answer)."""
        if self.answer is None:
            return []
        return [e for e in self.experiments if e.status is Status.OK and e.metric is not None
                and self.answer.name in (e.name, e.replica_of)]

    @property
    def answer_half_width(self) -> float | None:
        """The answer's 95% interval, relative, over its runs (`zerotune.core.noise.mean_half_width`)."""
        runs = [e.metric_rel_half_width for e in self.answer_runs]
        return mean_half_width(runs, self.noise.sigma) if runs else None

    def runner_up(self) -> RunnerUp | None:
        """The best other config by pooled metric (`RunnerUp`); None without an answer or another config."""
        pooled, answer = self.pooled, self.answer
        if answer is None or answer.name not in pooled:
            return None
        others = [e for e in self.experiments if e.replica_of is None and e.name in pooled and e.name != answer.name]
        other = self.objective.best(others, lambda e: pooled[e.name].value)
        if other is None:
            return None
        a, o = pooled[answer.name], pooled[other.name]
        noise = comparison_noise([_own_half_width(answer, a), _own_half_width(other, o)], [a.runs, o.runs],
                                 run_noise=self.noise.sigma)
        gain = self.objective.gain(a.value, o.value)
        return RunnerUp(other.name, o.value, a.value, gain, noise,
                        tie=self.precision is not None and abs(gain) < self.precision)

    def projection(self) -> Projection | None:
        """The full training run with the answer (`Projection`); None without an answer, run length or time metric."""
        answer, plan = self.answer, self.plan
        if answer is None or not (plan.train_samples or plan.train_steps) or self.objective.name == "flops":
            return None
        value = self.pooled[answer.name].value
        devices = answer.num_nodes * answer.num_slots
        batch = samples_per_step(answer.ds_config, devices) or answer.mbs * answer.gas * devices
        steps = plan.train_steps or math.ceil(plan.train_samples / batch)
        samples = plan.train_samples or steps * batch
        seconds = samples / value if self.objective.name == "throughput" else steps * value
        device_hours = seconds * devices / 3600
        cost = None if plan.cost_per_device_hour is None else device_hours * plan.cost_per_device_hour
        return Projection(samples, steps, seconds, self.answer_half_width or 0.0, devices, device_hours, cost)

    def tuning_start(self) -> float | None:
        """When the first launch started, seconds since the epoch (None: no launch has a start time)."""
        starts = [e.started_at for e in self.experiments if e.started_at is not None]
        return min(starts) if starts else None


def not_run_of(result: "StrategyResult", launched: set[str]) -> list[NotRun]:
    """What the strategy never launched, with why: stages pruned or skipped, savers not tried, and candidates the
    memory model put over the budget or the throughput model said could not win."""
    rows = [NotRun(r.label, f"{r.decision.value}: {r.reason}") for r in result.stages
            if r.decision is not None and r.decision.value in ("pruned", "skipped")]
    rows += [NotRun("memory savers", note) for note in result.savers_notes]
    rows += [NotRun(e.name, e.error or f"{e.status.value}: not launched") for e in result.experiments
             if e.name not in launched and e.status is not None and e.status is not Status.SKIPPED]
    rows += [NotRun(p.name, p.reason) for p in result.predictions if p.name not in launched]
    return rows


def launch_order(exp: Experiment) -> tuple:
    """Launch order: by start time; the profile run first among runs without one."""
    return (exp.started_at is None, exp.started_at or 0.0, exp.kind is not ExperimentKind.PROFILE)


def _own_half_width(exp: Experiment, pooled: Pooled) -> float | None:
    """A single run's own interval half-width; None (the noise floor) for a pooled metric."""
    return exp.metric_rel_half_width if pooled.runs == 1 else None

