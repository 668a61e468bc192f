"""The gas phase: gradient accumulation at the best stage's best mbs, where the batch semantics search it.

At the best stage's best mbs ``m`` (`zerotune.inputs.batch`): first ``m``'s global batch split in two (``m // 2`` at
twice the gas), then the config's list of gas values at ``m``, or a doubling ladder within ``max_train_batch_size``
that stops at a plateau or a failure. A run is skipped where it cannot pay: the split without a measured point that
makes it worth a run (`GasPhase.split_evidence`), the split or a rung where doubling the gas amortizes too little
(`GasPhase.split_cannot_pay`, `GasPhase.rung_cannot_pay`). A rung is a larger global batch, which changes the
training itself: only its win is re-measured (`GasPhase.candidate`). Decisions: D7, D13, D16, D17.
"""
from __future__ import annotations

import logging

from zerotune.core.experiment import Experiment, Status
from zerotune.core.noise import replica_decides, within_noise
from zerotune.inputs.batch import doubling_gain_bound
from zerotune.strategy.evaluation import PLATEAU_THRESHOLD, Evaluator
from zerotune.strategy.knobs import knob_stages
from zerotune.strategy.points import Point, pooled_point
from zerotune.strategy.result import StageResult

logger = logging.getLogger(__name__)


class GasPhase:
    """One gas phase over the explored ``stages``; `run` returns the (mbs, gas) that beat the best stage's search."""

    def __init__(self, ev: Evaluator, stages: list[StageResult]):
        self.ev = ev
        self.stages = stages
        self.best_batch: dict[int | str, tuple[int, int]] = {}  # StageResult.key -> (mbs, gas)
        self.top: StageResult | None = None  # the stage (and saver) the phase runs on

    def run(self) -> dict[int | str, tuple[int, int]]:
        """Run the phase (the module docstring) and return `best_batch`."""
        ev, batch = self.ev, self.ev.job.batch
        tops = knob_stages(self.stages, ev.job.objective)[:1]
        if not tops:
            return self.best_batch
        self.top, point = tops[0]
        stage = self.top.stage
        split = batch.gas_split(point.mbs, lo=ev.job.min_mbs)
        ladder = batch.gas_ladder(point.mbs)
        if split or ladder:
            logger.info(f"gas phase {self.top.label} at mbs={point.mbs}: "
                        + "; ".join(([f"mbs {split[0]} at gas {split[1]} (the same global batch)"] if split else [])
                                    + ([f"gas {ladder}"] if ladder else [])))
        evidence = self.split_evidence(stage, split[0], point) if split else None
        if split and evidence is None:
            logger.info(f"gas phase: mbs {split[0]} at gas {split[1]} not tried: no mbs from {split[0]} up to "
                        f"{point.mbs} measured within the noise of mbs {point.mbs} (the throughput still climbs "
                        f"there)")
            split = None
        if split and self.split_cannot_pay(stage, *split, evidence):
            split = None
        best = ev.ledger[self._experiment(stage, point.mbs).name]  # the mbs search's best config
        if split:
            best, _ = self.candidate(stage, *split, best)
        for gas in ladder:
            base = ev.ledger.get(self._experiment(stage, point.mbs, gas // 2).name)
            if batch.gas_doubling and base is not None and self.rung_cannot_pay(base, gas):
                break
            best, gain = self.candidate(stage, point.mbs, gas, best, larger_batch=True)
            if batch.gas_doubling and (gain is None or gain < PLATEAU_THRESHOLD):
                break
        return self.best_batch

    def _experiment(self, stage: int, mbs: int, gas: int | None = None) -> Experiment:
        return self.ev.builder.mbs_experiment(stage, mbs, gas, settings=self.top.settings if self.top else None)

    def split_evidence(self, stage: int, half: int, point: Point) -> Point | None:
        """The measured point that makes the split worth a run, or None: the smallest in ``[half, point.mbs)`` no
        faster than ``point`` or tied with it within the runs' noise. With throughput rising with mbs, it bounds the
        split's micro-batches from above; without one the smaller micro-batch is the slower one."""
        objective = self.ev.job.objective
        trace = self.top.trace if self.top is not None else next(r.trace for r in self.stages if r.stage == stage)
        between = [p for p in trace.ok_points if half <= p.mbs < point.mbs]
        bound = min(between, key=lambda p: p.mbs, default=None)
        if bound is not None and (not objective.better(point.metric, bound.metric) or within_noise(
                objective.gain(bound.metric, point.metric), bound, point, PLATEAU_THRESHOLD)):
            return bound
        return None

    def split_cannot_pay(self, stage: int, half: int, gas: int, evidence: Point) -> bool:
        """Whether the split (``half`` at ``gas``) is not worth a run: its micro-batches are no faster than
        ``evidence``, and doubling the gas gains under `PLATEAU_THRESHOLD` (`bound_under_threshold`) on a once-per-step
        share at most ``evidence``'s times ``evidence.mbs / half`` (the once-per-step time is the same, and a
        micro-step's time falls no faster than its mbs)."""
        base = self.ev.ledger.get(self._experiment(stage, evidence.mbs).name)
        share = self.boundary_share(base) if base is not None else None
        share = None if share is None else min(1.0, share * evidence.mbs / half)
        bound = self.bound_under_threshold(share, base)
        if bound is None:
            return False
        logger.info(f"gas phase: mbs {half} at gas {gas} not tried: the mbs search measured mbs {evidence.mbs} "
                    f"no faster than the best, and twice the gas at mbs {half} gains at most {bound:.2%} (at most "
                    f"{share:.1%} of its step once per optimizer step), under the {PLATEAU_THRESHOLD:.0%} plateau "
                    f"threshold")
        return True

    def rung_cannot_pay(self, base: Experiment, gas: int) -> bool:
        """Whether the rung at ``gas`` is not worth a run: doubling from ``base`` (the same config at half that gas)
        gains under `PLATEAU_THRESHOLD` (`bound_under_threshold`), so it would end the ladder as a plateau anyway."""
        share = self.boundary_share(base)
        bound = self.bound_under_threshold(share, base)
        if bound is None:
            return False
        logger.info(f"gas phase: gas {gas} not tried: {base.name} spends {share:.1%} of its step in the work done "
                    f"once per optimizer step (optimizer step, boundary gradient reduction), so doubling gas gains "
                    f"at most {bound:.2%}, under the {PLATEAU_THRESHOLD:.0%} plateau threshold")
        return True

    def bound_under_threshold(self, share: float | None, base: Experiment | None) -> float | None:
        """`zerotune.inputs.batch.doubling_gain_bound` of ``share`` for ``base``'s config where
        throughput is tuned and the bound is under `PLATEAU_THRESHOLD`; else None."""
        if base is None or not self.ev.job.objective.higher_is_better:
            return None
        bound = doubling_gain_bound(share, base.ds_config)
        return bound if bound is not None and bound < PLATEAU_THRESHOLD else None

    def boundary_share(self, exp: Experiment) -> float | None:
        """The mean share of ``exp``'s step its runs spent once per optimizer step (``boundary_s``); None: unknown."""
        shares = [e.boundary_share for e in self.ev.ledger.runs_of(exp.name) if e.boundary_share is not None]
        return sum(shares) / len(shares) if shares else None

    def candidate(self, stage: int, mbs: int, gas: int, best: Experiment,
                  larger_batch: bool = False) -> tuple[Experiment, float | None]:
        """Run ``mbs`` at ``gas`` for ``stage`` against the phase's ``best``; (the better of the two, the candidate's
        gain over ``best`` on their pooled metrics; None: it did not run ok). A win is recorded in `best_batch`.

        A difference another run can decide (`_compare`) is re-measured on its one-run sides first. With
        ``larger_batch`` (a ladder rung) only a win is re-measured, and the run races ``best``'s own metric, not its
        pessimistic bound.
        """
        ev = self.ev
        bar = ev.pooled(best.name).value if larger_batch else None
        (exp,) = ev.evaluate([self._experiment(stage, mbs, gas)], bar=bar)
        if exp.status != Status.OK or exp.metric is None:
            return best, None
        gain, single = self._compare(exp, best)
        if single and not (larger_batch and gain <= 0):  # one run decides nothing within the noise
            ev.remeasure(single)
            gain, _ = self._compare(exp, best)
        if gain > 0:
            self.best_batch[self.top.key if self.top is not None else stage] = (mbs, gas)
            return exp, gain
        return best, gain

    def _compare(self, exp: Experiment, best: Experiment) -> tuple[float, list[Experiment]]:
        """(``exp``'s gain over ``best`` on their pooled metrics, the one-run sides to re-measure first: those of a
        difference another run can decide (`zerotune.core.noise.replica_decides`); else none)."""
        ev = self.ev
        pooled = ev.ledger.pooled()
        a, b = pooled[exp.name], pooled[best.name]
        points = [pooled_point(e, p, ev.ledger.run_noise.sigma) for e, p in ((exp, a), (best, b))]
        gain = ev.job.objective.gain(a.value, b.value)
        single = [e for e, p in ((exp, a), (best, b)) if p.runs < 2]
        decide = replica_decides(gain, *points, PLATEAU_THRESHOLD, ev.precision)
        return gain, single if decide else []
