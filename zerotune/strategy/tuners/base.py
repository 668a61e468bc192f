"""The tuner interface, ``ask`` (propose) and ``tell`` (learn an outcome); grid and random search over it.

A tuner decides *what* to try next among one tuning space's candidates and runs nothing: the scheduler runs the
experiments, possibly several at once, and reports each outcome when it ends, in any order.
"""
from __future__ import annotations

import abc
import math
import random
from typing import Iterable

from zerotune.core.errors import ConfigError
from zerotune.core.experiment import Status
from zerotune.core.objective import Objective
from zerotune.inputs.space import Candidate


class BaseTuner(abc.ABC):
    """Proposes untried candidates of a space and keeps the best outcome; subclasses choose the order (`_propose`)
    and may learn from outcomes (`_observe`).

    A non-OK outcome (OOM, FAILED, TIMEOUT) is infeasible: never scored, its candidate never proposed again.
    ``INTERRUPTED`` withdraws the proposal: it may come again and counts towards neither ``num_trials`` nor early
    stopping. ``seed`` seeds any randomness, so a run can be repeated.

    Args:
        candidates: the space (`zerotune.inputs.space.generate`); those with ``fits=False`` are never proposed.
        objective: an `Objective` or its name: "throughput" (samples/s) and "flops" are maximised, "latency" (s per
            step) minimised.
        num_trials: at most this many proposals in all (None: no limit).
        early_stopping: stop after this many consecutive reports that did not improve the best (None: never; `ask`).

    Raises:
        ConfigError: ``num_trials`` or ``early_stopping`` is neither a positive integer nor None.
        ValueError: two candidates share a name.
    """

    def __init__(
        self,
        candidates: Iterable[Candidate],
        *,
        objective: Objective | str = "throughput",
        num_trials: int | None = None,
        early_stopping: int | None = None,
        seed: int = 0,
    ) -> None:
        if isinstance(objective, str):
            objective = Objective.named(objective)
        for key, value in (("num_trials", num_trials), ("early_stopping", early_stopping)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigError(f"{key} = {value!r}: expected a positive integer or None")
        self.candidates: list[Candidate] = list(candidates)
        self._by_name = {c.name: c for c in self.candidates}
        if len(self._by_name) != len(self.candidates):
            raise ValueError("candidates must have unique names")
        self.objective = objective
        self.maximize = objective.higher_is_better
        self.num_trials = num_trials
        self.early_stopping = early_stopping
        self.seed = seed
        self.history: list[tuple[str, Status, float | None]] = []
        self._tried: set[str] = set()  # proposed (outstanding or reported) or reported
        self._outstanding: dict[str, None] = {}  # insertion-ordered set
        self._proposals = 0
        self._best: tuple[Candidate, float] | None = None
        self._since_best: int | None = None  # reports since the best last improved; None: no best
        self._stopped_early = False

    # ---- the interface ------------------------------------------------------------------

    def ask(self, n: int = 1) -> list[Candidate]:
        """Propose up to ``n`` new candidates, each at most once in the tuner's life; fewer (possibly none) when
        fewer untried fitting candidates are left, after ``num_trials`` proposals, or under early stopping.

        Early stopping with ``early_stopping = E``: from the first OK report on, ``since_best`` counts the reports, in
        the order told, since the last that strictly improved the best. At ``since_best >= E`` the tuner stops for
        good; before, it proposes at most ``E - since_best - outstanding`` more, so no more than ``E`` experiments run
        after the best, as in a sequential run: ``ask`` may return ``[]`` while `finished` is False.
        """
        if n < 1 or self.finished:
            return []
        k = n
        if self.num_trials is not None:
            k = min(k, self.num_trials - self._proposals)
        if self.early_stopping is not None and self._since_best is not None:
            k = min(k, self.early_stopping - self._since_best - len(self._outstanding))
        if k <= 0:
            return []
        proposed = self._propose(k)
        for c in proposed:
            if c.name in self._tried or not c.fits:
                raise AssertionError(f"{type(self).__name__} proposed {c.name} twice or unfit")
            self._tried.add(c.name)
            self._outstanding[c.name] = None
        self._proposals += len(proposed)
        return proposed

    def tell(self, name: str, status: Status | str, metric: float | None = None) -> None:
        """Report the outcome of a candidate's experiment: ``metric`` is required (finite) for ``Status.OK``, else
        ignored. A candidate never proposed counts as proposed (a result from an earlier run, on resume).

        Raises:
            ValueError: ``name`` is no candidate, its outcome was already told, or an OK one has no finite metric.
        """
        status = Status(status)
        candidate = self._by_name.get(name)
        if candidate is None:
            raise ValueError(f"tell({name!r}): not a candidate of this space")
        if name in self._tried and name not in self._outstanding:
            raise ValueError(f"tell({name!r}): outcome already told")
        if status is Status.OK:
            if metric is None or isinstance(metric, bool) or not math.isfinite(float(metric)):
                raise ValueError(f"tell({name!r}, OK): expected a finite metric, got {metric!r}")
            metric = float(metric)
        else:
            metric = None

        if status is Status.INTERRUPTED:
            self.history.append((name, status, None))
            if name in self._outstanding:
                self._outstanding.pop(name, None)
                self._tried.discard(name)
                self._proposals -= 1
                self._withdraw(candidate)
            return

        if name not in self._tried:  # resumed result
            self._tried.add(name)
            self._proposals += 1
        self._outstanding.pop(name, None)
        self.history.append((name, status, metric))
        improved = metric is not None and (self._best is None or self.objective.better(metric, self._best[1]))
        if improved:
            self._best = (candidate, metric)
            self._since_best = 0
        elif self._since_best is not None:
            self._since_best += 1
            if self.early_stopping is not None and self._since_best >= self.early_stopping:
                self._stopped_early = True
        self._observe(candidate, status, metric)

    @property
    def best(self) -> tuple[Candidate, float] | None:
        """(candidate, metric) of the best OK outcome told so far (the first one on ties), or None."""
        return self._best

    @property
    def finished(self) -> bool:
        """True when `ask` will propose nothing more (outcomes may still be outstanding)."""
        if self._stopped_early:
            return True
        if self.num_trials is not None and self._proposals >= self.num_trials:
            return True
        return not any(c.fits and c.name not in self._tried for c in self.candidates)

    @property
    def outstanding(self) -> list[str]:
        """Names proposed and not yet told, in proposal order."""
        return list(self._outstanding)

    # ---- for subclasses -----------------------------------------------------------------

    def _untried(self) -> list[Candidate]:
        """Fitting candidates never proposed, in the space's order."""
        return [c for c in self.candidates if c.fits and c.name not in self._tried]

    @abc.abstractmethod
    def _propose(self, k: int) -> list[Candidate]:
        """Return up to ``k`` (>= 1) distinct candidates from `_untried`."""

    def _observe(self, candidate: Candidate, status: Status, metric: float | None) -> None:
        """Called after each final outcome (metric None unless status is OK)."""

    def _withdraw(self, candidate: Candidate) -> None:
        """Called when an outstanding proposal is withdrawn (INTERRUPTED)."""


class GridSearchTuner(BaseTuner):
    """Proposes the candidates in `zerotune.inputs.space.generate`'s deterministic order (sorted dimensions)."""

    def _propose(self, k: int) -> list[Candidate]:
        return self._untried()[:k]


class RandomTuner(BaseTuner):
    """Proposes the candidates in an order shuffled once by ``random.Random(seed)``; an interrupted one is proposed
    again at its place."""

    def __init__(self, candidates, **kwargs) -> None:
        super().__init__(candidates, **kwargs)
        self._order = [c for c in self.candidates if c.fits]
        random.Random(self.seed).shuffle(self._order)

    def _propose(self, k: int) -> list[Candidate]:
        return [c for c in self._order if c.name not in self._tried][:k]
