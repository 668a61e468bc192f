"""Grid search: every fitting candidate, in the space's order."""
from __future__ import annotations

from zerotune.inputs.space import Candidate
from zerotune.strategy.tuners.base import BaseTuner


class GridSearchTuner(BaseTuner):
    """Proposes the candidates in the order `zerotune.inputs.space.generate` returns them.

    The order is deterministic (sorted dimensions, candidates in the order given), so two runs
    over the same space try the same experiments in the same order.
    """

    def _propose(self, k: int) -> list[Candidate]:
        return self._untried()[:k]
