"""The knob phase (``"fast": false``): each knob stage's tuning space walked by the configured tuner.

The knob stages (`knob_stages`) are each walked at their best mbs (and gas, where the gas phase found a better one).
The space (`zerotune.inputs.configs.ConfigBuilder.knob_space`) is asked of the tuner in batches as large as the slots
can run at once; configs that already ran (the mbs phase's own config) are told, not run again.
"""
from __future__ import annotations

import logging
from typing import Sequence

from zerotune.core.experiment import ExperimentKind
from zerotune.core.objective import Objective
from zerotune.strategy.evaluation import Evaluator
from zerotune.strategy.points import Point
from zerotune.strategy.result import KnobPhase, StageDecision, StageResult
from zerotune.strategy.tuners import make_tuner

logger = logging.getLogger(__name__)

KNOB_STAGE_MARGIN = 0.05
"""A second stage's knobs are tuned too when its best metric is within this fraction of the best."""


def knob_stages(stages: Sequence[StageResult], objective: Objective) -> list[tuple[StageResult, Point]]:
    """Stages (each with its memory saver, if any) whose knobs are tuned, with their best point: the best explored
    stage, and the next best when within `KNOB_STAGE_MARGIN` of it. The first is the gas phase's stage too."""
    tops = [(r, r.trace.best(objective)) for r in stages if r.decision is StageDecision.EXPLORED]
    tops = [(s, p) for s, p in tops if p is not None]
    if not tops:
        return []
    tops.sort(key=lambda sp: sp[1].metric, reverse=objective.higher_is_better)
    best = tops[0][1].metric
    return [tops[0]] + [(s, p) for s, p in tops[1:2] if abs(objective.gain(p.metric, best)) <= KNOB_STAGE_MARGIN]


def tune_knobs(ev: Evaluator, parallel: int, best_batch: dict[int | str, tuple[int, int]]) -> None:
    """Walk each knob stage's space, at its (mbs, gas) in ``best_batch`` (by `StageResult.key`) where there is one;
    record each phase in the result's ``knob_phases``."""
    job, memory = ev.job, ev.result.memory
    at = job.autotuning
    fits = None if memory is None else (lambda c: memory.fits(c, job.device_memory_bytes) and ev.host_fits(c))
    for top, point in knob_stages(ev.result.stages, job.objective):
        stage = top.stage
        mbs, gas = best_batch.get(top.key, (point.mbs, None))
        candidates = ev.builder.knob_space(stage, mbs, fits, gas=gas, settings=top.settings)
        fitting = sum(c.fits for c in candidates)
        ev.result.knob_phases.append(KnobPhase(stage, mbs, len(candidates), fitting))
        logger.info(f"knob phase {top.label} at mbs={mbs}" + (f", gas={gas}" if gas else "")
                    + f": {len(candidates)} configs, {fitting} fit the "
                    f"memory model; tuner {at.tuner_type}, at most {at.tuner_num_trials} trials")
        tuner = make_tuner(at.tuner_type, candidates, objective=job.objective, num_trials=at.tuner_num_trials,
                           early_stopping=at.tuner_early_stopping)
        for c in candidates:  # configs that already ran (the mbs phase's own config): told, not run again
            if c.name in ev.ledger:
                done = ev.ledger[c.name]
                tuner.tell(c.name, done.status, done.metric)
        while batch := tuner.ask(parallel):
            exps = [ev.builder.experiment(c.ds_config, ExperimentKind.KNOBS, knobs=c.knobs) for c in batch]
            for c, exp in zip(batch, ev.evaluate(exps)):
                tuner.tell(c.name, exp.status, exp.metric)
