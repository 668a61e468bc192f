"""Tuners: which candidate of a tuning space to try next, named as DeepSpeed's ``autotuning.tuner_type``:
"gridsearch", "random", "model_based". A tuner only proposes (``ask``) and learns (``tell``); it runs nothing.
"""
from __future__ import annotations

from typing import Any, Iterable

from zerotune.core.errors import ConfigError
from zerotune.inputs.space import Candidate
from zerotune.strategy.tuners.base import BaseTuner, GridSearchTuner, RandomTuner

TUNER_TYPES = ("gridsearch", "random", "model_based")

__all__ = ["BaseTuner", "GridSearchTuner", "ModelBasedTuner", "RandomTuner", "TUNER_TYPES", "make_tuner"]


def make_tuner(tuner_type: str, candidates: Iterable[Candidate], **kwargs: Any) -> BaseTuner:
    """Build the tuner DeepSpeed's ``autotuning.tuner_type`` names ("gridsearch", "random" or "model_based").

    ``kwargs``: ``objective``, ``num_trials``, ``early_stopping``, ``seed`` (`BaseTuner`), and for "model_based"
    ``n_startup_trials``, ``multivariate``. Raises `ConfigError` for another ``tuner_type``.
    """
    if tuner_type == "gridsearch":
        return GridSearchTuner(candidates, **kwargs)
    if tuner_type == "random":
        return RandomTuner(candidates, **kwargs)
    if tuner_type == "model_based":
        from zerotune.strategy.tuners.model_based import ModelBasedTuner  # imports optuna

        return ModelBasedTuner(candidates, **kwargs)
    raise ConfigError(f"autotuning.tuner_type = {tuner_type!r}: expected one of {', '.join(TUNER_TYPES)}")


def __getattr__(name: str) -> Any:  # lazy: importing optuna costs ~1 s
    if name == "ModelBasedTuner":
        from zerotune.strategy.tuners.model_based import ModelBasedTuner

        return ModelBasedTuner
    raise AttributeError(name)
