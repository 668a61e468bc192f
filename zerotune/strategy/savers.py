"""The savers phase: bf16 states, AutoTP, Ulysses, checkpointing and offload, where memory binds a stage (D109, D333-6).

A saver (`savers_for`) trades work, communication or numerics for memory and pays through the larger mbs it lets fit
(bf16 states, whose optimizer step is faster, are also probed at the best mbs: `SaverPhase._states_at_best`). Once the
stages are explored, `SaverPhase.run` visits the best stage where its best point is its largest runnable mbs below the
largest allowed, and every stage with no run: each stage's savers cheapest first, by the rules of `SaverPhase._visit`
(``--no-savers``: none). A visited saver is a `StageResult` with a ``saver``; the gas and knob phases run on the best
stage with it.
"""
from __future__ import annotations

import logging
from typing import Sequence

from zerotune.core.errors import ConfigError
from zerotune.core.experiment import Status
from zerotune.core.noise import can_beat
from zerotune.deepspeed.keys import CHECKPOINTING, ZERO
from zerotune.model.throughput import bounds
from zerotune.strategy.evaluation import Evaluator
from zerotune.strategy.partial_offload import partial_offload
from zerotune.strategy.points import SearchBounds, largest_within
from zerotune.strategy.prediction import family_key, readings
from zerotune.strategy.result import Saver, StageDecision, StageResult
from zerotune.strategy.variants import VariantEvaluate, VariantExplorer
from zerotune.strategy.zeropp import hierarchical_partition

__all__ = ["BF16_STATES", "SaverPhase", "bf16_states_apply", "savers_for"]

logger = logging.getLogger(__name__)

_CHECKPOINTING = {CHECKPOINTING: True}
BF16_STATES = Saver("bf16 states", {"bf16": {"bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}})
"""Master weights, gradients and Adam's states in bf16 (DeepSpeed's ``bf16`` keys, ZeRO 1-3): up to 8 bytes per
parameter less, no work added, and a numerics change only ``autotuning.allow_reduced_precision_states`` opts into."""


def savers_for(stage: int, checkpointing: bool, nvme_path: str | None = None, host: bool = True,
               bf16_states: bool = False, autotp: Sequence[int] = (), sp: Sequence[int] = ()) -> list[Saver]:
    """The memory savers of a ZeRO stage, cheapest first: `BF16_STATES` (with ``bf16_states``, stages 1-3), AutoTP
    at each degree of ``autotp`` (``tensor_parallel.autotp_size``, stages 0-2, D334) and that with bf16 states,
    Ulysses at each degree of ``sp`` (``sequence_parallel_size``, D336), checkpointing (where the job tunes it),
    offloading the optimizer to the host (stages 1-3; not with ``host`` False, on CPU ranks, where the host is the
    rank), that with checkpointing, offloading the parameters too (stage 3), and that with checkpointing; then, with
    ``nvme_path``, the same offloads to NVMe (launched only where the host cannot hold what they move:
    `SaverPhase`)."""
    out = [BF16_STATES] if bf16_states and stage >= 1 else []
    for t in autotp if stage <= 2 else ():
        out.append(Saver(f"autotp {t}", {"tensor_parallel": {"autotp_size": t}}))
        if bf16_states and stage >= 1:
            out.append(Saver(f"autotp {t} + bf16 states", {"tensor_parallel": {"autotp_size": t},
                                                          **BF16_STATES.settings}))
    out += [Saver(f"sp {d}", {"sequence_parallel_size": d}) for d in sp]
    out += [Saver("checkpointing", dict(_CHECKPOINTING))] if checkpointing else []
    for device in ("cpu",) * host + ("nvme",) * bool(nvme_path):
        where = {"device": device, **({"nvme_path": nvme_path} if device == "nvme" else {})}
        suffix = "" if device == "cpu" else " (nvme)"
        offloads = ([("offload optimizer", {ZERO: {"offload_optimizer": where}})] if stage >= 1 else []) + (
            [("offload optimizer+params", {ZERO: {"offload_optimizer": where, "offload_param": dict(where)}})]
            if stage == 3 else [])
        for name, settings in offloads:
            out.append(Saver(name + suffix, settings))
            if checkpointing:
                out.append(Saver(f"checkpointing + {name}{suffix}", {**_CHECKPOINTING, **settings}))
    return out


def bf16_states_apply(user_config: dict) -> bool:
    """Whether `BF16_STATES` can go on ``user_config``: its ``bf16`` section is enabled (the ``bfloat16`` alias and
    fp16 are left alone) and it offloads no optimizer (DeepSpeed then asks for a CPU Adam built for bf16 states)."""
    bf16, zero = user_config.get("bf16"), user_config.get(ZERO)
    offload = zero.get("offload_optimizer") if isinstance(zero, dict) else None
    return (isinstance(bf16, dict) and bf16.get("enabled") in (True, "auto")
            and not (isinstance(offload, dict) and offload.get("device") not in (None, "none")))


def _degrees(saver: Saver | None) -> tuple[int | None, int | None]:
    """The AutoTP and Ulysses degrees ``saver`` sets (None: it sets none, the config's own): an mbs holds other
    samples per rank at another degree, so mbs are compared only at the same degrees."""
    if saver is None:
        return None, None
    return saver.settings.get("tensor_parallel", {}).get("autotp_size"), saver.settings.get("sequence_parallel_size")


class SaverPhase(VariantExplorer):
    """One savers phase over the evaluator ``ev``'s result: the saver policy over the shared variant steps
    (`zerotune.strategy.variants.VariantExplorer`, whose ``evaluate``, ``bounds`` and ``confirm`` it takes)."""

    def __init__(self, ev: Evaluator, evaluate: VariantEvaluate, bounds: SearchBounds,
                 confirm: VariantEvaluate | None = None):
        super().__init__(evaluate, bounds, confirm)
        self.ev = ev

    def run(self) -> None:
        """Visit the savers of each stage that memory binds (the module docstring)."""
        ev, stages = self.ev, self.ev.result.stages
        if ev.result.memory is None or not self.values:
            return
        for r in stages:
            self.improve(r)
        notes = ev.result.savers_notes
        if not ev.job.savers:
            notes.append("memory savers (activation checkpointing, offload): off (--no-savers)" + "".join(
                f"; tensor_parallel.autotp_size {t}: not tried (a saver)" for t in ev.job.autotp_degrees) + "".join(
                f"; sequence_parallel_size {d}: not tried (a saver)" for d in ev.job.sp_degrees))
            return
        if ev.job.cpu:
            notes.append("offload to the host: not tried on CPU ranks (the host is the rank: what it moves stays in "
                         "the rank's budget)")
        bound = [r for r in list(stages) if r.saver is None and self._memory_bound(r)]
        if not bound:
            notes.append("memory savers (activation checkpointing, offload): not tried: memory binds no stage (the "
                         "best stage's best mbs is below its largest runnable one or at the largest allowed, and "
                         "every stage without a run was skipped by the stage rules)")
        won, allowed = False, ev.job.autotuning.allow_reduced_precision_states
        bf16 = bf16_states_apply(ev.job.user_config)
        if bf16 and not allowed:
            self._bf16_note([r for r in bound if r.stage >= 1])
        top = self.best.result if self.best is not None else None
        if bf16 and allowed and top is not None and top not in bound and top.stage >= 1 and top.saver is None:
            won = self._states_at_best(top)
        for plain in bound:
            for saver in savers_for(plain.stage, ev.job.checkpointing, ev.job.nvme_path, host=not ev.job.cpu,
                                    bf16_states=bf16 and allowed, autotp=ev.job.autotp_degrees,
                                    sp=ev.job.sp_degrees):
                won = self._visit(plain, saver) or won
        won = partial_offload(ev, self.best, self.bounds.hi, self.at_best) or won
        won = hierarchical_partition(ev, self.best, self.at_best) or won
        if won:
            self.refine()

    def _bf16_note(self, bound: list[StageResult]) -> None:
        """Say where `BF16_STATES` would have let a larger mbs fit than the stage's own largest, by the memory model,
        without trying it (not opted into)."""
        ev, lo = self.ev, self.bounds.lo
        for plain in bound:
            try:
                est = ev.result.memory.max_mbs(ev.builder.config(plain.stage, lo, BF16_STATES.settings),
                                               ev.job.device_memory_bytes, cap=self.bounds.hi)
            except ConfigError:
                continue
            own = largest_within(self.values, est) if est >= lo else None
            if own is not None and own > largest_within(self.values, max(plain.estimate, lo - 1)):
                ev.result.savers_notes.append(
                    f"bf16 states (bf16_master_weights_and_grads, bf16_optimizer_states): not tried at ZeRO stage "
                    f"{plain.stage}, where the memory model fits mbs={own} with them (without: "
                    f"{plain.estimate if plain.estimate >= lo else 'none'}); they change the numerics: "
                    f"autotuning.allow_reduced_precision_states: true lets zerotune try them")

    def _states_at_best(self, plain: StageResult) -> bool:
        """`BF16_STATES` on the best stage where memory does not bind it: they also halve the optimizer step's bytes,
        so they are probed at the best mbs (`at_best`); True when they became the best."""
        return self.at_best(plain.stage, BF16_STATES, "memory binds no stage; a faster optimizer step: probed at the "
                                                      "best mbs={mbs} (memory model: largest mbs {est}); ")

    def at_best(self, stage: int, saver: Saver, lead: str) -> bool:
        """Probe ``saver`` on ``stage`` at the best mbs, searched where it beats the best (one launch where it does
        not); ``lead`` opens its reason, with ``{mbs}`` and ``{est}`` (the memory model's largest mbs) filled in. True
        when it became the best."""
        ev, mbs = self.ev, self.best.point.mbs
        try:
            config = ev.builder.config(stage, mbs, saver.settings)
        except ConfigError as e:
            logger.info(f"savers: ZeRO stage {stage} + {saver.name}: not valid here ({e})")
            return False
        est = ev.result.memory.max_mbs(config, ev.job.device_memory_bytes, cap=self.bounds.hi)
        result = StageResult(stage, None, "", estimate=est, saver=saver)
        ev.result.stages.append(result)
        lead = lead.format(mbs=mbs, est=est)
        probe = self.probe(result, mbs)
        if probe.status is Status.SKIPPED:
            self.skip(result, mbs, lead)
            return self._logged(result)
        if probe.status is not Status.OK or not self.beats(probe):
            self.lose(result, probe, mbs, lead, f", not better than {self.best.result.label}'s "
                                                f"{self.best.point.metric:.4g} at mbs={mbs}")
            return self._logged(result)
        result.reason = f"{lead}beat the best ({probe.metric:.4g} > {self.best.point.metric:.4g})"
        won = self.search(result, self.bounds.hi)
        self._logged(result)
        return won

    def _memory_bound(self, r: StageResult) -> bool:
        """Whether memory, not a plateau, limits stage ``r``: no run of it ran ok (pruned, out of memory), or it is
        the best stage and its best point is its largest runnable mbs, below the largest allowed."""
        ok = r.trace.ok_points
        if not ok:
            return r.decision is not StageDecision.SKIPPED
        top = r.trace.best(self.objective)
        return (self.best is not None and r is self.best.result and top is not None
                and top.mbs == max(p.mbs for p in ok) and top.mbs < self.values[-1])

    def _visit(self, plain: StageResult, saver: Saver) -> bool:
        """Decide one stage with one saver; True when it became the best. In order, the saver is:

        1. Pruned where the memory model fits no mbs, or the host cannot hold what it offloads.
        2. Skipped where its largest fitting mbs is no larger than what ran (`_reach`) or than a cheaper saver's.
        3. Skipped where the stage's runs without it bound it below the best plus the precision (`_bounded`).
        4. Probed at its largest fitting mbs (`_probe`), searched where it beats the best by over the precision or
           nothing ran at all.
        """
        ev, stage, lo = self.ev, plain.stage, self.bounds.lo
        try:
            config = ev.builder.config(stage, lo, saver.settings)
        except ConfigError as e:
            logger.info(f"savers: ZeRO stage {stage} + {saver.name}: not valid here ({e})")
            return False
        if ev.builder.name(config) == ev.builder.name(ev.builder.config(stage, lo)):
            return False  # the user's config already holds it
        memory = ev.result.memory
        host_ok = ev.host_fits(config)
        est = memory.max_mbs(config, ev.job.device_memory_bytes, cap=self.bounds.hi) if host_ok else lo - 1
        result = StageResult(stage, None, "", estimate=est, saver=saver)
        ev.result.stages.append(result)
        now = memory.max_mbs(ev.builder.config(stage, lo), ev.job.device_memory_bytes, cap=self.bounds.hi)
        plain_est = f"{now}" if now >= lo else "none"  # the fit as it stands, not the stage's first estimate
        predicted = f"memory model: largest mbs {est} (without it: {plain_est})"
        if est < lo:
            result.decision = StageDecision.PRUNED
            result.reason = (f"memory model: mbs={lo} does not fit" if host_ok else
                             "memory model: the host memory cannot hold what it offloads")
            return self._logged(result)
        own, degrees = largest_within(self.values, est), _degrees(saver)
        reach = self._reach(stage, degrees)
        if own <= reach:
            result.decision = StageDecision.SKIPPED
            result.reason = (f"{predicted}: no larger than mbs={reach}, which already ran; a saver adds work per "
                             f"sample and pays only through a larger micro-batch")
            return self._logged(result)
        cheaper = [r for r in ev.result.stages if r.stage == stage and r.saver is not None and r is not result
                   and r.decision is not StageDecision.PRUNED and largest_within(self.values, r.estimate) >= own
                   and _degrees(r.saver) == degrees]
        if cheaper:
            result.decision = StageDecision.SKIPPED
            result.reason = (f"{predicted}: no larger than {cheaper[0].saver.name}'s mbs="
                             f"{largest_within(self.values, cheaper[0].estimate)}, which costs less")
            return self._logged(result)
        cannot = self._bounded(plain, own) if degrees == (None, None) else None  # TP, SP: other work per sample
        if cannot is not None:
            result.decision, result.reason = StageDecision.SKIPPED, f"{predicted}; {cannot}"
            return self._logged(result)
        return self._probe(result, predicted, own, reach)

    def _probe(self, result: StageResult, predicted: str, own: int, reach: int) -> bool:
        """Probe a saver at its largest fitting mbs ``own`` (after an OOM, once more halfway back to ``reach``) and
        decide it by `_visit`'s rule 4; True when it became the best."""
        probe_mbs, probe, cap = own, self.probe(result, own), self.bounds.hi
        if probe.status.over_budget:
            probe_mbs, probe, cap = self.retry_below(result, probe, own, self.halfway(reach, own))
        best = self.best
        if probe.status is Status.SKIPPED:
            self.skip(result, probe_mbs, f"{predicted}; ")
            return self._logged(result)
        if not self.beats(probe):
            than = (f", not better than {best.result.label}'s {best.point.metric:.4g} at mbs={best.point.mbs}"
                    if best is not None else "")
            self.lose(result, probe, probe_mbs, f"{predicted}; ", than)
            return self._logged(result)
        result.reason = (f"{predicted}; probe at mbs={probe_mbs} beat the best ({probe.metric:.4g} > "
                         f"{best.point.metric:.4g}, {best.result.label})" if best is not None else
                         f"{predicted}; searched: no config without a saver ran")
        won = self.search(result, cap)
        self._logged(result)
        return won

    def _reach(self, stage: int, degrees: tuple[int | None, int | None] = (None, None)) -> int:
        """The largest mbs that ran ok in the best variant or in any variant of ``stage`` (``lo - 1``: none), among
        those of AutoTP and Ulysses ``degrees`` (`_degrees`; None: the config's own)."""
        runs = [p.mbs for r in self.ev.result.stages
                if ((self.best is not None and r is self.best.result) or r.stage == stage)
                and _degrees(r.saver) == degrees
                for p in r.trace.ok_points]
        return max(runs, default=self.bounds.lo - 1)

    def _bounded(self, plain: StageResult, mbs: int) -> str | None:
        """Why the stage's own runs without a saver rule a saver at ``mbs`` out (`_visit`'s rule 3); None: they
        do not (no best, no such runs, or a bound that can beat the best)."""
        ev = self.ev
        if self.best is None or not self.objective.higher_is_better:
            return None
        best = self.best.point
        families = readings(ev.ledger, ev.job.capacity_bytes)
        own = families.get(family_key(ev.builder.config(plain.stage, self.bounds.lo)))
        b = bounds(own, mbs) if own else None
        if b is None or can_beat(b.high, best.metric, self.bounds.precision):
            return None
        return (f"cannot beat: its stage's {len(own)} run(s) without it bound mbs={mbs} at {b.high:.4g} samples/s "
                f"(affine step time), and a saver only adds work; the best is {best.metric:.4g} "
                f"({self.best.result.label}, mbs={best.mbs}), precision {self.bounds.precision:.0%}")

    @staticmethod
    def _logged(result: StageResult) -> bool:
        logger.info(f"{result.label}: {result.decision.value} ({result.reason})")
        return False
