"""The tuner interface: propose experiments (``ask``), learn their outcome (``tell``); grid search (every fitting
candidate in the space's order) and random search (a seeded order) over it.

A tuner decides *what* to try next among the candidates of one tuning space; it never runs
anything (the scheduler places and runs experiments, possibly several at a time, and reports
each outcome when it ends, in any order).
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
    """Proposes untried candidates of a space and keeps the best outcome.

    Subclasses choose the order (`_propose`) and may learn from outcomes (`_observe`);
    the bookkeeping below is shared.

    Args:
        candidates: the space, from `zerotune.inputs.space.generate`. Candidates with
            ``fits=False`` are never proposed.
        objective: the metric (an `Objective` or its name): "throughput" (samples/s) and
            "flops" are maximised, "latency" (s per step) minimised.
        num_trials: at most this many proposals in all (None: no limit).
        early_stopping: stop after this many consecutive reported experiments that did not
            improve the best (None: never). See `ask` for the exact rule.
        seed: seed of any randomness, so a run can be repeated.

    .. note::
        A non-OK outcome (OOM, FAILED, TIMEOUT) is infeasible: it has no metric, is never
        scored (not as 0, not at all) and its candidate is never proposed again.
        ``INTERRUPTED`` withdraws the proposal: the candidate may be proposed again and the
        proposal does not count towards ``num_trials`` or early stopping.
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
        """Propose up to ``n`` new candidates to run, each at most once in the tuner's life.

        Returns fewer than ``n`` (possibly none) when the space has fewer untried fitting
        candidates left, when ``num_trials`` proposals have been made, or under early stopping.

        Early stopping with ``early_stopping = E``: reports are counted in the order they are
        told; from the first OK report on, ``since_best`` counts the reports since the last one
        that strictly improved the best (non-OK reports count as not improving). Once
        ``since_best >= E`` the tuner stops for good. While experiments are outstanding, ``ask``
        proposes at most ``E - since_best - outstanding`` more, so that if none of them improves
        no more than ``E`` experiments run after the best one, as in a sequential run; ``ask``
        may therefore return ``[]`` while `finished` is False, until outstanding outcomes
        are told. Before the first OK report there is no best and no limit.
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
        """Report the outcome of a candidate's experiment.

        Args:
            name: the candidate's name. A candidate of the space that was never proposed is
                accepted too (a result from an earlier run, on resume): it counts as proposed.
            status: the experiment's `zerotune.core.experiment.Status`.
            metric: the measured metric for ``Status.OK`` (required, finite); ignored otherwise.
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
    """Proposes the candidates in the order `zerotune.inputs.space.generate` returns them.

    The order is deterministic (sorted dimensions, candidates in the order given), so two runs
    over the same space try the same experiments in the same order.
    """

    def _propose(self, k: int) -> list[Candidate]:
        return self._untried()[:k]


class RandomTuner(BaseTuner):
    """Proposes the candidates in an order shuffled once by ``random.Random(seed)``.

    The same seed over the same space gives the same order; no candidate is proposed twice
    (an interrupted one is proposed again at its place in the order).
    """

    def __init__(self, candidates, **kwargs) -> None:
        super().__init__(candidates, **kwargs)
        self._order = [c for c in self.candidates if c.fits]
        random.Random(self.seed).shuffle(self._order)

    def _propose(self, k: int) -> list[Candidate]:
        return [c for c in self._order if c.name not in self._tried][:k]
