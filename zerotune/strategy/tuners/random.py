"""Random search: the fitting candidates in a seeded random order, without repeats."""
from __future__ import annotations

import random

from zerotune.inputs.space import Candidate
from zerotune.strategy.tuners.base import BaseTuner


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
