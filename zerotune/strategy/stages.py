"""Progressive ZeRO-stage exploration: which stages get an mbs search, a single probe, or nothing.

One loop over the candidate ZeRO stages, lowest first. The first stage that fits is searched (unless
deferred, below). A higher stage that the memory model says fits gets one probe, and a full mbs search
only when the probe measures faster than the best so far:

- where its memory headroom lets it run a larger mbs than the best stage ran at all (higher
  stages partition more of the model states), the probe is at its own largest fitting mbs: a
  larger batch is how a stage with more communication wins;
- otherwise at the best stage's best mbs, compared at equal mbs.

Once a stage has measured slower than the best stage at the same mbs by more than the threshold,
a later stage with no more headroom is skipped (more communication at no larger mbs); a tie
within the threshold is noise. ZeRO-3 with no more headroom is skipped too once stage 1 or 2 is the
best, or a stage 1-2 probe at the best's mbs did not beat it: at equal mbs ZeRO-3 runs the same
partitioned optimizer step as stages 1-2 and all-gathers the parameters on top (3 Psi of
communication per step against 2 Psi: the ZeRO paper, Rajbhandari et al. 2020, section 7.2), so it
cannot beat them. An OOM probe is no evidence of slowness: it caps the stage below
that mbs, and the stage is probed again (halfway back to the best's mbs, or at the best stage's
largest runnable mbs below it). A probe that loses within the runs' noise is re-measured with the
best point (and the best stage's point at the probe's mbs) before the stage is given up; so is one at
equal mbs that wins within the noise, before the stage is searched: at equal mbs a higher stage can
only gain on the once-per-step work, and a one-run win inside the noise would buy a whole mbs search on
a coin toss (on this project's CPU machine ZeRO-1 and ZeRO-2 each won that way by 0.8-1.1% and were
searched, 8 launches). A headroom probe's win is not re-measured: a larger batch is a real way to win
(on the SIMULATED clusters re-measuring those cost 3% more GPU-hours at 1% and 5% noise, and answers
within 1% of the optimum at 5%: 112 of 216 against 118). A
probe at the stage's own largest fitting mbs that loses is followed by one at the best's mbs: the
largest fitting mbs sits at the memory boundary, where a device's caching allocator flushes and
retries, and a step there can be slower than one just below it (on the SIMULATED cluster, which models
that slowdown above 92% of the device memory, this raised the worst answer over 6 noise draws at 5%
noise from 0.844 to 0.936 of the optimum). Where that probe's measured peak was near the device's
capacity (:data:`~zerotune.strategy.mbs.NEAR_CAPACITY`), the second probe is at the largest mbs the memory
model puts under it, if that is still above the best's mbs: the stage compared where it runs unslowed,
with some of its headroom (12 noise draws at 5%: answers under 0.95 of the optimum 20 -> 16 of 432, at
the same GPU-hours). Each stage's outcome is a :class:`StageDecision` with a human reason beside it.

**Deferral** (throughput only). Where the first stage to run runs out of memory at its memory estimate
(its first run, where its search would start) and a later stage's estimate is larger, that stage is
deferred: the later stage, which partitions more and fits a larger batch, goes first. Searching the
deferred stage now (halving from the OOM, bisecting back up: three or four runs) would only set a bar
for the stage with more headroom, and that stage wins most often: on the SIMULATED clusters, where the
first run at the estimate runs out of memory in most draws (an allocator's fragmentation no profile
sees), 67 lower-stage searches that way over 216 outcomes at 5% noise ended with ZeRO-3 the answer:
0.06x of DeepSpeed's GPU-hours. The deferred stage comes back once the others are decided, capped below
its OOM: a probe at the best's mbs or its own cap, whichever is smaller, compared like any probe (without
the skip for a stage slower at equal mbs, which assumes a higher stage's extra communication), and
searched if it wins; where nothing else ran, it is searched as the first stage would have been. Deferring cut the
GPU-hours (12 noise draws) from 0.67x to 0.59x DeepSpeed's at 5% noise, with answers within 1% of the
optimum 299 of 432 (298) and under 0.97 27 (30), the worst 0.926 (0.936); and from 0.54x to 0.48x at 1%,
where answers within 1% went from 406 to 394: the later stage starts from an estimate that no earlier run
has corrected, runs out of memory in turn, and on a flat curve its bisection from the halving ends on a
plateau up to 1.7% short of the optimum (benchmarks/README.md, session 16).

A stage's mbs search is coarse (no fine pass) while the stages are compared: the fine pass, the few
bisections around a stage's best mbs that move its metric by a percent or two, runs once every stage
is decided, on the best stage only (:func:`~zerotune.strategy.mbs.refine_mbs`). A fine pass on a stage a
later one beats refines nothing the answer uses (on the SIMULATED clusters, 12 noise draws at 5% noise,
deferring it cut the GPU-hours from 0.84x to 0.78x DeepSpeed's, with answers within 1% of the optimum
from 266 to 286 of 432 and those under 0.97 from 46 to 43). Nothing here launches anything.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Callable, Sequence

from zerotune.core.objective import Objective
from zerotune.core.experiment import Status
from zerotune.strategy.mbs import (NEAR_CAPACITY, MbsTrace, Point, allowed_values, largest_within, refine_mbs,
                                   search_mbs, within_noise)


class StageDecision(str, enum.Enum):
    """How :func:`explore_stages` handled a ZeRO stage."""

    EXPLORED = "explored"  # a full mbs search
    PROBED = "probed"  # one experiment (at its own largest mbs, or the best stage's), not better
    PRUNED = "pruned"  # the memory model: cannot fit at the smallest mbs, never launched
    SKIPPED = "skipped"  # no larger mbs than the best, and a lower stage already slower at equal mbs


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
                   allowed: Sequence[int] | None = None, confirm: StageEvaluate | None = None,
                   precision: float | None = None) -> list[StageResult]:
    """Progressive ZeRO-stage exploration, lowest stage first (see the module docstring).

    Args:
        evaluate: ``evaluate(stage, [mbs, ...]) -> [Point, ...]``.
        plans: one per candidate stage, ascending, with the memory model's largest fitting mbs.
        lo, hi, objective, threshold, allowed, precision: as in :func:`search_mbs`.
        num_fine: experiments of the fine pass, run last on the best stage (module docstring).
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
    partitioned_lost = False  # a stage 1 or 2 probe at the best's mbs did not beat it
    queue: list[tuple[StagePlan, StageResult | None]] = [(plan, None) for plan in plans]
    deferred: dict[int, int] = {}  # stage -> the mbs of its first run, at its estimate, that ran out of memory
    while queue:
        plan, came_back = queue.pop(0)
        stage = plan.stage
        result = came_back or StageResult(stage, None, "", estimate=plan.max_mbs_estimate)
        if came_back is None:
            results.append(result)
        cap = deferred[stage] - 1 if came_back is not None and best is not None else hi
        note = f"its estimate mbs={deferred[stage]} ran out of memory, deferred; " if came_back is not None else ""
        if not values or plan.max_mbs_estimate < values[0]:
            result.decision, result.reason = StageDecision.PRUNED, f"memory model: mbs={lo} does not fit"
            continue
        if best is None and came_back is None and objective.higher_is_better:
            start = largest_within(values, plan.max_mbs_estimate)
            if start > values[0] and any(q.max_mbs_estimate > start for q, _ in queue):
                (first,) = evaluate(stage, [start])
                result.trace.points.append(first)
                if first.status is Status.OOM:  # deferred: a stage with more headroom goes first
                    deferred[stage] = start
                    queue.append((plan, result))
                    continue
        if best is not None:
            best_trace = next(r.trace for r in results if r.stage == best[0])
            own = largest_within(values, min(plan.max_mbs_estimate, cap))
            # headroom: this stage can run a larger mbs than the best stage ran at all (not merely than its
            # best mbs: where the best stage ran larger and was slower, a larger batch is no advantage)
            reach = max(p.mbs for p in best_trace.ok_points)
            headroom = own > reach
            if not headroom and slower_seen and came_back is None:  # a deferred stage is a lower one
                result.decision = StageDecision.SKIPPED
                result.reason = (f"cannot beat: a lower stage was already slower at the same mbs, and this one "
                                 f"reaches no larger mbs than {reach}")
                continue
            if not headroom and stage == 3 and (best[0] in (1, 2) or partitioned_lost):
                result.decision = StageDecision.SKIPPED
                result.reason = (f"cannot beat: it reaches no larger mbs than {reach}, and at equal mbs it is "
                                 f"stages 1-2's partitioned step plus parameter all-gathers (3 Psi per step against "
                                 f"2 Psi, ZeRO paper section 7.2); " + (f"ZeRO stage {best[0]} is the best"
                                 if best[0] in (1, 2) else "a stage 1-2 probe at that mbs did not beat the best"))
                continue
            probe_mbs = own if headroom else largest_within(values, min(best[1].mbs, own))
            (probe,) = evaluate(stage, [probe_mbs])
            result.trace.points.append(probe)
            if probe.status is Status.OOM:  # no evidence of slowness: probe below it
                # with headroom: halfway back to the best's mbs, then at it; else at equal mbs, the best
                # stage's largest runnable mbs below the probe
                halfway = [m for m in values if best[1].mbs < m <= (best[1].mbs + probe_mbs) // 2][-1:]
                below = [p.mbs for p in best_trace.ok_points if p.mbs < probe_mbs]
                retries = halfway + [best[1].mbs] if headroom else [max(below)] if below else []
                for retry in retries:
                    cap = probe_mbs - 1
                    probe_mbs = retry
                    (probe,) = evaluate(stage, [probe_mbs])
                    result.trace.points.append(probe)
                    if probe.status is not Status.OOM:
                        break
                else:
                    cap = probe_mbs - 1
            won = probe.ok and objective.better(probe.metric, best[1].metric)
            if (confirm is not None and probe.ok and (not won or not headroom)
                    and within_noise(objective.gain(probe.metric, best[1].metric), probe, best[1], threshold)):
                # one run decides nothing (a loss, or a win at equal mbs): re-measure the probe and the best,
                # then compare pooled: the best point itself, and the best stage's point at equal mbs where
                # it ran there (an OOM there is no point to re-measure); a lucky best is what a lost probe
                # most often meets, a lucky probe what a won one does
                at_same = best_trace.get(probe_mbs)
                refs = sorted({best[1].mbs} | ({probe_mbs} if at_same is not None and at_same.ok else set()))
                result.trace.update(confirm(stage, [probe_mbs]))
                best_trace.update(confirm(best[0], refs))
                probe, best = result.trace.get(probe_mbs), (best[0], best_trace.best(objective))
            if (headroom and probe.ok and not objective.better(probe.metric, best[1].metric)
                    and best[1].mbs < probe_mbs and result.trace.get(best[1].mbs) is None):
                # its own largest fitting mbs is at its memory boundary, where a device's caching allocator
                # flushes and retries (DeepSpeed warns of "pytorch allocator cache flushes"): a step there can
                # run slower than just below it, so the stage is probed again: where the probe ran near capacity,
                # at the largest mbs the memory model puts under it (still above the best's), else at the best's
                calm = [m for m in values if probe.calm_mbs is not None and best[1].mbs < m <= probe.calm_mbs
                        and m < probe_mbs and result.trace.get(m) is None]
                near = probe.memory_fraction is not None and probe.memory_fraction >= NEAR_CAPACITY
                probe_mbs = calm[-1] if near and calm else best[1].mbs
                (probe,) = evaluate(stage, [probe_mbs])
                result.trace.points.append(probe)
            if not (probe.ok and objective.better(probe.metric, best[1].metric)):
                result.decision = StageDecision.PROBED
                same = best_trace.get(probe_mbs) if probe.ok else None
                same = same if same is not None and same.ok else None
                reference = same or best[1]
                result.reason = (f"{note}probe at mbs={probe_mbs}: {probe.status.value} "
                                 f"{'' if probe.metric is None else f'{probe.metric:.4g} '}"
                                 f"not better than ZeRO stage {best[0]}'s {reference.metric:.4g} at "
                                 f"mbs={reference.mbs}")
                # evidence that higher stages are slower: measured slower than the best stage at the same
                # mbs by more than the plateau threshold (a tie is noise; an OOM or a failure says
                # nothing about speed, nor does a probe at another mbs)
                slower_seen = slower_seen or (same is not None
                                              and objective.gain(probe.metric, same.metric) <= -threshold)
                partitioned_lost = partitioned_lost or (stage in (1, 2) and same is not None)
                continue
            result.reason = f"{note}probe at mbs={probe_mbs} beat the best ({probe.metric:.4g} > {best[1].metric:.4g})"
        else:
            result.reason = (f"{note}searched: no other stage ran" if note else
                             "first stage searched: ZeRO stage " + ", ".join(map(str, deferred)) + " deferred"
                             if deferred else "first feasible stage")
        result.decision = StageDecision.EXPLORED
        result.trace = search_mbs(lambda ms, s=stage: evaluate(s, ms), lo=lo, hi=min(hi, cap),
                                  estimate=min(plan.max_mbs_estimate, cap), objective=objective, threshold=threshold,
                                  num_fine=0, known=result.trace.points, allowed=allowed,
                                  confirm=None if confirm is None else (lambda ms, s=stage: confirm(s, ms)),
                                  precision=precision)
        top = result.trace.best(objective)
        if top is not None and (best is None or objective.better(top.metric, best[1].metric)):
            best = (stage, top)
    if best is not None and num_fine > 0:  # the fine pass, only where the answer is (module docstring)
        top = next(r for r in results if r.stage == best[0])
        refine_mbs(lambda ms: evaluate(top.stage, ms), top.trace, lo=lo, hi=hi, objective=objective, num_fine=num_fine,
                   threshold=threshold, allowed=allowed, precision=precision)
    return results

