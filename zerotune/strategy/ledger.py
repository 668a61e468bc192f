"""The ledger: every experiment the strategy was told the outcome of, the one record the report reads.

Experiments enter through one door (`Ledger.add`), in the order asked, with their outcomes: runs, re-measurements
(replicas, ``<name>_r<k>``) and configs kept from launching. Everything the strategy decides on derives from it: a
config's runs, their pooled metrics, the run-to-run noise and the answer (`zerotune.strategy.answer.decide`), each
computed once per state of the ledger.
"""
from __future__ import annotations

from zerotune.core.experiment import Experiment, Status
from zerotune.core.measure import Pooled, pooled_metrics
from zerotune.core.noise import RunNoise, mean_half_width, run_noise
from zerotune.core.objective import Objective
from zerotune.strategy.answer import Tie, best_experiment, decide


class Ledger:
    """The experiments of one tuning, in the order asked, each name once (replicas have their own names).

    ``objective`` None reads no answer (a bare ledger); ``budget_bytes`` is the per-device budget the answer rule
    reads capacity against (None on CPU ranks); within ``precision`` (relative; None: never) configs tie
    (`zerotune.strategy.answer.decide`).
    """

    def __init__(self, objective: Objective | None = None, budget_bytes: int | None = None,
                 precision: float | None = None):
        self.objective = objective
        self.budget_bytes = budget_bytes
        self.precision = precision
        self.experiments: list[Experiment] = []
        self.run_noise: RunNoise = run_noise(())
        """The run-to-run noise of the configs run more than once (`zerotune.core.noise.run_noise`),
        updated by `update_run_noise` after every batch; every comparison of runs counts it."""
        self.excluded: dict[str, str] = {}
        """Config name -> why it cannot be the answer though it ran (it does not fit the longest batch,
        `zerotune.strategy.longest`); its runs are left out of the answer rule, not out of the ledger."""
        self._by_name: dict[str, Experiment] = {}
        self._pooled: tuple[int, dict[str, Pooled]] = (0, {})
        self._answer: tuple[int, Experiment | None, Tie | None] = (0, None, None)

    def __contains__(self, name: str) -> bool:
        return name in self._by_name

    def __getitem__(self, name: str) -> Experiment:
        return self._by_name[name]

    def get(self, name: str) -> Experiment | None:
        return self._by_name.get(name)

    def add(self, exp: Experiment) -> None:
        """Record ``exp`` with its outcome (the one door into the ledger)."""
        self._by_name[exp.name] = exp
        self.experiments.append(exp)

    def runs_of(self, name: str) -> list[Experiment]:
        """The experiment ``name`` and its replicas, in the order they ran."""
        return [e for e in self.experiments if e.name == name or e.replica_of == name]

    def pooled(self) -> dict[str, Pooled]:
        """Experiment name -> its metric pooled over its ok runs (`zerotune.core.measure.pooled_metrics`)."""
        if self._pooled[0] != len(self.experiments):
            self._pooled = (len(self.experiments), pooled_metrics(self.experiments))
        return self._pooled[1]

    def half_width(self, name: str) -> float:
        """The relative 95% half-width of ``name``'s metric pooled over its ok runs, estimating what a run of it gives
        (`zerotune.core.noise.mean_half_width`: their own intervals, an unknown one as 0, the run-to-run noise)."""
        runs = [e.metric_rel_half_width for e in self.runs_of(name) if e.status is Status.OK]
        return mean_half_width(runs or [None], self.run_noise.sigma)

    @property
    def answer(self) -> Experiment | None:
        """The answer so far (`zerotune.strategy.answer.decide`); None before any ran ok."""
        return self._decided()[1]

    @property
    def tie(self) -> Tie | None:
        """The tie the answer was taken from (`zerotune.strategy.answer.Tie`); None: no config within the precision."""
        return self._decided()[2]

    def exclude(self, name: str, why: str) -> None:
        """Keep config ``name`` (and its replicas) from being the answer, for ``why`` (`excluded`)."""
        self.excluded[name] = why
        self._answer = (-1, None, None)

    def _candidates(self) -> list[Experiment]:
        return [e for e in self.experiments if e.name not in self.excluded and e.replica_of not in self.excluded]

    def _decided(self) -> tuple[int, Experiment | None, Tie | None]:
        if self.objective is not None and self._answer[0] != len(self.experiments):
            self._answer = (len(self.experiments), *decide(self._candidates(), self.objective, self.budget_bytes,
                                                           self.precision))
        return self._answer

    @property
    def first_run_answer(self) -> Experiment | None:
        """The answer the first runs alone give (every replica left out): what the re-measurements changed,
        where it differs from `answer`; None before any ran ok or without an objective."""
        if self.objective is None:
            return None
        return best_experiment([e for e in self._candidates() if e.replica_of is None], self.objective,
                               self.budget_bytes, self.precision)

    def update_run_noise(self) -> tuple[RunNoise, RunNoise]:
        """Re-estimate `run_noise` from the runs so far; (before, now)."""
        before, self.run_noise = self.run_noise, run_noise(self.experiments)
        return before, self.run_noise
