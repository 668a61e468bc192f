"""zerotune: find the fastest DeepSpeed configuration for a model and cluster.

The public API is `__all__`; everything else is internal and may change.

- **Tune**: `Autotuner` (shaped like DeepSpeed's own: ``tune()``, ``print_tuning_results()``,
  ``write_optimal_config()``, ``run_after_tuning()``; ``plan()`` is the dry run) with `TuneOptions`;
  it raises `ConfigError` on bad input, `TuningFailed` when nothing ran ok, and
  `Interrupted` on a stop signal.
- **Estimate**: `MemoryModel`, the bytes per device of a ds_config (``bytes_per_device``,
  ``breakdown``, ``max_mbs``), what ``zerotune estimate`` prints.
- **Read results**: `StrategyResult` (``Autotuner.result``: each ZeRO stage's decision, the ledger of
  experiments, the answer), whose records are `Experiment` with a `Status`; on disk each
  experiment's ``exp.json`` is ``Experiment.to_json()``.

The packages follow the data flow (docs/how-it-works.md): ``core`` is the ground floor, ``probe`` and
``deepspeed`` stand on it; ``strategy`` turns a job into experiments using ``model``; ``run`` schedules and runs
them; ``report`` writes the answer; ``autotuner`` wires them, ``cli`` is the launcher-style command line. Each
imports only the layers below it: core < probe < deepspeed < model < run < strategy < report < autotuner < cli.
Names are imported on first use, so ``import zerotune`` stays light (the probe runs inside every training rank).
"""
from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_PUBLIC = {
    "Autotuner": "zerotune.autotuner",
    "Interrupted": "zerotune.autotuner",
    "TuneOptions": "zerotune.strategy.job",
    "ConfigError": "zerotune.core.errors",
    "TuningFailed": "zerotune.core.errors",
    "MemoryModel": "zerotune.model.memory",
    "StrategyResult": "zerotune.strategy.result",
    "Experiment": "zerotune.core.experiment",
    "ExperimentKind": "zerotune.core.experiment",
    "Status": "zerotune.core.experiment",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'zerotune' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
