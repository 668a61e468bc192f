"""Progressive ZeRO-stage exploration: which stages get an mbs search, a single probe, or nothing.

One loop over the candidate ZeRO stages, lowest first. A higher stage is explored only when the
memory model says it fits and it could beat the best metric so far: either its larger memory
headroom lets it reach an mbs whose optimistic metric (the best stage's curve extrapolated with
its last observed gain per doubling) beats the best by the threshold, or a single probe at the
best mbs measures it faster. Once a stage has measured slower than the best stage at the same mbs
by more than the threshold, later stages (more communication) are not probed again; a tie within
the threshold is noise and the next stage is probed too. An OOM probe is no evidence of slowness:
it caps the stage below that mbs, and the stage is probed again at the best stage's largest
runnable mbs below it, compared at equal mbs. Each stage's outcome is a
:class:`StageDecision` with a human reason beside it. Nothing here launches anything.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

from zerotune.core.objective import Objective
from zerotune.core.experiment import Status
from zerotune.strategy.mbs import MbsTrace, Point, allowed_values, search_mbs, within_noise


class StageDecision(str, enum.Enum):
    """How :func:`explore_stages` handled a ZeRO stage."""

    EXPLORED = "explored"  # a full mbs search
    PROBED = "probed"  # one experiment at the best mbs, not better
    PRUNED = "pruned"  # the memory model: cannot fit at the smallest mbs, never launched
    SKIPPED = "skipped"  # could not beat the best (no headroom, a lower stage already slower)


@dataclass
class StageResult:
    """How one ZeRO stage was handled (:class:`StageDecision`), why (human text), the memory
    model's largest fitting mbs, and what its search tried."""

    stage: int
    decision: StageDecision | None
    reason: str
    estimate: int = 0
    trace: MbsTrace = field(default_factory=MbsTrace)


@dataclass
class StagePlan:
    """What the memory model says of a stage: the largest fitting mbs (0 = does not fit)."""

    stage: int
    max_mbs_estimate: int


StageEvaluate = Callable[[int, Sequence[int]], Sequence[Point]]
"""Runs a batch of mbs values for a ZeRO stage and returns their points."""


def explore_stages(evaluate: StageEvaluate, plans: Sequence[StagePlan], *, lo: int, hi: int,
                   objective: Objective, threshold: float = 0.01, num_fine: int = 3,
                   allowed: Sequence[int] | None = None, confirm: StageEvaluate | None = None) -> list[StageResult]:
    """Progressive ZeRO-stage exploration, lowest stage first (see the module docstring).

    Args:
        evaluate: ``evaluate(stage, [mbs, ...]) -> [Point, ...]``.
        plans: one per candidate stage, ascending, with the memory model's largest fitting mbs.
        lo, hi, objective, threshold, num_fine, allowed: as in :func:`search_mbs`.
        confirm: ``confirm(stage, [mbs, ...]) -> [Point, ...]`` re-measures measured points once more
            and returns them pooled; when given, a probe that loses by less than the noise is
            re-measured with the point it lost to before the stage is given up, and the mbs search
            confirms its plateaus.

    Returns:
        One :class:`StageResult` per plan, in order.
    """
    values = allowed_values(lo, hi, allowed)
    results: list[StageResult] = []
    best: tuple[int, Point] | None = None  # (stage, point)
    slower_seen = False
    for plan in plans:
        stage = plan.stage
        result = StageResult(stage, None, "", estimate=plan.max_mbs_estimate)
        results.append(result)
        cap = hi
        if not values or plan.max_mbs_estimate < values[0]:
            result.decision, result.reason = StageDecision.PRUNED, f"memory model: mbs={lo} does not fit"
            continue
        if best is not None:
            bound_mbs = max(plan.max_mbs_estimate * _headroom(results), plan.max_mbs_estimate)
            bound = _optimistic_metric(results, best, min(int(bound_mbs), hi), objective)
            if bound is not None and objective.gain(bound, best[1].metric) >= threshold:
                result.reason = (f"could beat: optimistic {objective.name} {bound:.4g} at mbs={int(min(bound_mbs, hi))} "
                                 f"vs best {best[1].metric:.4g}")
            elif slower_seen:
                result.decision = StageDecision.SKIPPED
                result.reason = ("cannot beat: a lower stage was already slower at the same mbs and the memory "
                                 "headroom gives no better optimistic metric")
                continue
            else:
                best_trace = next(r.trace for r in results if r.stage == best[0])
                probe_mbs = max([m for m in values if m <= min(best[1].mbs, plan.max_mbs_estimate)], default=values[0])
                (probe,) = evaluate(stage, [probe_mbs])
                result.trace.points.append(probe)
                if probe.status is Status.OOM:  # no evidence of slowness: probe below it, at equal mbs
                    cap = probe_mbs - 1
                    below = [p.mbs for p in best_trace.ok_points if p.mbs < probe_mbs]
                    if below:
                        probe_mbs = max(below)
                        (probe,) = evaluate(stage, [probe_mbs])
                        result.trace.points.append(probe)
                if (confirm is not None and probe.ok and not objective.better(probe.metric, best[1].metric)
                        and within_noise(objective.gain(probe.metric, best[1].metric), probe, best[1], threshold)):
                    # one run decides nothing: re-measure the probe and what it lost to, then compare pooled
                    ref_mbs = probe_mbs if best_trace.get(probe_mbs) else best[1].mbs
                    result.trace.update(confirm(stage, [probe_mbs]))
                    best_trace.update(confirm(best[0], [ref_mbs]))
                    probe, best = result.trace.get(probe_mbs), (best[0], best_trace.best(objective))
                if not (probe.ok and objective.better(probe.metric, best[1].metric)):
                    result.decision = StageDecision.PROBED
                    same = best_trace.get(probe_mbs) if probe.ok else None
                    reference = same or best[1]
                    result.reason = (f"probe at mbs={probe_mbs}: {probe.status.value} "
                                     f"{'' if probe.metric is None else f'{probe.metric:.4g} '}"
                                     f"not better than ZeRO stage {best[0]}'s {reference.metric:.4g} at "
                                     f"mbs={reference.mbs}")
                    # evidence that higher stages are slower: measured slower than the best stage at the
                    # same mbs by more than the plateau threshold (a tie is noise; an OOM or a failure
                    # says nothing about speed)
                    slower_seen = slower_seen or (same is not None
                                                  and objective.gain(probe.metric, same.metric) <= -threshold)
                    continue
                result.reason = f"probe at mbs={probe_mbs} beat the best ({probe.metric:.4g} > {best[1].metric:.4g})"
        else:
            result.reason = "first feasible stage"
        result.decision = StageDecision.EXPLORED
        result.trace = search_mbs(lambda ms, s=stage: evaluate(s, ms), lo=lo, hi=min(hi, cap),
                                  estimate=min(plan.max_mbs_estimate, cap), objective=objective, threshold=threshold,
                                  num_fine=num_fine, known=result.trace.points, allowed=allowed,
                                  confirm=None if confirm is None else (lambda ms, s=stage: confirm(s, ms)))
        top = result.trace.best(objective)
        if top is not None and (best is None or objective.better(top.metric, best[1].metric)):
            best = (stage, top)
    return results


def _headroom(results: Sequence[StageResult]) -> float:
    """How far above its estimate an explored stage actually ran (>= 1): the estimate's caution."""
    ratio = 1.0
    for r in results:
        ok = r.trace.ok_points
        if r.decision is StageDecision.EXPLORED and ok and r.estimate > 0:
            ratio = max(ratio, max(p.mbs for p in ok) / r.estimate)
    return ratio


def _optimistic_metric(results: Sequence[StageResult], best: tuple[int, Point], mbs: int,
                       objective: Objective) -> float | None:
    """Best metric a higher stage could reach at ``mbs``, by extrapolating the best stage's curve.

    Step time never shrinks as mbs grows and a higher stage is assumed no faster at equal mbs,
    so beyond the best stage's largest runnable mbs ``m`` the metric can grow at most by the
    last gain per doubling ``g`` observed there: ``T(m) * (1 + g) ** log2(mbs / m)``, with ``g``
    measured from the largest runnable mbs at most ``m / 1.5`` (else the next runnable below ``m``). For a
    metric where lower is better (latency) a larger mbs never helps: None.
    """
    if not objective.higher_is_better:
        return None
    stage_result = next(r for r in results if r.stage == best[0])
    ok = sorted(stage_result.trace.ok_points, key=lambda p: p.mbs)
    top = ok[-1]
    if mbs <= top.mbs:
        return None
    if len(ok) < 2:
        return top.metric * mbs / top.mbs  # no curve yet: linear scaling is the only safe bound
    # the gain from a point at least 1.5x below: neighbours near the memory boundary (bisection
    # points a few mbs apart) differ by noise more than by the curve
    apart = [p for p in ok if p.mbs * 3 <= top.mbs * 2]
    prev = apart[-1] if apart else ok[-2]
    doublings = math.log2(top.mbs / prev.mbs)
    g = max(0.0, (top.metric / prev.metric) ** (1 / doublings) - 1) if prev.metric > 0 else 0.0
    return top.metric * (1 + g) ** math.log2(mbs / top.mbs)
