"""The report's one model: the runs, the answer, the runner-up, what was not run, the cost, the projection.

Rules: `ReportData` is built two ways that give the same figures for the same runs: by the tuner from what it holds
(`ReportData.from_tuning`), or from a results dir on disk (`load`, for ``zerotune report``): the runs from the
experiments' verified records (``exp.json``, `zerotune.run.store.load_records`) and those ``results.json`` holds, what
only the tuner knew (answer, what it did not run, notes, state) from that ``results.json``. From ``results.json``
alone it is the live report again, byte for byte. Every report file renders from it alone: ``summary.txt``,
``report.html``, ``results.csv`` and ``results.json``.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from zerotune.core.errors import ConfigError, RecordError
from zerotune.core.experiment import Experiment, ExperimentKind, Status
from zerotune.core.measure import Pooled, pooled_metrics
from zerotune.core.noise import RunNoise, comparison_noise, mean_half_width, run_noise
from zerotune.core.objective import Objective
from zerotune.core.stopping import DEFAULT_PRECISION, EARLY_ENDS
from zerotune.run.store import RECORD_FILE, ExpRecord, load_records, read_json
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
    """How ``exp``'s launch ended, one of `OUTCOMES`: ``stopped early`` is an ok run zerotune ended once
    its metric was known or could not win (`zerotune.core.stopping.EARLY_ENDS`); ``interrupted`` a run the
    tuner was stopped in (or, while the tuning runs, one still running)."""
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
    ``--cost-per-device-hour``); all None: no projection."""

    train_samples: int | None = None
    train_steps: int | None = None
    cost_per_device_hour: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {"train_samples": self.train_samples, "train_steps": self.train_steps,
                "cost_per_device_hour": self.cost_per_device_hour}

    def over(self, other: "TrainingPlan") -> "TrainingPlan":
        """This plan where it says something, else ``other``'s (the command line's options over the tuner's)."""
        samples, steps = (self.train_samples, self.train_steps) if (self.train_samples or self.train_steps) else (
            other.train_samples, other.train_steps)
        cost = self.cost_per_device_hour if self.cost_per_device_hour is not None else other.cost_per_device_hour
        return TrainingPlan(samples, steps, cost)


@dataclass(frozen=True)
class SavedTuning:
    """The ``tuning`` section of a ``results.json`` (`zerotune.report.table_export.json_text`) as `load`
    reads it back: what only the tuner knew. A field the section lacks, or holds with another type than zerotune
    writes, is None (empty, for ``not_run`` and ``notes``): a damaged or foreign file is read as far as it is right,
    never fatal.

    Attributes:
        exps_dir: where the experiments ran.
        context: the resume context of the tuning's runs (`zerotune.run.resume.resume_context`).
        state: one of `STATES`, when it was written.
        strategy_known: whether the tuner knew what the strategy did not run (False where the section lacks it).
        not_run: what was never launched, and why. notes: the summary's notes.
        plan: the training run the tuner projected.
        since: when that tuning started, seconds since the epoch. elapsed_s: its tuning time then, s.
        found: whether the section holds any of these fields as zerotune writes it.
        answer: the answer it wrote (the ledger's, by name; the file's top-level ``answer``).
        cached: the names of the rows it wrote as read back from an earlier tuning (``origin`` ``cached``).
        records: the runs its ``records`` hold that verify (`zerotune.run.store.ExpRecord.from_dict`), in order.
        written_at: when it was written, seconds since the epoch (to the millisecond it records; None: unknown).
    """

    exps_dir: str | None = None
    context: dict[str, Any] | None = None
    state: str | None = None
    strategy_known: bool = False
    not_run: tuple[NotRun, ...] = ()
    notes: tuple[str, ...] = ()
    plan: TrainingPlan = TrainingPlan()
    since: float | None = None
    elapsed_s: float | None = None
    found: bool = False
    answer: str | None = None
    cached: frozenset[str] = frozenset()
    records: tuple[Experiment, ...] = ()
    written_at: float | None = None

    @classmethod
    def read(cls, path: Path) -> "SavedTuning":
        """The section in the ``results.json`` at ``path``, with the file's answer and cached rows; an empty one
        (``found`` False) where it has no section."""
        body = read_json(path) or {}
        tuning, answer, rows = body.get("tuning"), body.get("answer"), body.get("experiments")
        saved = cls.from_dict(tuning) if isinstance(tuning, dict) else cls()
        cached = frozenset(r["name"] for r in (rows if isinstance(rows, list) else ())
                           if isinstance(r, dict) and r.get("origin") == "cached" and isinstance(r.get("name"), str))
        return replace(saved, answer=answer if isinstance(answer, str) else None, cached=cached,
                       records=_verified(body.get("records")), written_at=_epoch(saved.found and tuning.get("written_at")))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "SavedTuning":
        """The section from its decoded JSON object, each field validated as the class docstring says."""
        kept = {k: v for k, v in data.items() if k in _SAVED_TYPES and isinstance(v, _SAVED_TYPES[k])
                and isinstance(v, bool) == (k == "strategy_known")}
        not_run = tuple(NotRun(str(n.get("what", "")), str(n.get("reason", "")))
                        for n in kept.get("not_run", []) if isinstance(n, dict))
        plan = TrainingPlan(kept.get("train_samples"), kept.get("train_steps"), kept.get("cost_per_device_hour"))
        return cls(kept.get("exps_dir"), kept.get("context"), kept.get("state"),
                   kept.get("strategy_known", False), not_run, tuple(str(n) for n in kept.get("notes", [])),
                   plan, kept.get("since"), kept.get("elapsed_s"), found=bool(kept))


def _verified(records: Any) -> tuple[Experiment, ...]:
    """The experiments of a ``results.json``'s ``records`` that verify as ``exp.json`` does; the rest left out."""
    out = []
    for data in records if isinstance(records, list) else ():
        try:
            out.append(ExpRecord.from_dict(data).experiment)
        except (RecordError, AttributeError, TypeError, ValueError):
            continue
    return tuple(out)


def _epoch(iso: Any) -> float | None:
    """Seconds since the epoch of ``2026-11-26T19:02:26.123Z`` (`zerotune.report.table_export.iso_time`), half a
    millisecond in, so that it formats back to the same text; None for anything else."""
    try:
        moment = datetime.strptime(iso, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=timezone.utc)
    except (TypeError, ValueError):
        return None
    return round(moment.timestamp() * 1000) / 1000 + 0.0005


_SAVED_TYPES = {"exps_dir": str, "context": dict, "state": str, "strategy_known": bool, "not_run": list,
                "notes": list, "train_samples": int, "train_steps": int, "cost_per_device_hour": (int, float),
                "since": (int, float), "elapsed_s": (int, float)}


@dataclass(frozen=True)
class RunnerUp:
    """The best config other than the answer, and how far the answer is from it.

    Attributes:
        name: its experiment name. value/answer_value: the two pooled metrics, in the objective's unit.
        gain: the answer's relative improvement over it (0.05: 5% better; negative where the answer rule read
            the curve's shape over a higher single reading, docs/decisions.md D101).
        noise: how far apart two such readings can be by noise alone, relative, 95%
            (`zerotune.core.noise.comparison_noise` with this tuning's run-to-run noise).
        tie: the two read within the target precision of each other: a tie, which the tie order decided
            without a launch (`zerotune.strategy.answer.tie_order`).
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
    """The full training run with the answer's config.

    Attributes:
        samples, steps: the run's length (one given, the other from the global batch).
        seconds: its wall time, s; rel_half_width: the answer's 95% interval, relative, which the time carries.
        devices: devices it holds; device_hours: ``seconds * devices / 3600``; cost: device-hours times the price
            per device-hour (None without one).
    """

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

    Its entries are the launches of this tuning and the runs read back from an earlier one (`origin`,
    `ORIGINS`), and what was never launched (``not_run``); the answer is the strategy's ledger's
    (`zerotune.strategy.ledger.Ledger.answer`), read back by name from disk.

    Attributes:
        experiments: the runs of this tuning (the profile run included), in launch order.
        objective: the tuned metric. budget_bytes: the per-device memory budget, bytes.
        capacity_bytes: the budget the answer rule reads capacity against (None on CPU ranks,
            `zerotune.strategy.job.Job.capacity_bytes`).
        answer: the optimal experiment (None: none ran ok yet).
        not_run: stages, savers and candidates never launched, with why. notes: the tuner's other notes.
        state: one of `STATES`. context: the runs' resume context (`zerotune.run.resume.resume_context`).
        exps_dir: where the experiments' directories are. plan: the training run to project.
        strategy_known: ``not_run`` and ``notes`` are the tuner's (False: read from a results dir without the
            tuner's ``results.json``, where they are unknown).
        written_at: when this was gathered, seconds since the epoch.
        precision: the target precision (relative) within which two configs tie (None: unknown).
        cached: the names of the runs read back from an earlier tuning's records, not launched by this one.
        since: when this tuning started, seconds since the epoch (None: unknown).
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
        """The report of a tuning in progress or just ended: ``experiments`` is the scheduler's history (what was
        launched, and the runs ``cached`` from disk), ``result`` the strategy's record (the ledger's answer and what
        it did not run)."""
        launched = {e.name for e in experiments}
        runs = sorted(experiments, key=_launch_order)
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
        """Experiment name -> its metric pooled over its ok runs (`zerotune.core.measure.pooled_metrics`),
        computed once."""
        return pooled_metrics(self.experiments)

    @cached_property
    def noise(self) -> RunNoise:
        """The run-to-run noise of the configs run more than once (`zerotune.core.noise.run_noise`)."""
        return run_noise(self.experiments)

    @property
    def answer_half_width(self) -> float | None:
        """The answer's 95% interval, relative, over its runs (`zerotune.core.noise.mean_half_width`)."""
        if self.answer is None:
            return None
        runs = [e.metric_rel_half_width for e in self.experiments if e.status is Status.OK and e.metric is not None
                and self.answer.name in (e.name, e.replica_of)]
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
        """The full training run with the answer (`Projection`); None without an answer, a run length,
        or a metric that gives time (throughput or latency)."""
        answer, plan = self.answer, self.plan
        if answer is None or not (plan.train_samples or plan.train_steps) or self.objective.name == "flops":
            return None
        value = self.pooled[answer.name].value
        devices = answer.num_nodes * answer.num_slots
        batch = int(answer.ds_config.get("train_batch_size") or answer.mbs * answer.gas * devices)
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
    """What the strategy never launched, with why: stages the memory model pruned or the strategy skipped, the
    savers it did not try, candidates the memory model put over the budget, and those the throughput model said
    could not win."""
    rows = [NotRun(r.label, f"{r.decision.value}: {r.reason}") for r in result.stages
            if r.decision is not None and r.decision.value in ("pruned", "skipped")]
    rows += [NotRun("memory savers", note) for note in result.savers_notes]
    rows += [NotRun(e.name, e.error or f"{e.status.value}: not launched") for e in result.experiments
             if e.name not in launched and e.status is not None and e.status is not Status.SKIPPED]
    rows += [NotRun(p.name, p.reason) for p in result.predictions if p.name not in launched]
    return rows


def load(results_dir: Path, exps_dir: Path | None = None, plan: TrainingPlan | None = None) -> ReportData:
    """The report of the tuning whose results are in ``results_dir``, finished, running or interrupted, from disk.

    The experiments are the verified records (``exp.json``) under ``exps_dir`` (default: the one ``results.json``
    names, else ``<results_dir>/exps``) of one tuning: those with the resume context ``results.json`` records,
    else the latest record's (an exps dir may hold runs of other inputs); then those of ``results.json``'s
    ``records`` no ``exp.json`` holds (an exps dir moved or deleted). A record that does not verify is left
    out. The objective and budget come from that context; the answer is the one ``results.json`` names (the
    ledger's, as the tuner last wrote it) where it is among the runs and ran ok, and only without one (no
    ``results.json``, or a damaged one) recomputed from the runs (`zerotune.strategy.answer.best_experiment`);
    the state from the files (`_state_on_disk`). With no ``exp.json`` read, the state and the time written are
    ``results.json``'s: its report again.

    Args:
        plan: the training run to project, over the one ``results.json`` records.

    Raises:
        ConfigError: ``results_dir`` is not a directory, neither it nor ``exps_dir`` holds any zerotune result, or
            an ``exps_dir`` given holds no record (the message names the path and what was expected).
    """
    results_dir = Path(results_dir)
    if not results_dir.is_dir():
        raise ConfigError(f"{results_dir}: not a directory: expected a zerotune results dir (autotuning.results_dir "
                          f"or --results-dir)")
    tuning = SavedTuning.read(results_dir / RESULTS_JSON)
    records = load_records(Path(exps_dir)) if exps_dir else []
    if exps_dir and not records:  # a typo would otherwise rewrite results.json as a tuning with no run
        raise ConfigError(f"--exps-dir {exps_dir}: no experiment record of zerotune's there (exp.json in each "
                          f"experiment's directory): expected the tuning's exps dir")
    exps_dir = Path(exps_dir or tuning.exps_dir or results_dir / "exps")
    records = records or load_records(exps_dir)
    if not records and not tuning.found:
        found = "no " + RESULTS_JSON if not (results_dir / RESULTS_JSON).exists() else \
            f"a {RESULTS_JSON} that is not zerotune's (no 'tuning' section)"
        raise ConfigError(f"{results_dir}: {found} and no experiment records under {exps_dir}: expected a "
                          f"zerotune results dir (pass --exps-dir where the experiments went elsewhere)")
    context = tuning.context or (max(records, key=lambda r: r.recorded_at).resume_context if records else {})
    on_disk = [r.experiment for r in records if r.resume_context == context]
    runs = sorted(on_disk + [e for e in tuning.records if e.name not in {d.name for d in on_disk}], key=_launch_order)
    objective = Objective.named(context.get("objective") or "throughput")
    budget = context.get("device_memory_bytes") if isinstance(context.get("device_memory_bytes"), int) else None
    capacity = None if context.get("cpu", True) else budget
    precision = context.get("precision") or DEFAULT_PRECISION  # without adaptive runs, the strategy's default
    answer = next((e for e in runs if e.name == tuning.answer and e.replica_of is None and e.status is Status.OK
                   and e.metric is not None), None) or best_experiment(runs, objective, capacity, precision)
    saved_only = not on_disk and tuning.state in STATES and tuning.written_at is not None
    state = tuning.state if saved_only else _state_on_disk(results_dir, exps_dir, runs, answer)
    return ReportData(runs, objective, budget, capacity, answer, exps_dir, list(tuning.not_run), list(tuning.notes),
                      state, context, (plan or TrainingPlan()).over(tuning.plan), strategy_known=tuning.strategy_known,
                      precision=precision, cached=tuning.cached, since=tuning.since, elapsed_s=tuning.elapsed_s,
                      **({"written_at": tuning.written_at} if saved_only else {}))


def _state_on_disk(results_dir: Path, exps_dir: Path, runs: list[Experiment], answer: Experiment | None) -> str:
    """The tuning's state, read from the files (a ``results.json``'s may be stale, or written by ``zerotune report``):
    ended when ``summary.txt`` (written when a tuning ends, however it ends) is newer than every record, and then
    interrupted, finished or failed by its runs; else running (or killed)."""
    try:
        summary = (results_dir / "summary.txt").stat().st_mtime
        newest = max((p.stat().st_mtime for p in exps_dir.glob(f"*/{RECORD_FILE}")), default=0.0)
    except OSError:
        return "running"
    if summary < newest:
        return "running"
    if any(e.status in (None, Status.INTERRUPTED) for e in runs):
        return "interrupted"
    return "finished" if answer is not None else "failed"


def _launch_order(exp: Experiment) -> tuple:
    """Launch order: by start time; the profile run first among runs without one."""
    return (exp.started_at is None, exp.started_at or 0.0, exp.kind is not ExperimentKind.PROFILE)


def _own_half_width(exp: Experiment, pooled: Pooled) -> float | None:
    """A single run's own interval half-width; None (the noise floor) for a pooled metric."""
    return exp.metric_rel_half_width if pooled.runs == 1 else None

