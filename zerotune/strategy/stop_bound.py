"""The bound on a budget-stopped answer: what the tuning did not decide, and by how much its answer could be beaten.

The answer ``A`` reads ``v_A`` within ``h_A``, relative at 95% (`zerotune.strategy.ledger.Ledger.half_width`). A config
``C`` that ran ok could beat it by ``g + sqrt(h_A ** 2 + h_C ** 2)``, ``g`` the gain of ``v_C`` over ``v_A``; one left
unmeasured, throughput only, by ``high / (v_A * (1 - h_A)) - 1``, ``high`` the throughput model's upper bound in
samples/s (`_model_bound`). Left: each undecided ZeRO stage's largest open mbs, the experiments the budget cut, the
later phases (`_left_configs`). The answer could be beaten by the largest figure (0 if none is positive); what the
model does not bound (on CPU ranks an mbs not above its runs, the knob phase, latency) is listed as such (D104, D310).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

from zerotune.core.experiment import Experiment, ExperimentKind, Status
from zerotune.inputs.configs import ConfigBuilder
from zerotune.inputs.job import Job
from zerotune.model.throughput import Reading
from zerotune.strategy.ledger import Ledger
from zerotune.strategy.prediction import GATED_KINDS, model_bounds, readings, roofline

DECIDED = (Status.OK, Status.OOM, Status.REFUSED, Status.FAILED, Status.TIMEOUT)
"""The outcomes that decide an mbs of a stage (a skipped one was only predicted, so it stays open)."""


@dataclass(frozen=True)
class Left:
    """What a budget stop left undecided: the ZeRO ``stages`` whose mbs search was not decided, the later ``phases``
    (memory savers, gas, knobs) with the kind of experiment each runs, the experiments the budget ``cut``
    (`BudgetSpent.cut`), ``fit`` (stage -> the memory model's largest mbs within the budget; under the smallest: the
    stage is pruned) and the ascending mbs ``values`` a search may try."""

    stages: Sequence[int]
    phases: Sequence[tuple[str, ExperimentKind]]
    cut: Sequence[Experiment]
    fit: Callable[[int], int]
    values: Sequence[int]


@dataclass(frozen=True)
class Contender:
    """A config that might beat the answer (``name``: a later phase's, where the roofline alone bounds it).
    ``low``, ``high`` are its 95% interval when measured, else the throughput model's bounds (the objective's unit);
    ``beats_by`` the most it could truly beat the answer by, relative (the module's formulas; under 0: it cannot);
    ``source`` how it is known (its runs, or where the model's bound came from)."""

    name: str
    low: float
    high: float
    beats_by: float
    source: str


@dataclass(frozen=True)
class StopBound:
    """What a budget-stopped tuning did not decide and by how much its answer could be beaten.

    Attributes:
        answer, value, half_width: the answer, its pooled metric and that metric's relative 95% half-width.
        precision: the target precision (relative), for the finalists left unconfirmed.
        undecided: one line per stage with mbs values not run, and per later phase not decided.
        measured, unmeasured: the contenders, largest ``beats_by`` first.
        unbounded, unbounded_why: what the throughput model does not bound, and why ("" when it bounds all).
    """

    answer: str
    value: float
    half_width: float
    unit: str
    precision: float | None
    undecided: tuple[str, ...]
    measured: tuple[Contender, ...]
    unmeasured: tuple[Contender, ...]
    unbounded: tuple[str, ...]
    unbounded_why: str = ""

    @property
    def beaten_by(self) -> float:
        """The most a bounded config could truly beat the answer by, relative (0 when none could)."""
        return max([0.0] + [c.beats_by for c in self.measured[:1] + self.unmeasured[:1]])

    @property
    def unconfirmed(self) -> list[Contender]:
        """The measured configs that could beat the answer by more than the precision (or at all, without one)."""
        return [c for c in self.measured if c.beats_by > (self.precision or 0.0)]

    def describe(self) -> list[str]:
        """The summary's lines: what was not decided, the bound and its two parts, what nothing bounds."""
        finalists = ", ".join(c.name for c in self.unconfirmed) or "none"
        lines = [f"not decided: {'; '.join(self.undecided) or 'every stage and later phase ran'}; measured configs "
                 f"that could still beat the answer by more than the precision, not re-measured: {finalists}"]
        best = (f"a measured config by at most {_figure(self.measured[0], self.unit)}" if self.measured
                else "no other config ran ok")
        best += (f"; an unmeasured one by at most {_figure(self.unmeasured[0], self.unit)}" if self.unmeasured
                 else "; no unmeasured config is bounded")
        lines.append(f"what ran or the throughput model bounds could beat the answer by at most {self.beaten_by:.1%}: "
                     f"{self.answer} reads "
                     f"{self.value:.4g} {self.unit} ±{self.half_width:.1%}; {best} (95% intervals and the throughput "
                     f"model; docs/decisions.md, D310)")
        if self.unbounded:
            lines.append(f"not bounded by the throughput model: {'; '.join(self.unbounded)} ({self.unbounded_why})")
        return lines


def _figure(c: Contender, unit: str) -> str:
    """``+3.4% (name: 397-414 samples/s, its source)``; ``at most 458.1`` where nothing bounds it from below."""
    within = f"{c.low:.4g}-{c.high:.4g}" if c.low > 0 else f"at most {c.high:.4g}"
    return f"{c.beats_by:+.1%} ({c.name}: {within} {unit}, {c.source})"


def stop_bound(ledger: Ledger, job: Job, builder: ConfigBuilder, left: Left) -> StopBound | None:
    """The `StopBound` of ``ledger``'s answer given what the stop ``left``; None before any config ran ok."""
    answer, objective = ledger.answer, ledger.objective
    pooled = ledger.pooled()
    if answer is None or objective is None or answer.name not in pooled:
        return None
    value, hw = pooled[answer.name].value, ledger.half_width(answer.name)
    measured = []
    for e in ledger.experiments:
        if e.replica_of is None and e.name != answer.name and e.name in pooled:
            v, h = pooled[e.name].value, ledger.half_width(e.name)
            measured.append(Contender(e.name, v * (1 - h), v * (1 + h), objective.gain(v, value) + math.hypot(hw, h),
                                      f"{pooled[e.name].runs} run(s)"))
    undecided, candidates, unbounded = _left_configs(ledger, job, builder, left)
    unmeasured = []
    if objective.name == "throughput":
        families, slowest = readings(ledger, job.capacity_bytes), value * (1 - min(hw, 0.5))
        top = None if job.cpu else roofline(families)
        for name, exp, kind in candidates:
            b = _model_bound(exp, kind, families, top, job.cpu)
            if b is None:
                unbounded.append(name)
            else:
                unmeasured.append(Contender(name, b[0], b[1], b[1] / slowest - 1, b[2]))
        why = ("on CPU ranks the model bounds only an mbs above its family's runs, D104" if job.cpu
               else "no run of its family and no compute roofline, or a knob config")
    else:
        unbounded += [name for name, _, _ in candidates]
        why = f"the throughput model bounds throughput only, the objective is {objective.name}"
    def by_bound(c: Contender) -> float:
        return -c.beats_by
    return StopBound(answer.name, value, hw, objective.unit, ledger.precision, tuple(undecided),
                     tuple(sorted(measured, key=by_bound)), tuple(sorted(unmeasured, key=by_bound)),
                     tuple(unbounded), why if unbounded else "")


def _model_bound(exp: Experiment | None, kind: ExperimentKind, families: dict[str, list[Reading]], top: float | None,
                 cpu: bool) -> tuple[float, float, str] | None:
    """``(low, high, source)`` of a config left (``exp``; None: a later phase's configs, of ``kind``): the throughput
    model's bounds (`zerotune.strategy.prediction.model_bounds`), capped at the compute roofline ``top`` where
    there is one (it holds for every config of the model on GPU ranks; None on CPU ranks)."""
    if exp is None:
        return None if top is None or kind not in GATED_KINDS else (0.0, top, "the compute roofline of a measured family")
    b = model_bounds(exp, families, cpu)
    if b is None or top is None or b[1] <= top:
        return b
    return min(b[0], top), top, f"{b[2]}, under the compute roofline of a measured family"


def _left_configs(ledger: Ledger, job: Job, builder: ConfigBuilder,
                  left: Left) -> tuple[list[str], list[tuple[str, Experiment | None, ExperimentKind]], list[str]]:
    """(undecided lines, the configs to bound, what the model cannot bound). Per undecided stage its largest open mbs
    up to the memory model's largest fitting one and below any OOM (on CPU ranks, the largest above its runs): the
    model's upper bound ``m / (a + b m)``, ``a, b >= 0``, rises with mbs, so it bounds the rest. Each experiment cut;
    each later phase (no experiment: the roofline bounds it where its kind is gated)."""
    undecided, candidates, unbounded = [], [], []
    opened: dict[int, list[int]] = {}  # stage -> its open mbs values
    for stage in left.stages:
        runs = {e.mbs: e for e in ledger.experiments if e.replica_of is None and e.kind is ExperimentKind.MBS
                and e.stage == stage and e.name == builder.mbs_experiment(stage, e.mbs).name}
        top = min([left.fit(stage)] + [m - 1 for m, e in runs.items() if e.status in (Status.OOM, Status.REFUSED)])
        ran = sorted(m for m, e in runs.items() if e.status is Status.OK)
        open_mbs = [m for m in left.values if job.min_mbs <= m <= top and (m not in runs or runs[m].status not in DECIDED)]
        if not open_mbs:
            continue
        opened[stage] = open_mbs
        undecided.append(f"ZeRO stage {stage} mbs {_ranges(open_mbs)} not run" + (f" (ran {_ranges(ran)})" if ran else ""))
        bounded = [m for m in open_mbs if not job.cpu or (ran and m > ran[-1])]
        if len(bounded) < len(open_mbs):
            unbounded.append(f"ZeRO stage {stage} mbs {_ranges([m for m in open_mbs if m not in bounded])}")
        if bounded:
            exp = builder.mbs_experiment(stage, bounded[-1])
            candidates.append((exp.name, exp, exp.kind))
    candidates += [(e.name, e, e.kind) for e in left.cut if not _within(e, opened, builder)]
    undecided += [name for name, _ in left.phases]
    candidates += [(name, None, kind) for name, kind in left.phases]
    return undecided, candidates, unbounded


def _within(exp: Experiment, opened: dict[int, list[int]], builder: ConfigBuilder) -> bool:
    """Whether ``exp`` is a stage's own config at an open mbs (``opened``), which the stage's largest bounds already."""
    return (exp.kind is ExperimentKind.MBS and exp.mbs in opened.get(exp.stage, ())
            and exp.name == builder.mbs_experiment(exp.stage, exp.mbs).name)


def _ranges(values: Sequence[int]) -> str:
    """``1-3, 5, 7-8`` for [1, 2, 3, 5, 7, 8] (ascending ints)."""
    spans: list[list[int]] = []
    for v in values:
        if spans and v == spans[-1][1] + 1:
            spans[-1][1] = v
        else:
            spans.append([v, v])
    return ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in spans)
