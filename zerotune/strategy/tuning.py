"""The tuning strategy, whole: a pipeline of phases that decides every experiment of a tuning job (D100).

`Strategy` talks to the world through one callable, ``evaluate(experiments)``, which returns them with outcomes
(`zerotune.strategy.evaluation`): ``tune`` passes the scheduler, ``--dry-run`` `zerotune.strategy.oracle`. The run is
a pure function of the outcomes, in phases (`Strategy.run`): profile, ZeRO stages and mbs, memory savers, gas (then
the fine pass under a launch budget, D312), knobs (``"fast": false``), the answer, the longest batch; a spent budget
ends it with the best that ran. A name (its canonical content) is evaluated at most once.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Sequence

from zerotune.core.errors import ConfigError, TuningFailed
from zerotune.core.experiment import Experiment, ExperimentKind, Status
from zerotune.core.measure import Pooled
from zerotune.core.units import format_bytes
from zerotune.deepspeed.auto import read_engine_record
from zerotune.inputs.budget import BudgetSpent
from zerotune.inputs.job import Job
from zerotune.model.memory import MemoryModel
from zerotune.model.online import OnlineMemory
from zerotune.model.profile import ModelInfo
from zerotune.model.tokens import square_bytes
from zerotune.model.zero_options import ZeroOptions
from zerotune.probe import read_square_activations
from zerotune.run.expdir import ulysses_refused
from zerotune.strategy import remeasure
from zerotune.strategy.answer import NEAR_CAPACITY
from zerotune.strategy.evaluation import PLATEAU_THRESHOLD, Evaluate, Evaluator, buying
from zerotune.strategy.fine import fine_gaps, refine_mbs
from zerotune.strategy.gas_phase import GasPhase
from zerotune.strategy.knobs import knob_stages, tune_knobs
from zerotune.strategy.ledger import Ledger
from zerotune.strategy.longest import settle_longest
from zerotune.strategy.points import Point, SearchBounds
from zerotune.strategy.result import StagePlan, StageResult, StrategyResult
from zerotune.strategy.savers import SaverPhase
from zerotune.strategy.stages import explore_stages
from zerotune.strategy.stop_bound import Left, stop_bound

__all__ = ["Strategy"]

logger = logging.getLogger(__name__)

FINE_PASS = "the fine pass"
"""The fine pass on the best stage, a phase of its own under a launch budget (`Strategy.fine_last`)."""
EXPLORE = "ZeRO stages and mbs"
"""The phase that decides the stages and their mbs: where a stop leaves every stage undecided."""
LATER_PHASES = {"memory savers": ExperimentKind.MBS, "gas": ExperimentKind.GAS, "knobs": ExperimentKind.KNOBS}
"""The phases after it that try other configs, each with the kind of experiment it runs (what the throughput model
can bound of it, `zerotune.strategy.stop_bound`)."""


class Strategy:
    """Runs the tuning strategy of ``job`` against ``evaluate``; ``parallel``: experiments the slots can run at once
    (the knob phase's batch size)."""

    def __init__(self, job: Job, evaluate: Evaluate, parallel: int = 1):
        self.job = job
        self.parallel = max(1, parallel)
        self.result = StrategyResult(ledger=Ledger(job.objective, job.capacity_bytes))
        self.ev = Evaluator(job, evaluate, self.result)
        self.result.ledger.precision = self.ev.precision  # configs within it of the best tie (strategy.answer)
        self.builder = self.ev.builder
        # every mbs search's bounds, whichever phase runs it
        self.bounds = SearchBounds(job.min_mbs, job.max_mbs, job.objective, allowed=job.allowed_mbs,
                                   threshold=PLATEAU_THRESHOLD, precision=self.ev.precision,
                                   num_fine=job.autotuning.num_tuning_micro_batch_sizes)
        # under a launch budget the fine pass, which refines within one explored stage, runs after the phases that
        # try other configs (their bound is wider, docs/decisions.md D312): the stage and saver phases run without it
        self.fine_last = job.budget.max_launches is not None or job.budget.max_device_hours is not None
        self.phase_bounds = dataclasses.replace(self.bounds, num_fine=0) if self.fine_last else self.bounds
        # StageResult.key (the stage, or "<stage>+<saver>") -> (mbs, gas) better than its mbs search's best
        self.best_batch: dict[int | str, tuple[int, int]] = {}

    def run(self) -> StrategyResult:
        """Run the phases in order; one that finds the launch budget spent (`zerotune.inputs.budget.BudgetSpent`)
        ends the tuning (`stop`).

        Raises:
            TuningFailed: the profile run failed.
            ConfigError: a config the user's settings give is invalid.
        """
        self.profile()
        phases = [(EXPLORE, self.explore), ("memory savers", self.savers), ("gas", self.gas)]
        phases += [(FINE_PASS, self.refine)] if self.fine_last else []
        phases += [("knobs", lambda: tune_knobs(self.ev, self.parallel, self.best_batch))] if not self.job.autotuning.fast \
            else []
        phases += [("the answer's re-measurement", self.settle_answer), ("the longest batch", self.longest)]
        for i, (name, phase) in enumerate(phases):
            try:
                with buying(name):
                    phase()
            except BudgetSpent as spent:  # the best of what ran is the answer (zerotune.inputs.budget)
                self.stop(spent, [name for name, _ in phases[i:]])
                self.longest(verify=False)  # the answer is still checked at the longest batch: that launches nothing
                break
        return self.result

    def stop(self, spent: BudgetSpent, left: list[str]) -> None:
        """End the tuning on ``spent`` with the phases ``left`` not decided: `StrategyResult.stopped` says why
        and which, `StrategyResult.stop_bound` what they left and by how much the answer could be beaten."""
        self.result.stopped = f"{spent}; not decided: {', '.join(left)}"
        logger.warning(f"stopped: {self.result.stopped}")
        stages, values = (self.job.stages, self.bounds.values) if EXPLORE in left else self._fine_left(left)
        later = [(name, LATER_PHASES[name]) for name in left if name in LATER_PHASES]
        self.result.stop_bound = bound = stop_bound(self.result.ledger, self.job, self.builder,
                                                    Left(stages, later, spent.cut, self.max_mbs_estimate, values))
        for line in bound.describe() if bound is not None else []:
            logger.warning(line)

    def _fine_left(self, left: list[str]) -> tuple[tuple[int, ...], list[int]]:
        """What a stop before the fine pass (`FINE_PASS` in ``left``) leaves of the best stage (without a
        saver): (its stage, the mbs in the gaps `zerotune.strategy.fine.fine_gaps`); else nothing."""
        variant = self._best_variant()
        if FINE_PASS not in left or variant is None or variant.settings:
            return (), []
        return (variant.stage,), fine_gaps(variant.trace, self.bounds)

    def refine(self) -> None:
        """The fine pass on the best variant (`zerotune.strategy.fine.refine_mbs`) after gas (`fine_last`)."""
        variant = self._best_variant()
        if variant is not None:
            refine_mbs(lambda ms: self._points(variant, ms), variant.trace, self.bounds)

    def _best_variant(self) -> StageResult | None:
        """The best explored stage, with its saver if any (the first of
        `zerotune.strategy.knobs.knob_stages`): where the gas phase and the fine pass work."""
        top = knob_stages(self.result.stages, self.job.objective)[:1]
        return top[0][0] if top else None

    def gas(self) -> None:
        """Gas at each explored stage's best mbs (`zerotune.strategy.gas_phase.GasPhase`)."""
        self.best_batch = GasPhase(self.ev, self.result.stages).run()

    def longest(self, verify: bool = True) -> None:
        """Check the answer at the longest batch (`zerotune.strategy.longest`), and run it there with
        ``--verify-longest`` unless ``verify`` is False; the model's positions and scores come from the profile."""
        profile_dir = self.job.exps_dir / self.builder.profile().name
        positions = (read_engine_record(profile_dir) or {}).get("max_positions")
        options = self.job.longest if verify else dataclasses.replace(self.job.longest, verify=False)
        self.result.longest = settle_longest(self.ev, options,
                                             positions if isinstance(positions, int) and positions > 0 else None,
                                             square_bytes(read_square_activations(profile_dir)))

    def settle_answer(self) -> None:
        """The finalists re-measured, then the answer itself where it must be (`zerotune.strategy.remeasure`)."""
        remeasure.confirm_answer(self.ev)
        if not self.job.autotuning.fast or remeasure.answer_stands_out(self.ev):
            remeasure.measure_answer_twice(self.ev)

    # -- the evaluator's verbs, for callers that drive a strategy step by step --------------------------
    def evaluate(self, experiments: Sequence[Experiment], race: bool = True,
                 bar: float | None = None) -> list[Experiment]:
        """`zerotune.strategy.evaluation.Evaluator.evaluate`."""
        return self.ev.evaluate(experiments, race=race, bar=bar)

    def remeasure(self, experiments: Sequence[Experiment]) -> list[Pooled | None]:
        """`zerotune.strategy.evaluation.Evaluator.remeasure`."""
        return self.ev.remeasure(experiments)

    def pooled(self, name: str) -> Pooled | None:
        """The metric of experiment ``name`` pooled over its ok runs (None: none ran ok)."""
        return self.ev.pooled(name)

    # -- 1. profile -----------------------------------------------------------------------------------
    def profile(self) -> None:
        """Build the memory model from the profile run's ``model_info``, calibrated on its measured peak (CPU: the
        backend's sampled peak; CUDA: the probe's device peak).

        Raises:
            ConfigError: the config lists a Ulysses degree the script or the model's heads do not take
                (`expdir.ulysses_refused`).
            TuningFailed: the profile run did not finish ok otherwise.
        """
        (exp,) = self.evaluate([self.builder.profile()])
        refused = ulysses_refused(exp, self.job.exps_dir / exp.name)
        if refused is not None:
            raise ConfigError(f"{self.job.config_path}: {refused}")
        if exp.status != Status.OK:
            raise TuningFailed(f"the profile run failed ({exp.status.value if exp.status else '?'}: {exp.error}); "
                               f"see {self.job.exps_dir / exp.name}")
        if not exp.metrics:
            logger.info("profile: model size unknown, so the memory model prunes nothing")
            return
        info = self.result.model_info = ModelInfo.from_metrics(exp.metrics, exp.peak_memory_bytes, mbs=exp.mbs,
                                                                ds_config=exp.ds_config)
        memory = MemoryModel(info.num_params, info.activation_mem_per_gpu, self.job.dp_world_size, self.job.mp_size,
                             trainable_params=info.trainable_num_params,
                             largest_layer_params=info.largest_layer_params, persistent_params=info.persistent_params,
                             host_on_device=self.job.cpu, activation_sp=ZeroOptions.of(exp.ds_config).sp,
                             checkpointed_activation_bytes_per_sample=info.checkpointed_activation_mem_per_gpu)
        if info.peak_memory_bytes:
            memory = memory.calibrated(exp.ds_config, info.peak_memory_bytes, mbs=self.job.min_mbs,
                                       after_backward=info.peak_after_backward)
        self.result.memory = OnlineMemory(memory)
        checkpointed = info.checkpointed_activation_mem_per_gpu
        with_checkpointing = f" ({format_bytes(checkpointed)} with checkpointing)" if checkpointed is not None else ""
        logger.info(f"profile: {info.num_params:,} parameters, activations {format_bytes(info.activation_mem_per_gpu)} "
                    f"per sample{with_checkpointing}, per-rank overhead {format_bytes(memory.overhead_bytes)}, budget "
                    f"{format_bytes(self.job.device_memory_bytes)} per rank")

    # -- 2. stages and micro batch sizes --------------------------------------------------------------
    def max_mbs_estimate(self, stage: int) -> int:
        """The memory model's largest mbs for ``stage`` within the budget (at most the job's largest
        mbs; below the smallest when the stage does not fit; the largest when the model is unknown)."""
        lo, hi = self.job.min_mbs, self.job.max_mbs
        if self.result.memory is None:
            return hi
        if not self.ev.host_fits(self.builder.config(stage, lo)):
            return lo - 1
        return self.result.memory.max_mbs(self.builder.config(stage, lo), self.job.device_memory_bytes, cap=hi)

    def plans(self) -> list[StagePlan]:
        """One plan per candidate stage, with the memory model's largest fitting mbs; each verdict logged."""
        lo, plans = self.job.min_mbs, []
        for stage in self.job.stages:
            est = self.max_mbs_estimate(stage)
            plans.append(StagePlan(stage, est))
            if self.result.memory is not None:
                config = self.builder.config(stage, lo)
                host = self.result.memory.prior.breakdown(config).host
                why = (f"offload needs {format_bytes(host * self.job.slots_per_node)} of host memory per "
                       f"node, the node has {format_bytes(self.job.host_memory_bytes or 0)}" if not
                       self.ev.host_fits(config) else
                       f"{format_bytes(self.result.memory.bytes_per_device(config))} per rank at mbs={lo}")
                logger.info(f"memory model: ZeRO stage {stage}: " + (f"largest mbs estimated to fit {est}"
                            if est >= lo else f"does not fit ({why}): pruned"))
        return plans

    def explore(self) -> None:
        """Explore the ZeRO stages and their mbs (`zerotune.strategy.stages.explore_stages`) through the evaluator."""
        self.result.stages = explore_stages(self._points, self.plans(), self.phase_bounds, self._confirmed_points)
        for r in self.result.stages:
            logger.info(f"ZeRO stage {r.stage}: {r.decision.value} ({r.reason})"
                        + (f", stopped: {r.trace.stop.value}" if r.trace.stop else ""))

    # -- 3. memory savers ------------------------------------------------------------------------------
    def savers(self) -> None:
        """Try checkpointing and offload where memory binds a stage (`zerotune.strategy.savers.SaverPhase`)."""
        SaverPhase(self.ev, self._points, self.phase_bounds, self._confirmed_points).run()

    def _points(self, variant: StageResult, mbs_values: Sequence[int]) -> list[Point]:
        """Evaluate ``variant`` (its stage and saver settings) at each mbs; their points for the mbs search."""
        stage, settings = variant.stage, variant.settings
        done = self.evaluate([self.builder.mbs_experiment(stage, m, settings=settings) for m in mbs_values])
        sigma = self.result.run_noise.sigma
        return [Point(m, e.status, e.metric, rel_half_width=e.metric_rel_half_width, run_noise=sigma,
                      **self._memory_terms(stage, e, settings)) for m, e in zip(mbs_values, done)]

    def _confirmed_points(self, variant: StageResult, mbs_values: Sequence[int]) -> list[Point]:
        """Re-measure ``variant`` at each (measured) mbs once more; their points pooled over their runs."""
        stage, settings = variant.stage, variant.settings
        bases = self.evaluate([self.builder.mbs_experiment(stage, m, settings=settings) for m in mbs_values])
        pooled = self.remeasure(bases)
        sigma = self.result.run_noise.sigma
        terms = [self._memory_terms(stage, e, settings) for e in bases]
        return [Point(m, e.status, e.metric, run_noise=sigma, **t) if p is None
                else Point(m, Status.OK, p.value, p.runs, run_noise=sigma, **t)
                for m, e, p, t in zip(mbs_values, bases, pooled, terms)]

    def _memory_terms(self, stage: int, exp: Experiment, settings: dict | None = None) -> dict:
        """A point's memory terms: a refused one's ``refusal`` (its prediction); on GPU ranks also its peak over the
        budget and ``calm_mbs``, the largest mbs the fitted memory model puts under `NEAR_CAPACITY` of it (where the
        mbs search looks below a best near the capacity)."""
        refusal = {"refusal": exp.error} if exp.status is Status.REFUSED else {}
        if self.job.cpu:
            return refusal
        lo, hi = self.job.min_mbs, self.job.max_mbs
        budget, memory = self.job.device_memory_bytes, self.result.memory
        calm = None if memory is None else memory.max_mbs(self.builder.config(stage, lo, settings),
                                                          int(NEAR_CAPACITY * budget), cap=hi)
        return {**refusal, "memory_fraction": self.ev.memory_fraction(exp),
                "calm_mbs": calm if calm is not None and calm >= lo else None}
