"""zerotune: find the fastest DeepSpeed configuration for a model and cluster.

The public API is `__all__`; everything else is internal and may change. Tune with `Autotuner` (DeepSpeed's shape:
``tune()``, ``print_tuning_results()``, ``write_optimal_config()``, ``run_after_tuning()``; ``plan()`` is the dry run)
and `TuneOptions`: it raises `ConfigError` on bad input, `TuningFailed` when nothing ran ok, `Interrupted` on a stop
signal. Estimate with `MemoryModel`. Read results from `StrategyResult` (``Autotuner.result``), whose records are
`Experiment` with a `Status` (each ``exp.json`` is ``Experiment.to_json()``). Each package imports only the layers
below it: core < probe < deepspeed < model < run < strategy < report < autotuner < cli (docs/how-it-works.md).
Names are imported on first use, so ``import zerotune`` stays light (the probe runs inside every training rank).
"""
from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_PUBLIC = {
    "Autotuner": "zerotune.autotuner",
    "Interrupted": "zerotune.autotuner",
    "TuneOptions": "zerotune.inputs.job",
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
