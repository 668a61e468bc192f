"""The tuning strategy, whole: profile -> ZeRO stages -> micro batch sizes -> knobs.

:class:`Strategy` decides every experiment of a tuning job and talks to the world through one
callable, ``evaluate(batch of experiments) -> the same experiments with their outcomes``. ``tune``
passes the scheduler (real launches); ``--dry-run`` passes the memory-model oracle
(:mod:`zerotune.strategy.oracle`), so the dry run lists what this same code would try if the
memory model were right. The run is a pure function of the outcomes it is told:

1. **Profile**: one experiment (:meth:`ConfigBuilder.profile`); its ``model_info`` gives the memory
   model (:class:`~zerotune.model.memory.MemoryModel`), calibrated on CPU to the run's peak.
2. **Stages and mbs** (:func:`~zerotune.strategy.stages.explore_stages`): per stage, the memory
   model's largest fitting mbs, then the progressive stage rule and the mbs search.
3. **Gas** (where the batch semantics allow it, :mod:`zerotune.strategy.batch`): the best stage's
   best mbs's global batch split in two (half the mbs, twice the gas), then gradient accumulation
   steps at that best mbs.
4. **Knobs** (``"fast": false``): for the best stage, and another within :data:`KNOB_STAGE_MARGIN`
   of it, at its best mbs and gas, the stage's tuning space walked by the configured tuner in batches as
   large as the slots can run at once.

An experiment whose name (its canonical content) was already evaluated is never evaluated again:
its outcome is reused, e.g. the knob-space candidate that is the mbs phase's own config. A
measurement is never decided on one run where it matters: a plateau and a losing stage probe are
re-measured (a replica, ``<name>_r2``, run beside the point it is compared with) and decided on
the pooled metrics (only where the difference is within the runs' noise), and before the answer
the configs whose difference from the best is within their noise (at most :data:`FINAL_MARGIN`)
are re-measured until each has two runs; the answer is the best pooled metric, on GPU ranks with each config's
runs away from the device's capacity fitted as a curve rising with mbs, whose value is at its largest mbs
(:func:`zerotune.report.results.best_experiment`). With ``"fast": false`` the answer itself is
reported on at least two runs (:meth:`Strategy.measure_answer_twice`); with ``"fast": true`` only where
its one run reads above its mbs neighbours by more than the noise (:meth:`Strategy.answer_stands_out`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

from zerotune.core.errors import TuningFailed
from zerotune.core.experiment import Experiment, ExperimentKind, Status
from zerotune.core.measure import Pooled, RunNoise, comparison_noise, pooled_metrics, run_noise
from zerotune.core.stopping import DEFAULT_PRECISION, must_beat
from zerotune.core.units import format_bytes
from zerotune.model.memory import MemoryModel
from zerotune.model.online import corrected
from zerotune.model.profile import ModelInfo
from zerotune.report.results import best_experiment
from zerotune.strategy.batch import doubling_gain_bound
from zerotune.strategy.configs import ConfigBuilder
from zerotune.strategy.job import Job
from zerotune.strategy.mbs import NEAR_CAPACITY, Point, within_noise
from zerotune.strategy.stages import StageDecision, StagePlan, StageResult, explore_stages
from zerotune.strategy.tuners import make_tuner

PLATEAU_THRESHOLD = 0.01
"""A step that improves the best metric by less than this fraction is a plateau (1%)."""

KNOB_STAGE_MARGIN = 0.05
"""A second stage's knobs are tuned too when its best metric is within this fraction of the best."""

FINAL_MARGIN = 0.05
"""Before the answer, configs within the noise of the best, and within this fraction of it, are re-measured."""

FINAL_CANDIDATES = 2
"""At most this many configs (the best included) are re-measured before the answer."""

Evaluate = Callable[[Sequence[Experiment]], Sequence[Experiment]]
"""Runs a batch of experiments (possibly at once) and returns them, in order, with their outcomes."""


@dataclass
class KnobPhase:
    """One stage's knob phase: where it ran and how large its space was."""

    stage: int
    mbs: int
    configs: int
    fitting: int


@dataclass
class StrategyResult:
    """What the strategy learnt.

    Attributes:
        model_info: the profile's measurements (None: unknown, e.g. a dry run without a profile).
        memory: the memory model built from it (None when the model size is unknown).
        stages: one :class:`StageResult` per candidate stage, ascending.
        knob_phases: the knob phases run (``"fast": false``).
        experiments: every distinct experiment evaluated, in the order asked, with its outcome.
        run_noise: the run-to-run noise estimated from the configs run more than once
            (:func:`~zerotune.core.measure.run_noise`), updated after every batch; every comparison of
            runs counts it.
    """

    model_info: ModelInfo | None = None
    memory: MemoryModel | None = None
    stages: list[StageResult] = field(default_factory=list)
    knob_phases: list[KnobPhase] = field(default_factory=list)
    experiments: list[Experiment] = field(default_factory=list)
    run_noise: RunNoise = field(default_factory=lambda: run_noise(()))


class Strategy:
    """Runs the tuning strategy of ``job`` against ``evaluate`` (see the module docstring).

    Args:
        job: the resolved job.
        evaluate: runs batches of experiments.
        parallel: experiments the slots can run at once (the knob phase's batch size).
        log: receives one line per decision (the memory model's verdicts, stage decisions).
    """

    def __init__(self, job: Job, evaluate: Evaluate, parallel: int = 1, log: Callable[[str], None] | None = None):
        self.job = job
        self.builder = ConfigBuilder(job)
        self._evaluate = evaluate
        self.parallel = max(1, parallel)
        self.log = log or (lambda line: None)
        self.result = StrategyResult()
        self.best_batch: dict[int, tuple[int, int]] = {}  # stage -> (mbs, gas) better than its mbs search's best
        self._done: dict[str, Experiment] = {}

    def run(self) -> StrategyResult:
        """Profile, explore the stages and mbs, then (``"fast": false``) tune the knobs.

        Raises:
            TuningFailed: the profile run failed (nothing can be estimated without it).
            ConfigError: a config the user's settings give is invalid.
        """
        self.profile()
        self.explore()
        self.tune_gas()
        if not self.job.autotuning.fast:
            self.tune_knobs()
        self.confirm_answer()
        if not self.job.autotuning.fast or self.answer_stands_out():
            self.measure_answer_twice()
        return self.result

    def answer_stands_out(self) -> bool:
        """Whether the answer, measured once, reads better than its mbs neighbours predict by more than the
        noise. The neighbours are two configs of the same stage, gas and knobs that ran ok, the nearest
        smaller and larger mbs (or, at an end of the curve, the two nearest on the side there is); the
        prediction is the straight line through their pooled metrics, at the answer's mbs. Its noise is
        :func:`~zerotune.core.measure.comparison_noise`'s terms (a run's interval, the run-to-run noise)
        of the answer and of each neighbour times its weight in the line (an extrapolation weighs them
        more than 1). Throughput is smooth and concave in mbs away from the memory boundary, so a read
        above the line is more likely the best of many noisy runs reading high (the winner's curse) than a
        peak; re-measuring it (:meth:`measure_answer_twice`) corrects both the answer and the figure
        reported for it. On the SIMULATED clusters (6 noise draws, benchmarks/README.md), at 5% noise the
        median error of the reported metric over the truth falls from +3.0% to +2.1% and its worst from
        +19.3% to +12.5%, for 3% more GPU-hours; at 1%, answers within 1% of the optimum go from 183 to 187
        of 216, for 2% more. False with fewer than two neighbours."""
        objective = self.job.objective
        pooled = pooled_metrics(self.result.experiments)
        answer = best_experiment(self.result.experiments, objective, self.job.capacity_bytes)
        if answer is None or pooled[answer.name].runs >= 2:
            return False
        same = [e for e in self.result.experiments
                if e.replica_of is None and e.name in pooled and e.kind is not ExperimentKind.PROFILE
                and (e.stage, e.gas, e.knobs) == (answer.stage, answer.gas, answer.knobs) and e.mbs != answer.mbs]
        below = sorted((e for e in same if e.mbs < answer.mbs), key=lambda e: -e.mbs)
        above = sorted((e for e in same if e.mbs > answer.mbs), key=lambda e: e.mbs)
        pair = below[:1] + above[:1] if below and above else (below or above)[:2]
        if len(pair) < 2:
            return False
        (a, va), (b, vb) = ((e, pooled[e.name].value) for e in pair)
        w = (answer.mbs - a.mbs) / (b.mbs - a.mbs)  # the line: (1 - w) * va + w * vb
        reference = (1 - w) * va + w * vb
        if reference <= 0:
            return False

        def term(hw: float | None, runs: int) -> float:
            return comparison_noise([hw], [runs], floor=PLATEAU_THRESHOLD, run_noise=self.result.run_noise.sigma) ** 2

        noise = math.sqrt(term(answer.metric_rel_half_width, 1) + (1 - w) ** 2 * term(a.metric_rel_half_width,
                          pooled[a.name].runs) + w ** 2 * term(b.metric_rel_half_width, pooled[b.name].runs))
        gain = objective.gain(pooled[answer.name].value, reference)
        if gain <= noise:
            return False
        self.log(f"the answer {answer.name} reads {gain:.1%} better than mbs {a.mbs} and {b.mbs} predict "
                 f"({reference:.4g} on the line through them), beyond the noise ({noise:.1%}): the best of many "
                 f"runs reads high, so it is measured again")
        return True

    def evaluate(self, experiments: Sequence[Experiment], race: bool = True,
                 bar: float | None = None) -> list[Experiment]:
        """Evaluate the experiments not evaluated before (by name); reuse the others' outcomes.

        With ``race`` each new experiment races the incumbent (``bar``, by default :meth:`bar`): a
        backend with a stop rule may end it once it cannot beat it. Re-measurements do not race: they
        are run for precision.
        """
        memory = self.result.memory
        bar = (bar if bar is not None else self.bar()) if race else None
        todo: dict[str, Experiment] = {}
        for exp in experiments:
            if exp.name not in self._done and exp.name not in todo:
                if memory is not None:
                    exp.memory_bytes = memory.bytes_per_device(exp.ds_config)
                if exp.kind is not ExperimentKind.PROFILE:
                    exp.must_beat = bar
                    if exp.memory_bytes is not None and exp.memory_bytes > self.job.device_memory_bytes:
                        self._not_launched(exp)  # the online-corrected model knows it runs out of memory
                        continue
                todo[exp.name] = exp
        for exp in self._evaluate(list(todo.values())) if todo else []:
            self._done[exp.name] = exp
            self.result.experiments.append(exp)
            self.correct_memory(exp)
        if todo:
            self.update_run_noise()
        return [self._done[e.name] for e in experiments]

    def update_run_noise(self) -> None:
        """Re-estimate the run-to-run noise from the runs so far (:attr:`StrategyResult.run_noise`); log a change."""
        before, now = self.result.run_noise, run_noise(self.result.experiments)
        self.result.run_noise = now
        if now.df != before.df and round(now.sigma, 3) != round(before.sigma, 3):
            self.log(now.describe())

    def _not_launched(self, exp: Experiment) -> None:
        """Record ``exp`` as out of memory without launching it: its estimate, from the memory model as
        corrected by the runs so far (:meth:`correct_memory`), is over the per-device budget. A stage's
        largest mbs is planned from the profile run before any of its runs; a later run that measures
        more (a steeper activation slope, a stage's own overhead) would otherwise see the plan launched
        into an OOM it already predicts."""
        exp.status, exp.metric = Status.OOM, None
        exp.error = (f"memory model: {format_bytes(exp.memory_bytes)} per rank estimated, over the "
                     f"{format_bytes(self.job.device_memory_bytes)} budget: not launched")
        self.log(f"{exp.name}: {exp.error}")
        self._done[exp.name] = exp
        self.result.experiments.append(exp)

    def correct_memory(self, exp: Experiment) -> None:
        """Online correction of the memory model from a finished experiment (the activation slope
        between two runs of a config, and the stage's overhead after an OOM under a fitting estimate
        or a peak above it: :func:`zerotune.model.online.corrected`), so a near-boundary estimate is
        not repeated."""
        if self.result.memory is not None:
            earlier = [e for e in self.result.experiments if e is not exp]
            self.result.memory, why = corrected(self.result.memory, exp, self.job.device_memory_bytes, earlier)
            if why:
                self.log(why)

    @property
    def precision(self) -> float:
        """The target precision of a run's metric (relative 95% half-width): ``--precision``, which
        also ends runs early when they are adaptive; :data:`DEFAULT_PRECISION` with ``--no-adaptive``."""
        return self.job.stop_rule.precision if self.job.stop_rule is not None else DEFAULT_PRECISION

    def bar(self) -> float | None:
        """The bar a new experiment must beat (:func:`zerotune.core.stopping.must_beat`): the pessimistic
        bound of the best pooled metric so far, with its run's interval half-width (pooled runs, or a
        run without an interval: :data:`PLATEAU_THRESHOLD`); None before any experiment ran ok."""
        objective = self.job.objective
        pooled = pooled_metrics(self.result.experiments)
        best = objective.best(pooled, lambda name: pooled[name].value)
        if best is None:
            return None
        hw = self._done[best].metric_rel_half_width if pooled[best].runs == 1 else None
        return must_beat(objective, pooled[best].value, hw or PLATEAU_THRESHOLD, runs=pooled[best].runs,
                         run_noise=self.result.run_noise.sigma)

    def known_to_precision(self, exp: Experiment) -> bool:
        """Whether one run tells ``exp``'s metric to the target precision (:attr:`precision`): its
        interval is that narrow, and the run-to-run noise it cannot show (``2 * sigma`` at 95%,
        :attr:`StrategyResult.run_noise`) is no wider."""
        return (exp.metric_rel_half_width is not None and exp.metric_rel_half_width <= self.precision
                and 2 * self.result.run_noise.sigma <= self.precision * (1 + 1e-9))

    # -- re-measurements ----------------------------------------------------------------------------
    def runs_of(self, name: str) -> list[Experiment]:
        """The experiment ``name`` and its replicas, in the order they ran."""
        return [e for e in self.result.experiments if e.name == name or e.replica_of == name]

    def pooled(self, name: str) -> Pooled | None:
        """The metric of experiment ``name`` pooled over its ok runs (None: none ran ok)."""
        return pooled_metrics(self.result.experiments).get(name)

    def remeasure(self, experiments: Sequence[Experiment]) -> list[Pooled | None]:
        """Run each experiment once more (replicas ``<name>_r<k>``, one batch, so they interleave with
        each other) and return each one's pooled metric."""
        replicas = []
        for base in experiments:
            replica = self.builder.experiment(base.ds_config, base.kind, base.knobs)
            replica.name, replica.replica_of = f"{base.name}_r{len(self.runs_of(base.name)) + 1}", base.name
            replicas.append(replica)
        self.evaluate(replicas, race=False)
        return [self.pooled(base.name) for base in experiments]

    def confirm_answer(self) -> None:
        """Re-measure the configs whose difference from the best is within their noise (their
        :func:`~zerotune.core.measure.comparison_noise`, at most :data:`FINAL_MARGIN`; at most
        :data:`FINAL_CANDIDATES`) until each has two ok runs, so the answer is not one lucky sample,
        when one of them is not known to the target precision (its run ended without reaching
        ``--precision``, or gave no interval). A finalist the readings and the curve both put below the best
        (:meth:`below_on_the_curve`) is left out. Finalists that are each known to ±precision and tie
        within the run-to-run noise differ by about the precision the answer is promised to: a
        second run of each would cost two launches to move the answer by no more than that."""
        objective = self.job.objective
        pooled = pooled_metrics(self.result.experiments)  # once: each lookup would walk every experiment
        bases = [e for e in self.result.experiments if e.replica_of is None and e.name in pooled]
        bases.sort(key=lambda e: pooled[e.name].value, reverse=objective.higher_is_better)
        if not bases:
            return
        top = bases[0]

        def within_noise_of_top(e: Experiment) -> bool:
            gain = objective.gain(pooled[e.name].value, pooled[top.name].value)
            noise = comparison_noise([e.metric_rel_half_width, top.metric_rel_half_width],
                                     [pooled[e.name].runs, pooled[top.name].runs], floor=PLATEAU_THRESHOLD,
                                     run_noise=self.result.run_noise.sigma)
            return abs(gain) <= min(noise, FINAL_MARGIN)

        close = [e for e in bases[:FINAL_CANDIDATES] if within_noise_of_top(e) and not self.below_on_the_curve(e, top)]
        todo = [e for e in close if pooled[e.name].runs < 2]
        imprecise = [e for e in close if pooled[e.name].runs < 2 and not self.known_to_precision(e)]
        if len(close) > 1 and todo and imprecise:
            self.log(f"re-measuring {len(todo)} config(s) within the noise of the best before the answer: "
                     + ", ".join(e.name for e in todo))
            self.remeasure(todo)

    def below_on_the_curve(self, e: Experiment, top: Experiment) -> bool:
        """Whether ``e`` is ``top``'s config (stage, gas, knobs) at a smaller mbs, both run away from the device's
        capacity (measured peaks under :data:`~zerotune.strategy.mbs.NEAR_CAPACITY` of the budget): there a step's
        fixed work is amortized over more samples at the larger mbs, so throughput rises with mbs, and the
        readings, which put ``top`` first, agree with it; re-measuring ``e`` could only move the answer against
        both. False on CPU ranks (no :meth:`memory_fraction`) and for latency. On the
        SIMULATED clusters (6 noise draws, 5% noise) leaving such finalists out of :meth:`confirm_answer` cut the
        GPU-hours from 0.72x to 0.69x DeepSpeed's, with 152 answers within 1% of the optimum against 151 and the
        same worst case (benchmarks/README.md, session 14); at 1% noise nothing moved."""
        if not self.job.objective.higher_is_better:
            return False
        fractions = [self.memory_fraction(x) for x in (e, top)]
        return ((e.stage, e.gas, e.knobs) == (top.stage, top.gas, top.knobs) and e.mbs < top.mbs
                and all(f is not None and f < NEAR_CAPACITY for f in fractions))

    def memory_fraction(self, exp: Experiment) -> float | None:
        """``exp``'s measured peak over the per-device budget (where it ran against the device's capacity); None
        without a measured peak or budget, and on CPU ranks: a CPU's caches can make a smaller micro-batch faster
        far from any memory limit (on this project's machine, with 23.5 GiB per rank, ZeRO-0 read 36.7 samples/s
        at mbs 32 and 40.2 at 16: benchmarks/README.md, session 13), so no rule that reads capacity applies there."""
        budget = self.job.capacity_bytes
        if not exp.peak_memory_bytes or not budget:
            return None
        return exp.peak_memory_bytes / budget

    def measure_answer_twice(self) -> None:
        """``"fast": false`` (and ``"fast": true`` where :meth:`answer_stands_out`): the answer is reported
        on at least two runs. One run's interval sees only the
        jitter of its own steps, not the run-to-run noise, and the answer is the run that read highest
        among many (the winner's curse): on a 2-core CPU machine one answer's single run read 9.9% over
        its re-measure (benchmarks/README.md, 2026-11-25). The answer, while it has one ok run, is re-measured;
        where the pooled metric then puts another one-run config first, that one is re-measured too (at
        most :data:`FINAL_CANDIDATES` configs)."""
        for _ in range(FINAL_CANDIDATES):
            answer = best_experiment(self.result.experiments, self.job.objective, self.job.capacity_bytes)
            if answer is None or self.pooled(answer.name).runs >= 2:
                return
            self.log(f"re-measuring the answer {answer.name}: one run does not show the run-to-run noise")
            self.remeasure([answer])

    # -- 1. profile ---------------------------------------------------------------------------------
    def profile(self) -> None:
        (exp,) = self.evaluate([self.builder.profile()])
        if exp.status != Status.OK:
            raise TuningFailed(f"the profile run failed ({exp.status.value if exp.status else '?'}: {exp.error}); "
                               f"see {self.job.exps_dir / exp.name}")
        if not exp.metrics:
            self.log("profile: model size unknown, so the memory model prunes nothing")
            return
        info = self.result.model_info = ModelInfo.from_metrics(exp.metrics, exp.peak_memory_bytes, mbs=exp.mbs)
        memory = MemoryModel(info.num_params, info.activation_mem_per_gpu, self.job.dp_world_size, self.job.mp_size,
                             trainable_params=info.trainable_num_params,
                             largest_layer_params=info.largest_layer_params, persistent_params=info.persistent_params,
                             host_on_device=self.job.cpu)
        if info.peak_memory_bytes:  # CPU: the backend's sampled peak; CUDA: the probe's device peak
            memory = memory.calibrated(exp.ds_config, info.peak_memory_bytes, mbs=self.job.min_mbs)
        self.result.memory = memory
        self.log(f"profile: {info.num_params:,} parameters, activations {format_bytes(info.activation_mem_per_gpu)} "
                 f"per sample, per-rank overhead {format_bytes(memory.overhead_bytes)}, budget "
                 f"{format_bytes(self.job.device_memory_bytes)} per rank")

    # -- 2. stages and micro batch sizes ------------------------------------------------------------
    def max_mbs_estimate(self, stage: int) -> int:
        """The memory model's largest mbs for ``stage`` within the budget (at most the job's largest
        mbs; below the smallest when the stage does not fit; the largest when the model is unknown)."""
        lo, hi = self.job.min_mbs, self.job.max_mbs
        if self.result.memory is None:
            return hi
        if not self.host_fits(self.builder.config(stage, lo)):
            return lo - 1
        return self.result.memory.max_mbs(self.builder.config(stage, lo), self.job.device_memory_bytes, cap=hi)

    def host_fits(self, ds_config: dict) -> bool:
        """Whether what ``ds_config`` offloads to the host fits each node's host memory
        (:meth:`zerotune.model.memory.MemoryModel.host_fits`; True when the model or the host memory is unknown)."""
        memory = self.result.memory
        return memory is None or memory.host_fits(ds_config, self.job.host_memory_bytes, self.job.slots_per_node)

    def explore(self) -> None:
        lo, hi = self.job.min_mbs, self.job.max_mbs
        plans = []
        for stage in self.job.stages:
            est = self.max_mbs_estimate(stage)
            plans.append(StagePlan(stage, est))
            if self.result.memory is not None:
                config = self.builder.config(stage, lo)
                needs = self.result.memory.breakdown(config)  # one breakdown: the device total and the host bytes
                why = (f"offload needs {format_bytes(needs.host * self.job.slots_per_node)} of host memory per node, "
                       f"the node has {format_bytes(self.job.host_memory_bytes or 0)}" if not self.host_fits(config)
                       else f"{format_bytes(needs.total)} per rank at mbs={lo}")
                self.log(f"memory model: ZeRO stage {stage}: " + (f"largest mbs estimated to fit {est}" if est >= lo else
                         f"does not fit ({why}): pruned"))

        def memory_terms(stage: int, exp: Experiment) -> dict:
            """A point's measured peak over the budget (:meth:`memory_fraction`), and the largest mbs the memory
            model (as corrected so far) puts under NEAR_CAPACITY of it: where the mbs search looks below a best
            near capacity. None of either on CPU ranks, where the search keeps its halving look below."""
            if self.job.cpu:
                return {}
            budget, memory = self.job.device_memory_bytes, self.result.memory
            calm = None if memory is None else memory.max_mbs(self.builder.config(stage, lo),
                                                              int(NEAR_CAPACITY * budget), cap=hi)
            return {"memory_fraction": self.memory_fraction(exp),
                    "calm_mbs": calm if calm is not None and calm >= lo else None}

        def evaluate(stage: int, mbs_values: Sequence[int]) -> list[Point]:
            done = self.evaluate([self.builder.mbs_experiment(stage, m) for m in mbs_values])
            sigma = self.result.run_noise.sigma
            return [Point(m, e.status, e.metric, rel_half_width=e.metric_rel_half_width, run_noise=sigma,
                          **memory_terms(stage, e)) for m, e in zip(mbs_values, done)]

        def confirm(stage: int, mbs_values: Sequence[int]) -> list[Point]:
            bases = self.evaluate([self.builder.mbs_experiment(stage, m) for m in mbs_values])
            pooled = self.remeasure(bases)
            sigma = self.result.run_noise.sigma
            return [Point(m, e.status, e.metric, run_noise=sigma, **memory_terms(stage, e)) if p is None
                    else Point(m, Status.OK, p.value, p.runs, run_noise=sigma, **memory_terms(stage, e))
                    for m, e, p in zip(mbs_values, bases, pooled)]

        self.result.stages = explore_stages(evaluate, plans, lo=lo, hi=hi, objective=self.job.objective,
                                            threshold=PLATEAU_THRESHOLD,
                                            num_fine=self.job.autotuning.num_tuning_micro_batch_sizes,
                                            allowed=self.job.allowed_mbs, confirm=confirm, precision=self.precision)
        for r in self.result.stages:
            self.log(f"ZeRO stage {r.stage}: {r.decision.value} ({r.reason})"
                     + (f", stopped: {r.trace.stop.value}" if r.trace.stop else ""))

    # -- 3. gas -------------------------------------------------------------------------------------
    def tune_gas(self) -> None:
        """Gas at the best stage's best mbs ``m`` (where the batch semantics search it): first ``m``'s
        global batch split in two (``m // 2`` at twice the gas, :meth:`BatchSemantics.gas_split`), then
        the config's list of gas values at ``m`` (each tried), or a doubling ladder within
        ``max_train_batch_size`` that stops at a plateau or a failure, or before a rung that cannot gain
        the plateau threshold (:meth:`gas_cannot_pay`; the split likewise, :meth:`split_cannot_pay`)."""
        tops = self.knob_stages()[:1]
        if not tops:
            return
        stage, point = tops[0]
        batch = self.job.batch
        split = batch.gas_split(point.mbs, lo=self.job.min_mbs)
        ladder = batch.gas_ladder(point.mbs)
        if split or ladder:
            self.log(f"gas phase ZeRO stage {stage} at mbs={point.mbs}: "
                     + "; ".join(([f"mbs {split[0]} at gas {split[1]} (the same global batch)"] if split else [])
                                 + ([f"gas {ladder}"] if ladder else [])))
        evidence = self.split_evidence(stage, split[0], point) if split else None
        if split and evidence is None:
            self.log(f"gas phase: mbs {split[0]} at gas {split[1]} not tried: no mbs from {split[0]} up to "
                     f"{point.mbs} measured within the noise of mbs {point.mbs} (the throughput still climbs there)")
            split = None
        if split and self.split_cannot_pay(stage, *split, evidence):
            split = None
        best = self._done[self.builder.mbs_experiment(stage, point.mbs).name]  # the mbs search's best config
        if split:
            best, _ = self.gas_candidate(stage, *split, best)
        for gas in ladder:
            base = self._done.get(self.builder.mbs_experiment(stage, point.mbs, gas // 2).name)
            if batch.gas_doubling and base is not None and self.gas_cannot_pay(base, gas):
                break
            best, gain = self.gas_candidate(stage, point.mbs, gas, best, larger_batch=True)
            if batch.gas_doubling and (gain is None or gain < PLATEAU_THRESHOLD):
                break

    def gas_cannot_pay(self, base: Experiment, gas: int) -> bool:
        """Whether the ladder's rung at ``gas`` is not worth a run, from ``base``, the same config at half
        that gas: where throughput is tuned and ``base``'s runs measured the share of their step spent
        once per optimizer step, the rung gains at most :func:`~zerotune.strategy.batch.doubling_gain_bound`
        over ``base`` (and less over a better best); under :data:`PLATEAU_THRESHOLD` it would end the
        ladder as a plateau even if it ran."""
        share = self.boundary_share(base)
        bound = self.doubling_bound_under_threshold(share, base)
        if bound is None:
            return False
        self.log(f"gas phase: gas {gas} not tried: {base.name} spends {share:.1%} of its step in the work done "
                 f"once per optimizer step (optimizer step, boundary gradient reduction), so doubling gas gains at "
                 f"most {bound:.2%}, under the {PLATEAU_THRESHOLD:.0%} plateau threshold")
        return True

    def split_cannot_pay(self, stage: int, half: int, gas: int, evidence: Point) -> bool:
        """Whether the split (``half`` at ``gas``, twice the search's gas) is not worth a run. It runs
        ``half``'s micro-batches, which the mbs search bounds by ``evidence`` (with throughput rising with
        mbs, :meth:`split_evidence`: no faster than the best), and gains over them at most what its doubled
        gas amortizes (:func:`~zerotune.strategy.batch.doubling_gain_bound`). The share at ``half`` is at
        most ``evidence``'s measured share times ``evidence.mbs / half`` (the once-per-step time is the
        same, and a micro-step's time falls no faster than its mbs). Under :data:`PLATEAU_THRESHOLD` the
        split can beat the best by no more than the noise, and a run would only add a chance of a lucky read."""
        base = self._done.get(self.builder.mbs_experiment(stage, evidence.mbs).name)
        share = self.boundary_share(base) if base is not None else None
        share = None if share is None else min(1.0, share * evidence.mbs / half)
        bound = self.doubling_bound_under_threshold(share, base)
        if bound is None:
            return False
        self.log(f"gas phase: mbs {half} at gas {gas} not tried: the mbs search measured mbs {evidence.mbs} no "
                 f"faster than the best, and twice the gas at mbs {half} gains at most {bound:.2%} (at most "
                 f"{share:.1%} of its step once per optimizer step), under the {PLATEAU_THRESHOLD:.0%} plateau "
                 f"threshold")
        return True

    def doubling_bound_under_threshold(self, share: float | None, base: Experiment | None) -> float | None:
        """:func:`~zerotune.strategy.batch.doubling_gain_bound` of ``share`` for ``base``'s config where
        throughput is tuned and the bound is under :data:`PLATEAU_THRESHOLD`; else None."""
        if base is None or not self.job.objective.higher_is_better:
            return None
        bound = doubling_gain_bound(share, base.ds_config)
        return bound if bound is not None and bound < PLATEAU_THRESHOLD else None

    def boundary_share(self, exp: Experiment) -> float | None:
        """The share of ``exp``'s step spent once per optimizer step (the probe's ``boundary_s``), the mean
        over its runs that measured it; None where none did."""
        shares = [e.boundary_share for e in self.runs_of(exp.name) if e.boundary_share is not None]
        return sum(shares) / len(shares) if shares else None

    def gas_candidate(self, stage: int, mbs: int, gas: int, best: Experiment,
                      larger_batch: bool = False) -> tuple[Experiment, float | None]:
        """Run ``mbs`` at ``gas`` for ``stage`` against the gas phase's ``best`` so far; (the better of the
        two, the candidate's gain over ``best`` on their pooled metrics; None: it did not run ok). A
        difference within the runs' noise (:func:`~zerotune.strategy.mbs.within_noise`) where a one-run
        side is not known to the target precision (:meth:`known_to_precision`) is not decided on that
        run: the one-run side(s) are re-measured and the pooled metrics decide (two runs each known to
        the precision that tie differ by about it, as in :meth:`confirm_answer`). With ``larger_batch``
        (a rung of the gas ladder: a larger global batch than ``best``'s, which changes the training
        itself) only a win is re-measured: a loss within the noise is no evidence for the larger batch,
        and the smaller one is kept without spending two runs on it; so the run races ``best``'s own
        metric, not its pessimistic bound: it ends as soon as its optimistic bound cannot beat that. A
        win is recorded in :attr:`best_batch`."""
        objective = self.job.objective
        bar = self.pooled(best.name).value if larger_batch else None
        (exp,) = self.evaluate([self.builder.mbs_experiment(stage, mbs, gas)], bar=bar)
        if exp.status != Status.OK or exp.metric is None:
            return best, None

        def compare() -> tuple[float, list[Experiment]]:
            pooled = pooled_metrics(self.result.experiments)
            a, b = pooled[exp.name], pooled[best.name]
            points = [Point(e.mbs, Status.OK, p.value, p.runs, e.metric_rel_half_width if p.runs == 1 else None,
                            run_noise=self.result.run_noise.sigma) for e, p in ((exp, a), (best, b))]
            gain = objective.gain(a.value, b.value)
            single = [e for e, p in ((exp, a), (best, b)) if p.runs < 2]
            imprecise = any(p.runs < 2 and not self.known_to_precision(e) for e, p in ((exp, a), (best, b)))
            return gain, single if imprecise and within_noise(gain, *points, PLATEAU_THRESHOLD) else []

        gain, single = compare()
        if single and not (larger_batch and gain <= 0):  # one run decides nothing within the noise
            self.remeasure(single)
            gain, _ = compare()
        if gain > 0:
            self.best_batch[stage] = (mbs, gas)
            return exp, gain
        return best, gain

    def split_evidence(self, stage: int, half: int, point: Point) -> Point | None:
        """The measured point that makes the split worth a run, or None. With throughput rising with mbs,
        a point measured in ``[half, point.mbs)`` bounds the throughput at ``half`` from above; where the
        smallest such point ties the best within the runs' noise (:func:`~zerotune.strategy.mbs.within_noise`),
        the larger micro-batch bought nothing measurable from ``half`` up, and the split may win (one
        optimizer step per two micro-batches; on a CPU, activations that stay in cache). Without one
        (the throughput still climbs, or nothing was measured there) the smaller micro-batch is the
        slower one, and the split is not tried."""
        trace = next(r.trace for r in self.result.stages if r.stage == stage)
        between = [p for p in trace.ok_points if half <= p.mbs < point.mbs]
        bound = min(between, key=lambda p: p.mbs, default=None)
        if bound is not None and (not self.job.objective.better(point.metric, bound.metric) or within_noise(
                self.job.objective.gain(bound.metric, point.metric), bound, point, PLATEAU_THRESHOLD)):
            return bound
        return None

    # -- 4. knobs -----------------------------------------------------------------------------------
    def knob_stages(self) -> list[tuple[int, Point]]:
        """Stages whose knobs are tuned, with their best point: the best explored stage, and the
        next best when within :data:`KNOB_STAGE_MARGIN` of it."""
        objective = self.job.objective
        tops = [(r.stage, r.trace.best(objective)) for r in self.result.stages if r.decision is StageDecision.EXPLORED]
        tops = [(s, p) for s, p in tops if p is not None]
        if not tops:
            return []
        tops.sort(key=lambda sp: sp[1].metric, reverse=objective.higher_is_better)
        best = tops[0][1].metric
        return [tops[0]] + [(s, p) for s, p in tops[1:2] if abs(objective.gain(p.metric, best)) <= KNOB_STAGE_MARGIN]

    def tune_knobs(self) -> None:
        at, memory = self.job.autotuning, self.result.memory
        fits = None if memory is None else (lambda c: memory.fits(c, self.job.device_memory_bytes)
                                            and self.host_fits(c))
        for stage, point in self.knob_stages():
            mbs, gas = self.best_batch.get(stage, (point.mbs, None))
            candidates = self.builder.knob_space(stage, mbs, fits, gas=gas)
            fitting = sum(c.fits for c in candidates)
            self.result.knob_phases.append(KnobPhase(stage, mbs, len(candidates), fitting))
            self.log(f"knob phase ZeRO stage {stage} at mbs={mbs}" + (f", gas={gas}" if gas else "")
                     + f": {len(candidates)} configs, {fitting} fit the "
                     f"memory model; tuner {at.tuner_type}, at most {at.tuner_num_trials} trials")
            tuner = make_tuner(at.tuner_type, candidates, objective=self.job.objective, num_trials=at.tuner_num_trials,
                               early_stopping=at.tuner_early_stopping)
            for c in candidates:  # configs that already ran (the mbs phase's own config): told, not run again
                if c.name in self._done:
                    done = self._done[c.name]
                    tuner.tell(c.name, done.status, done.metric)
            while batch := tuner.ask(self.parallel):
                exps = [self.builder.experiment(c.ds_config, ExperimentKind.KNOBS, knobs=c.knobs) for c in batch]
                for c, exp in zip(batch, self.evaluate(exps)):
                    tuner.tell(c.name, exp.status, exp.metric)
