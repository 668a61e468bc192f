"""Evaluating experiments for the strategy's phases: the one place that launches (through ``evaluate``).

An `Evaluator` hands batches to ``evaluate`` (the scheduler, or the dry run's memory oracle) and records every outcome
in the ledger. It never evaluates a name twice, never launches a config the memory model fitted so far puts over the
per-device budget with its margin (``Status.REFUSED``, D110) nor one the throughput model says cannot beat the best
by more than the target precision (``Status.SKIPPED``, `zerotune.strategy.prediction`, D108, D322); it sets the bar a
new run races against and runs re-measurements. The phases decide what to evaluate.
"""
from __future__ import annotations

import contextlib
import contextvars
import logging
import math
from typing import Callable, Iterator, Sequence

from zerotune.core.experiment import Experiment, ExperimentKind, Status
from zerotune.core.measure import Pooled
from zerotune.core.noise import DEFAULT_PRECISION, known_to_precision, must_beat, typical_half_width
from zerotune.inputs.budget import BudgetSpent
from zerotune.inputs.configs import ConfigBuilder
from zerotune.inputs.job import Job
from zerotune.strategy.answer import memory_fraction
from zerotune.strategy.prediction import predict, readings
from zerotune.strategy.result import StrategyResult

logger = logging.getLogger(__name__)

PLATEAU_THRESHOLD = 0.01
"""A step that improves the best metric by less than this fraction is a plateau (1%)."""

Evaluate = Callable[[Sequence[Experiment]], Sequence[Experiment]]
"""Runs a batch of experiments (possibly at once) and returns them, in order, with their outcomes."""

_RULE: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar("zerotune_rule", default=())


@contextlib.contextmanager
def buying(rule: str) -> Iterator[None]:
    """Within it, what the evaluator launches was bought by ``rule``, nested rules joined by ": " (``ZeRO stages and
    mbs: ZeRO stage 1: its probe``): each launch records it (``Experiment.bought_by``) for the summary's cost plan."""
    token = _RULE.set(_RULE.get() + (rule,))
    try:
        yield
    finally:
        _RULE.reset(token)


def current_rule() -> str:
    """The rule buying launches now (`buying`); "" outside any."""
    return ": ".join(_RULE.get())


class Evaluator:
    """Evaluates the strategy's experiments against ``evaluate`` and records them in ``result``'s ledger; it refits
    ``result``'s memory model with every run."""

    def __init__(self, job: Job, evaluate: Evaluate, result: StrategyResult):
        self.job = job
        self.builder = ConfigBuilder(job)
        self.result = result
        self.ledger = result.ledger
        self._evaluate = evaluate

    def evaluate(self, experiments: Sequence[Experiment], race: bool = True,
                 bar: float | None = None) -> list[Experiment]:
        """Evaluate the experiments not evaluated before (by name), reuse the others'; return all outcomes, in order.

        With ``race`` a new one races ``bar`` (default `bar`): a backend's stop rule may end it once it cannot win.
        Raises `BudgetSpent` where the launch budget leaves some unlaunched (those within it are recorded).
        """
        memory = self.result.memory
        bar = (bar if bar is not None else self.bar()) if race else None
        todo: dict[str, Experiment] = {}
        for exp in experiments:
            if exp.name not in self.ledger and exp.name not in todo:
                if memory is not None:
                    exp.memory_bytes = memory.bytes_per_device(exp.ds_config)
                if exp.kind is not ExperimentKind.PROFILE:
                    exp.must_beat = bar
                    refusal = None if memory is None else memory.refusal(exp.ds_config, self.job.device_memory_bytes)
                    if refusal is not None:
                        self._not_launched(exp, refusal)  # the fitted model predicts it runs out of memory
                        continue
                    if race and self._skipped(exp):
                        continue
                todo[exp.name] = exp
        batch = list(todo.values())
        for exp in batch:
            exp.bought_by = exp.bought_by or current_rule()
        room = self.job.budget.room(self.ledger.experiments)
        launch = batch if room is None else batch[:room]
        cut = batch[len(launch):]
        for exp in self._evaluate(launch) if launch else []:
            self.ledger.add(exp)
            self._correct_memory(exp)
        if todo:
            before, now = self.ledger.update_run_noise()
            if now.df != before.df and round(now.sigma, 3) != round(before.sigma, 3):
                logger.info(now.describe())
        if cut:
            raise BudgetSpent(f"the launch budget is spent ({self.job.budget.describe(self.ledger.experiments)}): "
                              f"{', '.join(e.name for e in cut)} not launched", cut)
        return [self.ledger[e.name] for e in experiments]

    def launch_outside_ledger(self, experiments: Sequence[Experiment]) -> list[Experiment]:
        """Run ``experiments`` as they are, outside the ledger: no candidate of the answer rule, no reading of the
        memory fit, no launch budget (a verification run, `zerotune.strategy.longest`)."""
        return list(self._evaluate(list(experiments)))

    def _not_launched(self, exp: Experiment, refusal: str) -> None:
        """Record ``exp`` unlaunched as ``Status.REFUSED``, ``error`` = ``refusal`` (its prediction and margin). A
        stage's largest mbs is planned from the profile run: a later run that measures more must not see the plan
        launched into an OOM the fitted model predicts."""
        exp.status, exp.metric, exp.error = Status.REFUSED, None, refusal
        logger.info(f"{exp.name}: {exp.error}")
        self.ledger.add(exp)

    def _skipped(self, exp: Experiment) -> bool:
        """Record ``exp`` unlaunched as skipped where `zerotune.strategy.prediction.predict` says it cannot win."""
        objective = self.job.objective
        if objective.name != "throughput":  # the throughput model's unit, samples/s
            return False
        pooled = self.ledger.pooled()
        best = objective.best(pooled, lambda name: pooled[name].value)
        if best is None:
            return False
        families = readings(self.ledger, self.job.capacity_bytes)
        prediction = predict(exp, families, (best, pooled[best].value), self.precision, cpu=self.job.cpu,
                             noise=self.launch_noise(exp.stage, best))
        if prediction is None:
            return False
        exp.status, exp.metric, exp.error = Status.SKIPPED, None, prediction.reason
        logger.info(f"{exp.name}: {exp.error}")
        self.ledger.add(exp)
        self.result.predictions.append(prediction)
        return True

    def _correct_memory(self, exp: Experiment) -> None:
        """Refit the memory model with a finished run's peak, or its OOM bound (`zerotune.model.online`)."""
        if self.result.memory is not None:
            self.result.memory, why = self.result.memory.observed(exp, self.job.device_memory_bytes)
            if why:
                logger.info(why)

    @property
    def precision(self) -> float:
        """The target relative 95% half-width: ``--precision``; `DEFAULT_PRECISION` with ``--no-adaptive``."""
        return self.job.stop_rule.precision if self.job.stop_rule is not None else DEFAULT_PRECISION

    def bar(self) -> float | None:
        """The bar a new run must beat (`zerotune.core.noise.must_beat`): the best pooled metric's pessimistic bound,
        with its run's half-width (pooled runs, or none: `PLATEAU_THRESHOLD`); None before a run went ok."""
        objective = self.job.objective
        pooled = self.ledger.pooled()
        best = objective.best(pooled, lambda name: pooled[name].value)
        if best is None:
            return None
        hw = self.ledger[best].metric_rel_half_width if pooled[best].runs == 1 else None
        return must_beat(objective, pooled[best].value, hw or PLATEAU_THRESHOLD, runs=pooled[best].runs,
                         run_noise=self.ledger.run_noise.sigma)

    def launch_noise(self, stage: int, best: str) -> float:
        """How far apart (relative, 95%) one new run of ZeRO ``stage`` and the config ``best`` can read by noise
        alone, the finest difference one more launch resolves (D322): ``sqrt(h ** 2 + hw ** 2 + (2 * sigma) ** 2)``,
        ``h`` the best's half-width over its runs, ``hw`` a run's typical own half-width (the stage's runs, else
        every run; unknown: 0), ``sigma`` the run-to-run noise."""
        ran = [e for e in self.ledger.experiments if e.status is Status.OK and e.kind is not ExperimentKind.PROFILE]
        own = [e.metric_rel_half_width for e in ran if e.stage == stage]
        hw = typical_half_width(own) or typical_half_width(e.metric_rel_half_width for e in ran) or 0.0
        return math.sqrt(self.ledger.half_width(best) ** 2 + hw ** 2 + (2 * self.ledger.run_noise.sigma) ** 2)

    def known_to_precision(self, exp: Experiment) -> bool:
        """Whether one run tells ``exp``'s metric to `precision` (`zerotune.core.noise.known_to_precision`)."""
        return known_to_precision(exp.metric_rel_half_width, self.precision, self.ledger.run_noise.sigma)

    def pooled(self, name: str) -> Pooled | None:
        """The metric of experiment ``name`` pooled over its ok runs (None: none ran ok)."""
        return self.ledger.pooled().get(name)

    def remeasure(self, experiments: Sequence[Experiment]) -> list[Pooled | None]:
        """Run each experiment once more (replicas ``<name>_r<k>``, one batch, interleaved); their pooled metrics."""
        replicas = []
        for base in experiments:
            replica = self.builder.experiment(base.ds_config, base.kind, base.knobs)
            replica.name, replica.replica_of = f"{base.name}_r{len(self.ledger.runs_of(base.name)) + 1}", base.name
            replicas.append(replica)
        with buying("a re-measurement"):
            self.evaluate(replicas, race=False)
        return [self.pooled(base.name) for base in experiments]

    def memory_fraction(self, exp: Experiment) -> float | None:
        """``exp``'s measured peak over the per-device budget; None without a peak, and on CPU ranks (no capacity)."""
        return memory_fraction(exp.peak_memory_bytes, self.job.capacity_bytes)

    def host_fits(self, ds_config: dict) -> bool:
        """Whether what ``ds_config`` offloads fits each node's host memory (True where the model or it is unknown)."""
        memory = self.result.memory
        return memory is None or memory.host_fits(ds_config, self.job.host_memory_bytes, self.job.slots_per_node)
