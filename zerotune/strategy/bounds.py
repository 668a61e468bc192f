"""The bounds of an mbs search: one frozen record (`SearchBounds`) that every micro-batch search of a
tuning shares, its stage probes, its mbs search (`zerotune.strategy.mbs`) and its fine pass
(`zerotune.strategy.fine`), whichever phase runs them.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

from zerotune.core.objective import Objective


@dataclass(frozen=True)
class SearchBounds:
    """Where and how an mbs search may go.

    Attributes:
        lo, hi: the smallest and largest mbs allowed (``min/max_train_micro_batch_size_per_gpu``, and the train
            batch bounds).
        objective: the metric's direction (which way the search goes).
        allowed: the mbs values the search may try (None: every integer in ``lo..hi``); only those within
            ``lo..hi`` are used.
        threshold: the plateau threshold, a fraction: a step that improves the best metric by less ends the upward
            search; a throughput search goes below its best only while a step down gains this much.
        precision: the runs' target precision (relative half-width, e.g. 0.02): a difference within it is a tie
            (`zerotune.core.noise.tie`); None: never.
        num_fine: experiments allowed in the fine pass around the best mbs (0: none).
    """

    lo: int
    hi: int
    objective: Objective
    allowed: Sequence[int] | None = None
    threshold: float = 0.01
    precision: float | None = None
    num_fine: int = 3

    @property
    def values(self) -> list[int]:
        """The sorted mbs values a search may try: `allowed` (or every integer) within ``lo..hi``."""
        if self.allowed is None:
            return list(range(self.lo, self.hi + 1))
        return sorted({m for m in self.allowed if self.lo <= m <= self.hi})

    def coarse(self, cap: int) -> SearchBounds:
        """These bounds at most ``cap`` (the mbs below a variant's out-of-memory run), without the fine pass: a
        stage's search while the stages are compared."""
        return replace(self, hi=min(self.hi, cap), num_fine=0)
