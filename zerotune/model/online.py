"""Online correction: the memory model learns from each finished experiment.

The profile run calibrates the fixed per-rank overhead once (:meth:`MemoryModel.calibrated`). Every
experiment after it is another measurement of the same model, used two ways:

- **The activation slope.** DeepSpeed's profile measures activations as the change in memory across
  the first forward pass; on CPU that change also holds one-off allocations (ZeRO-3 gathering the
  parameters for the first time, the allocator growing its heap), several times the real slope on
  the benchmark's models. Two finished runs of the same config at different mbs measure the slope
  itself: ``(peak_b - peak_a) / (mbs_b - mbs_a)`` (the widest such pair). It replaces the profile's
  activation term, then the largest slope measured so far is kept (stages and precisions differ a
  little, and the step's high-water marks are noisy), and the overhead is recalibrated on the
  profile's peak (:meth:`MemoryModel.with_activations`).
- **A CUDA run's own slope.** On CUDA the probe notes the allocated bytes before each step's first
  forward, so one run measures what its step adds per sample, ``(peak - base) / mbs``
  (``Experiment.activation_slope_bytes``, :func:`zerotune.core.measure.activation_slope_bytes`). Where
  a run has it, it replaces the activation term when the term is below it (so the term is the largest
  measured so far) and the two-run slope is not used; CPU ranks record no base, and keep the two-run
  slope. It holds the step's constants over mbs too, so it errs high, never into an OOM.
- **Activation checkpointing.** A run measures the term of its own choice
  (:meth:`MemoryModel.activation_bytes`: with checkpointing, the checkpointed term where the model has one);
  :meth:`MemoryModel.with_activations` sets that term and scales the other by the same ratio, measured over
  modelled, so that the two stay in the profile's proportion.
- **The stage's own overhead**, only ever raised: after an OOM although the estimate fit
  (``estimate <= budget``), the stage's estimate becomes just over the budget (its overhead rises by
  ``budget + 1 - estimate``); after an OK run whose peak is above the estimate, it rises by the
  shortfall. Per stage, since what the structural terms miss (communication buffers, allocator
  slack) differs by stage; but a stage with no run of its own yet gets the same raise: what one stage
  missed (the allocator's fragmentation, the CUDA context, an activation undercount) the others
  likely miss too, and its first run would otherwise be launched into the same out-of-memory error
  (docs/decisions.md, D108).

A peak below the estimate never lowers an overhead: it may be a measurement that does not see
everything the budget counts (on CPU the probe samples ``VmData`` every 5 ms and can miss a shorter
peak; on CUDA the memory outside the caching allocator, the context and NCCL's buffers, is read once per
step, not at the peak). Pure
functions of the model and the experiments; the strategy calls :func:`corrected` after each finished
experiment (:class:`zerotune.strategy.evaluation.Evaluator`).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from zerotune.core.experiment import Experiment, ExperimentKind, Status
from zerotune.core.units import format_bytes
from zerotune.model.memory import MemoryModel

_BATCH_KEYS = ("train_micro_batch_size_per_gpu", "train_batch_size", "gradient_accumulation_steps")


def _measured(exp: Experiment) -> bool:
    return (exp.kind is not ExperimentKind.PROFILE and exp.status is Status.OK and bool(exp.peak_memory_bytes)
            and isinstance(exp.ds_config.get("train_micro_batch_size_per_gpu"), int))


def _same_config(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Equal apart from the batch keys (mbs, train batch size, gas)."""
    return {k: v for k, v in a.items() if k not in _BATCH_KEYS} == {k: v for k, v in b.items() if k not in _BATCH_KEYS}


def activation_slope(exp: Experiment, earlier: Sequence[Experiment]) -> int | None:
    """Bytes per sample from ``exp`` and the earlier run of the same config (but mbs) farthest from it in
    mbs, both OK with a measured peak; None without such a pair or when the peaks do not grow."""
    if not _measured(exp):
        return None
    pairs = [e for e in earlier if _measured(e) and e.mbs != exp.mbs and _same_config(e.ds_config, exp.ds_config)]
    if not pairs:
        return None
    other = max(pairs, key=lambda e: abs(e.mbs - exp.mbs))
    slope = (exp.peak_memory_bytes - other.peak_memory_bytes) / (exp.mbs - other.mbs)
    return int(slope) if slope > 0 else None


def _slope(memory: MemoryModel, exp: Experiment, earlier: Sequence[Experiment]) -> tuple[int | None, str]:
    """The activation term ``exp`` teaches (None: none) and how it was measured (module docstring)."""
    own = exp.activation_slope_bytes if _measured(exp) else None
    term = memory.activation_bytes(exp.ds_config)  # the term of the run's own choice of checkpointing
    if isinstance(own, int) and not isinstance(own, bool) and own > 0:
        return (own if own > term else None), f"measured by {exp.name}'s own step"
    slope = activation_slope(exp, earlier)
    if slope is not None and memory.activations_measured:
        slope = max(slope, term)  # the largest slope measured so far
    return slope, f"measured between mbs {exp.mbs} and an earlier run"


def corrected(memory: MemoryModel, exp: Experiment, budget_bytes: int,
              earlier: Sequence[Experiment] = ()) -> tuple[MemoryModel, str | None]:
    """The memory model after ``exp``'s outcome, and a line for the log saying what changed (None: nothing).

    Args:
        memory: the current model.
        exp: a finished experiment (its ``ds_config``, ``status`` and ``peak_memory_bytes``); the
            profile run is the calibration itself and is ignored.
        budget_bytes: the per-device budget the run was held to.
        earlier: the experiments finished before it (for the activation slope).
    """
    if exp.kind is ExperimentKind.PROFILE or not isinstance(exp.ds_config.get("train_micro_batch_size_per_gpu"), int):
        return memory, None
    notes = []
    slope, how = _slope(memory, exp, earlier)
    term = memory.activation_bytes(exp.ds_config)
    if slope is not None and slope != term:
        what = "checkpointed activations" if memory.checkpointed(exp.ds_config) else "activations"
        notes.append(f"{what} {format_bytes(slope)} per sample (was {format_bytes(term)}, {how})")
        memory = memory.with_activations(slope, exp.ds_config)
    stage = min(max(exp.stage, 0), 3)
    estimate = memory.bytes_per_device(exp.ds_config)
    raise_by = 0
    if exp.status is Status.OOM and estimate <= budget_bytes:
        raise_by = budget_bytes + 1 - estimate
        notes.append(f"{exp.name} ran out of memory at an estimate of {format_bytes(estimate)} "
                     f"(budget {format_bytes(budget_bytes)})")
    elif _measured(exp) and exp.peak_memory_bytes > estimate:
        raise_by = exp.peak_memory_bytes - estimate
        notes.append(f"{exp.name} peaked at {format_bytes(exp.peak_memory_bytes)}, estimated {format_bytes(estimate)}")
    if raise_by:
        extra = list(memory.stage_overhead_bytes)
        extra[stage] += raise_by
        ran = {min(max(e.stage, 0), 3) for e in earlier
               if e.kind is not ExperimentKind.PROFILE and e.status in (Status.OK, Status.OOM)}
        for other in sorted(set(range(4)) - ran - {stage}):  # what one stage missed, the others likely miss too
            extra[other] += raise_by
        memory = dataclasses.replace(memory, stage_overhead_bytes=tuple(extra))
        notes.append(f"ZeRO stage {stage} overhead +{format_bytes(raise_by)}")
    return memory, ("memory model corrected: " + "; ".join(notes)) if notes else None
