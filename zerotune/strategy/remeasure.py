"""The re-measurement policy before the answer: which configs get a second run, so the answer is not one lucky sample.

- Finalists (`confirm_answer`): configs within the noise of the best are re-measured until each has two ok runs, where
  another run can decide (`zerotune.core.noise.replica_decides`); one that the readings and the curve both put below
  the best (`below_on_the_curve`) is left out, and one within the precision is a tie, which no run breaks.
- The answer itself (`measure_answer_twice`) is reported on at least two runs with ``"fast": false``, and with
  ``"fast": true`` where its one run reads above its mbs neighbours by more than the noise (`answer_stands_out`).
Decisions: D102, D103, D307.
"""
from __future__ import annotations

import logging
import math

from zerotune.core.experiment import Experiment, ExperimentKind
from zerotune.core.noise import comparison_noise, replica_decides, tie
from zerotune.strategy.answer import Capacity, capacity
from zerotune.strategy.evaluation import PLATEAU_THRESHOLD, Evaluator
from zerotune.strategy.points import pooled_point
from zerotune.strategy.prediction import family_key

logger = logging.getLogger(__name__)

FINAL_MARGIN = 0.05
"""Before the answer, configs within the noise of the best, and within this fraction of it, are re-measured."""

FINAL_CANDIDATES = 2
"""At most this many configs (the best included) are re-measured before the answer."""


def confirm_answer(ev: Evaluator) -> None:
    """Re-measure the finalists until each has two ok runs: of the best `FINAL_CANDIDATES` configs, those whose
    difference from the best is within their `zerotune.core.noise.comparison_noise` and at most `FINAL_MARGIN`,
    where another run can decide (the run-to-run noise blocks, not the runs' own intervals, which steps narrow more
    cheaply than a launch). A finalist within the target precision is a tie, left to the tie order."""
    objective, ledger = ev.job.objective, ev.ledger
    pooled = ledger.pooled()
    bases = [e for e in ledger.experiments if e.replica_of is None and e.name in pooled]
    bases.sort(key=lambda e: pooled[e.name].value, reverse=objective.higher_is_better)
    if not bases:
        return
    top = bases[0]

    def within_noise_of_top(e: Experiment) -> bool:
        gain = objective.gain(pooled[e.name].value, pooled[top.name].value)
        noise = comparison_noise([e.metric_rel_half_width, top.metric_rel_half_width],
                                 [pooled[e.name].runs, pooled[top.name].runs], floor=PLATEAU_THRESHOLD,
                                 run_noise=ledger.run_noise.sigma)
        return abs(gain) <= min(noise, FINAL_MARGIN) and (e is top or not tie(gain, ev.precision))

    close = [e for e in bases[:FINAL_CANDIDATES] if within_noise_of_top(e) and not below_on_the_curve(ev, e, top)]
    todo = [e for e in close if pooled[e.name].runs < 2]
    sigma = ledger.run_noise.sigma
    blocked = [e for e in close if e is not top and replica_decides(
        objective.gain(pooled[e.name].value, pooled[top.name].value), pooled_point(e, pooled[e.name], sigma),
        pooled_point(top, pooled[top.name], sigma), PLATEAU_THRESHOLD, ev.precision)]
    if todo and blocked:
        logger.info(f"re-measuring {len(todo)} config(s) within the run-to-run noise of the best before the answer: "
                    + ", ".join(e.name for e in todo))
        ev.remeasure(todo)


def below_on_the_curve(ev: Evaluator, e: Experiment, top: Experiment) -> bool:
    """Whether ``e`` is ``top``'s config (stage, gas, knobs) at a smaller mbs, both run calm: throughput rises with
    mbs there and the readings agree, so re-measuring ``e`` could only move the answer against both. False on CPU
    ranks (no capacity) and for latency."""
    if not ev.job.objective.higher_is_better:
        return False
    return ((e.stage, e.gas, e.knobs) == (top.stage, top.gas, top.knobs) and e.mbs < top.mbs
            and all(capacity(ev.memory_fraction(x)) is Capacity.CALM for x in (e, top)))


def answer_stands_out(ev: Evaluator) -> bool:
    """Whether the answer, measured once, reads better than its mbs neighbours predict by more than the noise.

    The neighbours: the same config but its mbs (stage, gas, knobs, saver: `family_key`) run ok at the nearest
    smaller and larger mbs (at an end of the curve, the two nearest on its side). The prediction: the line through
    their pooled metrics at the answer's mbs, its noise `zerotune.core.noise.comparison_noise`'s terms of the answer
    and of each neighbour times its weight in the line. Throughput is smooth and concave in mbs away from the memory
    boundary, so a read above the line is more likely the winner's curse than a peak. False with fewer than two
    neighbours.
    """
    objective, ledger = ev.job.objective, ev.ledger
    pooled = ledger.pooled()
    answer = ledger.answer
    if answer is None or pooled[answer.name].runs >= 2:
        return False
    same = [e for e in ledger.experiments
            if e.replica_of is None and e.name in pooled and e.kind is not ExperimentKind.PROFILE
            and family_key(e.ds_config) == family_key(answer.ds_config) and e.mbs != answer.mbs]
    below = sorted((e for e in same if e.mbs < answer.mbs), key=lambda e: -e.mbs)
    above = sorted((e for e in same if e.mbs > answer.mbs), key=lambda e: e.mbs)
    pair = below[:1] + above[:1] if below and above else (below or above)[:2]
    if len(pair) < 2:
        return False
    (a, va), (b, vb) = ((e, pooled[e.name].value) for e in pair)
    w = (answer.mbs - a.mbs) / (b.mbs - a.mbs)  # the line: (1 - w) * va + w * vb
    reference = (1 - w) * va + w * vb
    if reference <= 0:
        return False

    def term(hw: float | None, runs: int) -> float:
        return comparison_noise([hw], [runs], floor=PLATEAU_THRESHOLD, run_noise=ledger.run_noise.sigma) ** 2

    noise = math.sqrt(term(answer.metric_rel_half_width, 1) + (1 - w) ** 2 * term(a.metric_rel_half_width,
                      pooled[a.name].runs) + w ** 2 * term(b.metric_rel_half_width, pooled[b.name].runs))
    gain = objective.gain(pooled[answer.name].value, reference)
    if gain <= noise:
        return False
    logger.info(f"the answer {answer.name} reads {gain:.1%} better than mbs {a.mbs} and {b.mbs} predict "
                f"({reference:.4g} on the line through them), beyond the noise ({noise:.1%}): the best of many "
                f"runs reads high, so it is measured again")
    return True


def measure_answer_twice(ev: Evaluator) -> None:
    """Report the answer on at least two runs: re-measure it while it has one ok run, then any one-run config the
    pooled metric puts first (at most `FINAL_CANDIDATES` configs). One run's interval misses the run-to-run noise,
    and the answer is the run that read highest among many (the winner's curse)."""
    for _ in range(FINAL_CANDIDATES):
        answer = ev.ledger.answer
        if answer is None or ev.pooled(answer.name).runs >= 2:
            return
        logger.info(f"re-measuring the answer {answer.name}: one run does not show the run-to-run noise")
        ev.remeasure([answer])
