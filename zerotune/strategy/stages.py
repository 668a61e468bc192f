"""Progressive ZeRO-stage exploration: which stages get an mbs search, a single probe, or nothing (D106).

`StageExplorer` visits stages lowest first; the first that fits gets the mbs search. A higher stage the memory model
says fits gets one probe (at its own largest fitting mbs where that is larger than any mbs the best stage ran, else at
the best's mbs) and a full search only when the probe beats the best. A stage that cannot beat the best is skipped
(`StageExplorer._skip_reason`); an OOM probe is no evidence of slowness (`StageExplorer._probe`); for throughput a
first stage out of memory at its estimate may be deferred (`StageExplorer._defer`). The fine pass runs last, on the
best stage only. Each stage's outcome is a `StageDecision` with a reason; nothing here launches.
"""
from __future__ import annotations

from typing import Sequence

from zerotune.core.experiment import Status
from zerotune.core.noise import replica_decides
from zerotune.strategy.answer import Capacity
from zerotune.strategy.points import Point, SearchBounds, largest_within
from zerotune.strategy.result import StageDecision, StagePlan, StageResult
from zerotune.strategy.variants import Best, VariantEvaluate, VariantExplorer


def explore_stages(evaluate: VariantEvaluate, plans: Sequence[StagePlan], bounds: SearchBounds,
                   confirm: VariantEvaluate | None = None) -> list[StageResult]:
    """Explore the stages of ``plans`` (one per candidate stage, ascending, with the memory model's largest fitting
    mbs); one `StageResult` per plan, in order.

    Args:
        evaluate: ``evaluate(stage_result, [mbs, ...]) -> [Point, ...]``, at the result's stage.
        bounds: as in `zerotune.strategy.mbs.search_mbs`; its ``num_fine`` experiments are the fine pass.
        confirm: re-measures points once more and returns them pooled (as ``evaluate``); when given, a probe that
            loses within the noise is re-measured with the point it lost to, and the mbs search confirms plateaus.
    """
    return StageExplorer(evaluate, bounds, confirm).run(plans)


class StageExplorer(VariantExplorer):
    """One exploration: the stage policy over the shared variant steps (`zerotune.strategy.variants.VariantExplorer`)
    and the evidence that rules later stages out. Arguments as in `explore_stages`."""

    def __init__(self, evaluate: VariantEvaluate, bounds: SearchBounds, confirm: VariantEvaluate | None = None):
        super().__init__(evaluate, bounds, confirm)
        self.results: list[StageResult] = []
        self.slower_seen = False  # a probe measured slower than the best stage at its mbs by the threshold
        self.partitioned_lost = False  # a stage 1 or 2 probe at the best's mbs did not beat it
        self.deferred: dict[int, int] = {}  # stage -> the mbs of its first run, at its estimate, that ran out of memory
        self.queue: list[tuple[StagePlan, StageResult | None]] = []

    def run(self, plans: Sequence[StagePlan]) -> list[StageResult]:
        """Decide every plan's stage, then run the fine pass (`zerotune.strategy.fine.refine_mbs`) on the best only,
        since refining a stage a later one beats is wasted; one result per plan, in order."""
        self.queue = [(plan, None) for plan in plans]
        while self.queue:
            self._visit(*self.queue.pop(0))
        self.refine()
        return self.results

    def _visit(self, plan: StagePlan, came_back: StageResult | None) -> None:
        """Decide one stage: pruned, deferred, skipped, probed, or searched. ``came_back``: a deferred stage's
        result, back once the others are decided."""
        result = came_back or StageResult(plan.stage, None, "", estimate=plan.max_mbs_estimate)
        if came_back is None:
            self.results.append(result)
        if not self.values or plan.max_mbs_estimate < self.values[0]:
            result.decision, result.reason = StageDecision.PRUNED, f"memory model: mbs={self.bounds.lo} does not fit"
            return
        if came_back is None and self._defer(plan, result):
            return
        cap = self.deferred[plan.stage] - 1 if came_back is not None and self.best is not None else self.bounds.hi
        note = (f"its estimate mbs={self.deferred[plan.stage]} ran out of memory, deferred; "
                if came_back is not None else "")
        if self.best is not None:
            cap = self._probe(plan, result, cap, note, came_back is not None)
            if cap is None:
                return
        else:
            result.reason = (f"{note}searched: no other stage ran" if note else
                             "first stage searched: ZeRO stage " + ", ".join(map(str, self.deferred)) + " deferred"
                             if self.deferred else "first feasible stage")
        self.search(result, cap)

    def _defer(self, plan: StagePlan, result: StageResult) -> bool:
        """Whether the first stage to run (throughput) is deferred: its run at its estimate ran out of memory and a
        later stage's estimate is larger, so the stage with more headroom goes first. It comes back once the others
        are decided, capped below its OOM, and is probed at the smaller of the best's mbs and its cap (without the
        slower-at-equal-mbs skip); where nothing else ran, it is searched first."""
        if self.best is not None or not self.objective.higher_is_better:
            return False
        start = largest_within(self.values, plan.max_mbs_estimate)
        if not (start > self.values[0] and any(q.max_mbs_estimate > start for q, _ in self.queue)):
            return False
        if not self.probe(result, start).status.over_budget:
            return False
        self.deferred[plan.stage] = start  # a stage with more headroom goes first
        self.queue.append((plan, result))
        return True

    def _skip_reason(self, stage: int, headroom: bool, reach: int, came_back: bool) -> str | None:
        """Why a stage with no more headroom than the best cannot beat it; None: it may. Any stage, once one measured
        slower than the best stage at the same mbs by the threshold; ZeRO-3, once stage 1 or 2 is the best or lost a
        probe at the best's mbs (ZeRO-3 adds parameter all-gathers: 3 Psi per step against 2, ZeRO paper sec. 7.2)."""
        if headroom:
            return None
        if self.slower_seen and not came_back:  # a deferred stage is a lower one
            return (f"cannot beat: a lower stage was already slower at the same mbs, and this one "
                    f"reaches no larger mbs than {reach}")
        if stage == 3 and (self.best.stage in (1, 2) or self.partitioned_lost):
            return (f"cannot beat: it reaches no larger mbs than {reach}, and at equal mbs it is "
                    f"stages 1-2's partitioned step plus parameter all-gathers (3 Psi per step against "
                    f"2 Psi, ZeRO paper section 7.2); " + (f"ZeRO stage {self.best.stage} is the best"
                    if self.best.stage in (1, 2) else "a stage 1-2 probe at that mbs did not beat the best"))
        return None

    def _probe(self, plan: StagePlan, result: StageResult, cap: int, note: str, came_back: bool) -> int | None:
        """Probe a stage against the best; its cap for the mbs search when it won, None when decided (skipped or
        lost). An OOM or refused probe caps the stage below it and probes again (`_retries`); a probe within the
        noise of the best, save a headroom probe's win, is re-measured (`_confirm_probe`); a win within the target
        precision at equal mbs is a tie (`zerotune.core.noise.tie`)."""
        stage = plan.stage
        own = largest_within(self.values, min(plan.max_mbs_estimate, cap))
        # headroom: this stage can run a larger mbs than the best stage ran at all (not merely than its
        # best mbs: where the best stage ran larger and was slower, a larger batch is no advantage)
        reach = max(p.mbs for p in self.best.trace.ok_points)
        headroom = own > reach
        skip = self._skip_reason(stage, headroom, reach, came_back)
        if skip is not None:
            result.decision, result.reason = StageDecision.SKIPPED, skip
            return None
        probe_mbs = own if headroom else largest_within(self.values, min(self.best.point.mbs, own))
        probe = self.probe(result, probe_mbs)
        if probe.status is Status.SKIPPED:
            self.skip(result, probe_mbs, f"{note}cannot beat: ")
            return None
        if probe.status.over_budget:  # no evidence of slowness: probe below it
            probe_mbs, probe, cap = self.retry_below(result, probe, probe_mbs, self._retries(probe_mbs, headroom))
        probe = self._confirm_probe(result, probe, probe_mbs, headroom)
        best = self.best.point
        if (headroom and probe.ok and not self.objective.better(probe.metric, best.metric)
                and best.mbs < probe_mbs and result.trace.get(best.mbs) is None):
            probe_mbs, probe = self._second_probe(result, probe, probe_mbs)
        if not self.beats(probe, ties=not headroom):  # a win within the precision at equal mbs is a tie
            self._record_loss(result, probe, probe_mbs, note)
            return None
        result.reason = f"{note}probe at mbs={probe_mbs} beat the best ({probe.metric:.4g} > {best.metric:.4g})"
        return cap

    def _retries(self, probe_mbs: int, headroom: bool) -> list[int]:
        """Where to probe after an OOM probe at ``probe_mbs``: with headroom halfway back to the best's mbs, then at
        it; else at equal mbs, the best stage's largest runnable mbs below the probe."""
        best = self.best.point
        below = [p.mbs for p in self.best.trace.ok_points if p.mbs < probe_mbs]
        return self.halfway(best.mbs, probe_mbs) + [best.mbs] if headroom else [max(below)] if below else []

    def _confirm_probe(self, result: StageResult, probe: Point, probe_mbs: int, headroom: bool) -> Point:
        """A probe within the noise of the best (a loss, or a win at equal mbs) and the best (its point, and its
        stage's point at the probe's mbs where that ran ok) re-measured; the probe's point, `best` updated."""
        objective, best = self.objective, self.best
        won = probe.ok and objective.better(probe.metric, best.point.metric)
        gain = objective.gain(probe.metric, best.point.metric) if probe.ok else 0.0
        if not (self.confirm is not None and probe.ok and (not won or not headroom)
                and replica_decides(gain, probe, best.point, self.bounds.threshold, self.bounds.precision)):
            return probe
        at_same = best.trace.get(probe_mbs)
        refs = sorted({best.point.mbs} | ({probe_mbs} if at_same is not None and at_same.ok else set()))
        result.trace.update(self.confirm(result, [probe_mbs]))
        best.trace.update(self.confirm(best.result, refs))
        self.best = Best(best.result, best.trace.best(objective))
        return result.trace.get(probe_mbs)

    def _second_probe(self, result: StageResult, probe: Point, probe_mbs: int) -> tuple[int, Point]:
        """Probe again after a headroom probe's loss (a step at the memory boundary can be slower than just below it):
        where the probe ran near the capacity, at the largest calm mbs above the best's, else at the best's mbs;
        (its mbs, its point)."""
        best = self.best.point
        calm = [m for m in self.values if probe.calm_mbs is not None and best.mbs < m <= probe.calm_mbs
                and m < probe_mbs and result.trace.get(m) is None]
        probe_mbs = calm[-1] if probe.capacity is Capacity.NEAR and calm else best.mbs
        return probe_mbs, self.probe(result, probe_mbs)

    def _record_loss(self, result: StageResult, probe: Point, probe_mbs: int, note: str) -> None:
        """Record a probe that lost, and whether it measured slower than the best stage at the same mbs by the
        threshold (an OOM, a failure or another mbs says nothing of speed)."""
        best = self.best
        same = best.trace.get(probe_mbs) if probe.ok else None
        same = same if same is not None and same.ok else None
        reference = same or best.point
        self.lose(result, probe, probe_mbs, note,
                  f" not better than {best.result.label}'s {reference.metric:.4g} at mbs={reference.mbs}")
        self.slower_seen = self.slower_seen or (same is not None and self.objective.gain(
            probe.metric, same.metric) <= -self.bounds.threshold)
        self.partitioned_lost = self.partitioned_lost or (result.stage in (1, 2) and same is not None)
