"""A stage variant probed against the best so far and searched when it wins: the steps every phase that explores
variants shares (`VariantExplorer`).

A variant is a ZeRO stage, alone or with a memory saver, held as its `zerotune.strategy.result.StageResult`. The stage
phase (`zerotune.strategy.stages.StageExplorer`) and the savers phase (`zerotune.strategy.savers.SaverPhase`) differ
only in policy: which variants, in what order, which skips, at which mbs a probe runs. Both share the steps here: the
probe, its retry below an OOM, the throughput model's skip, the win test, the loss, the coarse search after a win, the
best so far, and the fine pass on the best once every variant is decided. Nothing here launches.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from zerotune.core.experiment import Status
from zerotune.core.noise import tie
from zerotune.strategy.evaluation import buying
from zerotune.strategy.fine import refine_mbs
from zerotune.strategy.mbs import search_mbs
from zerotune.strategy.points import MbsTrace, Point, SearchBounds, launched, refusals
from zerotune.strategy.result import StageDecision, StageResult

VariantEvaluate = Callable[[StageResult, Sequence[int]], Sequence[Point]]
"""``evaluate(variant, [mbs, ...]) -> [Point, ...]``: runs a variant (its stage, with its saver's settings) at each
mbs; as a confirm, re-measures measured mbs once more and returns their points pooled over their runs."""


@dataclass(frozen=True)
class Best:
    """The best variant so far (its result, whose trace holds its points) and its best point."""

    result: StageResult
    point: Point

    @property
    def stage(self) -> int:
        return self.result.stage

    @property
    def trace(self) -> MbsTrace:
        return self.result.trace


class VariantExplorer:
    """The shared steps of a variant phase; a phase subclasses it with its policy. ``bounds`` hold for every variant;
    ``confirm`` re-measures a variant's measured mbs values, pooled (as ``evaluate``, a `VariantEvaluate`); None: the
    mbs search decides its plateaus on one run."""

    def __init__(self, evaluate: VariantEvaluate, bounds: SearchBounds, confirm: VariantEvaluate | None = None):
        self.evaluate, self.bounds, self.confirm = evaluate, bounds, confirm
        self.objective, self.values = bounds.objective, bounds.values
        self.best: Best | None = None

    def probe(self, result: StageResult, mbs: int) -> Point:
        """Run ``result``'s variant at ``mbs``; its point, recorded in its trace."""
        with buying(f"{result.label}: its probe"):
            (point,) = self.evaluate(result, [mbs])
        result.trace.points.append(point)
        return point

    def halfway(self, low: int, high: int) -> list[int]:
        """The largest allowed mbs above ``low`` and at most halfway to ``high`` (empty: none)."""
        return [m for m in self.values if low < m <= (low + high) // 2][-1:]

    def retry_below(self, result: StageResult, probe: Point, probe_mbs: int,
                    retries: Sequence[int]) -> tuple[int, Point, int]:
        """After ``probe`` ran out of memory at ``probe_mbs`` (no evidence of slowness), probe at each of
        ``retries`` in turn until one is not out of memory: (the last probe's mbs, its point, the variant's cap
        below the last out-of-memory probe)."""
        for retry in retries:
            cap = probe_mbs - 1
            probe_mbs = retry
            probe = self.probe(result, probe_mbs)
            if not probe.status.over_budget:
                break
        else:
            cap = probe_mbs - 1
        return probe_mbs, probe, cap

    def beats(self, probe: Point, ties: bool = True) -> bool:
        """Whether ``probe`` ran and beats the best so far (or nothing ran); with ``ties``, by more than the
        precision (`zerotune.core.noise.tie`: a win within it is no win)."""
        if not probe.ok:
            return False
        if self.best is None:
            return True
        best = self.best.point
        return self.objective.better(probe.metric, best.metric) and not (
            ties and tie(self.objective.gain(probe.metric, best.metric), self.bounds.precision))

    @staticmethod
    def skip(result: StageResult, probe_mbs: int, lead: str) -> None:
        """Record a variant whose probe at ``probe_mbs`` the throughput model skipped, ``lead`` before the reason."""
        result.decision = StageDecision.SKIPPED
        result.reason = f"{lead}the throughput model bounds its probe at mbs={probe_mbs} below the best plus the precision"

    @staticmethod
    def lose(result: StageResult, probe: Point, probe_mbs: int, lead: str, than: str) -> None:
        """Record a variant whose last probe (``probe`` at ``probe_mbs``) did not win: probed, or not launched where
        the memory model refused each probe; its reason ``lead``, the refusals, then the probe's status and metric
        followed by ``than`` (what it did not beat), unless it was refused."""
        result.decision = StageDecision.PROBED if launched(result.trace.points) else StageDecision.NOT_LAUNCHED
        measured = probe.status.value + ("" if probe.metric is None else f" {probe.metric:.4g}")
        lost = [] if probe.status is Status.REFUSED else [f"probe at mbs={probe_mbs}: {measured}{than}"]
        result.reason = lead + "; ".join(refusals(result.trace.points) + lost)

    def search(self, result: StageResult, cap: int) -> bool:
        """The variant's coarse mbs search up to ``cap``, from its probes; True when it became the best (`improve`)."""
        confirm = self.confirm
        result.decision = StageDecision.EXPLORED
        with buying(f"{result.label}: its mbs search"):
            result.trace = search_mbs(lambda ms: self.evaluate(result, ms), self.bounds.coarse(cap),
                                      estimate=min(result.estimate, cap), known=result.trace.points,
                                      confirm=None if confirm is None else (lambda ms: confirm(result, ms)))
        return self.improve(result)

    def improve(self, result: StageResult) -> bool:
        """Make ``result`` the best if its best point beats the best so far's (the first on ties); True if it did."""
        top = result.trace.best(self.objective)
        if top is None or (self.best is not None and not self.objective.better(top.metric, self.best.point.metric)):
            return False
        self.best = Best(result, top)
        return True

    def refine(self) -> None:
        """The fine pass on the best variant, once every variant is decided (each search is coarse until then)."""
        if self.best is not None and self.bounds.num_fine > 0:
            top = self.best.result
            with buying(f"{top.label}: the fine pass"):
                refine_mbs(lambda ms: self.evaluate(top, ms), top.trace, self.bounds)
