"""Online correction: the memory model learns from each finished experiment (issue 10, part 6).

The profile run calibrates the fixed per-rank overhead once (:meth:`MemoryModel.calibrated`). Every
experiment after it is a second measurement of the same model: where it shows the estimate too
optimistic, the overhead is raised so that the same mistake is not made twice near the boundary:

- **OOM although the estimate fit** (``estimate <= budget``): the config's estimate becomes just
  over the budget (the overhead rises by ``budget + 1 - estimate``), so it and every config the model
  puts at least as high are predicted not to fit.
- **A measured peak above the estimate** (an OK run): the overhead rises by the shortfall, so the
  estimate of that config equals what it used.

The overhead is never lowered: a peak below the estimate may be a measurement that does not see
everything the budget counts (on CPU the probe's resident high-water mark leaves out allocated pages
never written, such as most of a large reduce bucket, while ``RLIMIT_DATA`` counts them). Pure
function of the model and the experiment; the strategy calls it after each batch
(:meth:`zerotune.strategy.tuning.Strategy.evaluate`).
"""
from __future__ import annotations

import dataclasses

from zerotune.core.experiment import Experiment, Status
from zerotune.core.units import format_bytes
from zerotune.model.memory import MemoryModel


def corrected(memory: MemoryModel, exp: Experiment, budget_bytes: int) -> tuple[MemoryModel, str | None]:
    """The memory model after ``exp``'s outcome, and a line for the log saying why it changed (None: unchanged).

    Args:
        memory: the current model.
        exp: a finished experiment (its ``ds_config``, ``status`` and ``peak_memory_bytes``); the
            profile run and experiments without a ZeRO config are ignored.
        budget_bytes: the per-device budget the run was held to.
    """
    if exp.kind.value == "profile" or not isinstance(exp.ds_config.get("train_micro_batch_size_per_gpu"), int):
        return memory, None
    estimate = memory.bytes_per_device(exp.ds_config)
    if exp.status is Status.OOM and estimate <= budget_bytes:
        raise_by = budget_bytes + 1 - estimate
        why = (f"{exp.name} ran out of memory at an estimate of {format_bytes(estimate)} "
               f"(budget {format_bytes(budget_bytes)})")
    elif exp.status is Status.OK and exp.peak_memory_bytes and exp.peak_memory_bytes > estimate:
        raise_by = exp.peak_memory_bytes - estimate
        why = f"{exp.name} peaked at {format_bytes(exp.peak_memory_bytes)}, estimated {format_bytes(estimate)}"
    else:
        return memory, None
    new = dataclasses.replace(memory, overhead_bytes=memory.overhead_bytes + raise_by)
    return new, f"memory model corrected: {why}; per-rank overhead {format_bytes(new.overhead_bytes)} (+{format_bytes(raise_by)})"
