"""Model-based search: an Optuna sampler (a Gaussian process by default, or TPE) over a space's knobs, via ask/tell."""
from __future__ import annotations

import json
import warnings
from typing import Any, Iterable

import optuna
from optuna.distributions import BaseDistribution, CategoricalDistribution, IntDistribution
from optuna.trial import Trial, TrialState, create_trial

from zerotune.core.errors import ConfigError
from zerotune.core.experiment import Status
from zerotune.deepspeed.canonical import canonical_json
from zerotune.inputs.space import Candidate
from zerotune.strategy.tuners.base import BaseTuner

_ABSENT = "<absent>"  # categorical choice for a knob a candidate does not set
_INFEASIBLE = "zerotune_infeasible"  # Optuna constraint key: > 0 means infeasible


class ModelBasedTuner(BaseTuner):
    """A surrogate model of the metric over the space's knobs, through Optuna's ask/tell; nothing is run here (D1).

    The default surrogate is a Gaussian process (``optuna.samplers.GPSampler``: Matern kernel, log expected
    improvement, fantasized outcomes for experiments still running); ``sampler="tpe"`` uses
    ``optuna.samplers.TPESampler`` (multivariate, constant liar). Each knob that varies in the space is one
    parameter: a numeric one ordinal (``IntDistribution`` over the sorted values' index, so 5e8 lies between 5e7 and
    1e9), the others categorical (canonical JSON text).

    Outcomes told to Optuna: OK, the metric with constraint ``zerotune_infeasible = 0``; OOM, FAILED and TIMEOUT,
    ``zerotune_infeasible = 1`` and state PRUNED with no value (never a metric of 0: TPE ranks them after every
    feasible point, the GP models feasible points only); INTERRUPTED, state FAIL (ignored): it may come again.

    A sample already proposed, outside the space or unfit maps to the nearest untried fitting candidate (sum over
    knobs of |index difference| / (values - 1) for ordinal ones, 0 or 1 for categorical; ties to the earlier one): its
    trial is told FAIL and the candidate's parameters are enqueued as the trial told the real outcome. So every
    ``ask`` yields new experiments while any are left, deterministically for a seed and sequence of outcomes.

    Args:
        sampler: ``"gp"`` (default) or ``"tpe"``.
        n_startup_trials: random proposals before the surrogate models the outcomes (default 6: on
            ``benchmarks/tuner_quality.py``'s space the GP is flat from 4 to 8, and TPE needs about 1.5 experiments
            fewer than with Optuna's 10).
        multivariate: TPE only: model the knobs jointly rather than each on its own.
        Others: as in `BaseTuner`.

    Raises:
        ConfigError: an unknown ``sampler``.
    """

    def __init__(
        self,
        candidates: Iterable[Candidate],
        *,
        sampler: str = "gp",
        n_startup_trials: int = 6,
        multivariate: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(candidates, **kwargs)
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self.n_startup_trials = n_startup_trials
        self._dims = _dimensions(self.candidates)
        self._distributions: dict[str, BaseDistribution] = {k: d for k, d, _ in self._dims}
        self._params = {c.name: self._encode(c) for c in self.candidates}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            if sampler == "gp":
                import torch  # GPSampler fits with torch: its fits are tiny, so one thread, leaving the
                torch.set_num_threads(1)  # cores to the experiments (and avoiding oversubscription)
                surrogate = optuna.samplers.GPSampler(seed=self.seed, n_startup_trials=n_startup_trials)
            elif sampler == "tpe":
                surrogate = optuna.samplers.TPESampler(
                    seed=self.seed,
                    n_startup_trials=n_startup_trials,
                    multivariate=multivariate,
                    constant_liar=True,  # spread a batch: outstanding trials count as bad
                )
            else:
                raise ConfigError(f"model-based sampler = {sampler!r}: expected 'gp' or 'tpe'")
        self._study = optuna.create_study(
            direction="maximize" if self.maximize else "minimize", sampler=surrogate)
        self._trials: dict[str, Trial] = {}

    # ---- encoding -----------------------------------------------------------------------

    def _encode(self, candidate: Candidate) -> dict[str, Any]:
        params = {}
        for key, _, index in self._dims:
            params[key] = index[_value_text(candidate.knobs, key)]
        return params

    def _distance(self, params: dict[str, Any], candidate: Candidate) -> float:
        mine = self._params[candidate.name]
        d = 0.0
        for key, dist, _ in self._dims:
            if isinstance(dist, IntDistribution):
                d += abs(params[key] - mine[key]) / max(1, dist.high)
            else:
                d += params[key] != mine[key]
        return d

    # ---- BaseTuner hooks ----------------------------------------------------------------

    def _propose(self, k: int) -> list[Candidate]:
        out: list[Candidate] = []
        chosen: set[str] = set()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            for _ in range(k):
                untried = [c for c in self._untried() if c.name not in chosen]
                if not untried:
                    break
                trial = self._study.ask(self._distributions)
                target = min(untried, key=lambda c: self._distance(trial.params, c))  # first on ties
                if self._params[target.name] != trial.params:
                    self._study.tell(trial, state=TrialState.FAIL)
                    self._study.enqueue_trial(self._params[target.name])
                    trial = self._study.ask(self._distributions)
                self._trials[target.name] = trial
                chosen.add(target.name)
                out.append(target)
        return out

    def _observe(self, candidate: Candidate, status: Status, metric: float | None) -> None:
        feasible = status is Status.OK
        trial = self._trials.pop(candidate.name, None)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            if trial is None:  # a result from an earlier run (resume)
                self._study.add_trial(create_trial(
                    params=self._params[candidate.name],
                    distributions=self._distributions,
                    value=metric if feasible else None,
                    state=TrialState.COMPLETE if feasible else TrialState.PRUNED,
                    constraints={_INFEASIBLE: 0.0 if feasible else 1.0},
                ))
                return
            trial.set_constraint(_INFEASIBLE, 0.0 if feasible else 1.0)
            if feasible:
                self._study.tell(trial, metric)
            else:
                self._study.tell(trial, state=TrialState.PRUNED)

    def _withdraw(self, candidate: Candidate) -> None:
        trial = self._trials.pop(candidate.name, None)
        if trial is not None:
            self._study.tell(trial, state=TrialState.FAIL)


def _value_text(knobs: dict[str, Any], key: str) -> str:
    return canonical_json({"v": knobs[key]})[5:-1] if key in knobs else _ABSENT


def _dimensions(candidates: list[Candidate]) -> list[tuple[str, BaseDistribution, dict[str, Any]]]:
    """(knob, distribution, value text -> parameter value) for each knob, sorted by knob."""
    keys = sorted({k for c in candidates for k in c.knobs})
    dims = []
    for key in keys:
        texts: list[str] = []
        for c in candidates:
            t = _value_text(c.knobs, key)
            if t not in texts:
                texts.append(t)
        values = [json.loads(t) if t != _ABSENT else None for t in texts]
        numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
        if numeric and _ABSENT not in texts:
            order = sorted(range(len(texts)), key=lambda i: values[i])
            index = {texts[i]: rank for rank, i in enumerate(order)}
            dims.append((key, IntDistribution(0, max(0, len(texts) - 1)), index))
        else:
            dims.append((key, CategoricalDistribution(texts), {t: t for t in texts}))
    return dims
