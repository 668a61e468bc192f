"""The memory-model oracle: ``evaluate`` for ``zerotune tune --dry-run``, launching nothing.

The dry run runs the real `zerotune.strategy.tuning.Strategy` with `MemoryOracle` in place of the scheduler, so it
lists exactly the experiments the strategy would try if the memory model were right. The profile run is answered from
a finished profile on disk (its peak calibrates the memory model), else ``autotuning.model_info``, else every config
fits. Any other experiment is OOM where the memory model's bytes per device exceed the budget, else OK with an ASSUMED
metric: a throughput proportional to ``mbs * gas * DP world size``, or a constant latency. So the mbs search climbs to
the memory boundary, and the knob phase stops after ``tuner_early_stopping`` configs that tie.
"""
from __future__ import annotations

from typing import Callable, Sequence

from zerotune.core.experiment import Experiment, ExperimentKind, Status
from zerotune.inputs.job import Job

PROFILE_ON_DISK = "profile run on disk"
GIVEN_MODEL_INFO = "autotuning.model_info"


class MemoryOracle:
    """An ``evaluate`` callable that answers from the memory model. ``load(exp)``: a finished result on disk for
    ``exp`` or None (the scheduler's resume lookup), only read. ``model_info_source``: where the model size came from
    (`PROFILE_ON_DISK`, `GIVEN_MODEL_INFO`; None: unknown), set when the profile is evaluated."""

    def __init__(self, job: Job, load: Callable[[Experiment], Experiment | None]):
        self.job = job
        self._load = load
        self.model_info_source: str | None = None

    def __call__(self, experiments: Sequence[Experiment]) -> list[Experiment]:
        return [self._profile(e) if e.kind is ExperimentKind.PROFILE else self._judge(e) for e in experiments]

    def _profile(self, exp: Experiment) -> Experiment:
        done = self._load(exp)
        if done is not None and done.status == Status.OK and "num_params" in done.metrics:
            self.model_info_source = PROFILE_ON_DISK
            return done
        exp.status, exp.metrics = Status.OK, {}
        if self.job.model_info is not None:
            self.model_info_source = GIVEN_MODEL_INFO
            exp.metrics = self.job.model_info.to_metrics(exp.mbs)
        return exp

    def _judge(self, exp: Experiment) -> Experiment:
        if exp.memory_bytes is not None and exp.memory_bytes > self.job.device_memory_bytes:
            exp.status, exp.metric = Status.OOM, None
            exp.error = "memory model: over the per-device budget (dry run, not launched)"
            return exp
        exp.status = Status.OK
        exp.metric = (float(exp.mbs * exp.gas * self.job.dp_world_size) if self.job.objective.higher_is_better
                      else 1.0)
        return exp
