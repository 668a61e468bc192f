"""The skip rule: a candidate is launched only where the throughput model says it can beat the best (D108, D322).

Before an mbs or gas experiment is launched (`zerotune.strategy.evaluation.Evaluator`), the throughput model bounds its
samples/s from the runs so far (`model_bounds`: its own family, same ZeRO stage, gas and knobs, else the compute
roofline of any family run at two or more mbs; readings near the device's capacity left out: `readings`). It is skipped
(``SKIPPED``, never launched) where its upper bound does not beat the best pooled metric by more than ``--precision``,
or than one run of it and the best can read apart by noise alone (`zerotune.core.noise.resolvable`). Throughput only,
never a re-measurement; on CPU ranks only an mbs above its family's readings is gated (D104).
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from zerotune.core.experiment import Experiment, ExperimentKind
from zerotune.core.noise import resolvable
from zerotune.model.throughput import Reading, bounds, ceiling
from zerotune.strategy.answer import Capacity, capacity, memory_fraction
from zerotune.strategy.ledger import Ledger

_BATCH_KEYS = ("train_micro_batch_size_per_gpu", "train_batch_size")
GATED_KINDS = (ExperimentKind.MBS, ExperimentKind.GAS)


@dataclass(frozen=True)
class Prediction:
    """Why a candidate was not launched: its predicted throughput bounds (samples/s), the best's pooled
    metric it had to beat by ``precision``, and where the bounds came from."""

    name: str
    low: float
    high: float
    best: float
    best_name: str
    precision: float
    source: str
    noise: float = 0.0  # how far apart (relative, 95%) one run of it and the best can read by noise alone

    @property
    def reason(self) -> str:
        predicted = f"throughput model: {self.low:.4g}-{self.high:.4g} samples/s predicted ({self.source}); "
        gain = self.high / self.best - 1
        if gain <= self.precision:
            return (f"{predicted}cannot beat {self.best_name}'s {self.best:.4g} by more than the precision "
                    f"({self.precision:.0%}): not launched")
        return (f"{predicted}at most {gain:+.1%} over {self.best_name}'s {self.best:.4g}, while one run of it and "
                f"the best read up to ±{self.noise:.1%} apart by noise alone: tied to what a run resolves, "
                "not launched")


def family_key(ds_config: dict) -> str:
    """The config without its mbs and train batch size: equal for the members of one family."""
    return json.dumps({k: v for k, v in ds_config.items() if k not in _BATCH_KEYS}, sort_keys=True, default=str)


def readings(ledger: Ledger, budget_bytes: int | None) -> dict[str, list[Reading]]:
    """Family key -> its readings: each config in ``ledger`` that ran ok, pooled, calm or of unknown capacity (near
    the capacity an allocator slows steps, off the affine curve)."""
    pooled = ledger.pooled()
    out: dict[str, list[Reading]] = {}
    for exp in ledger.experiments:
        p = pooled.get(exp.name)
        if exp.replica_of or p is None or not p.value or p.value <= 0 or not isinstance(exp.mbs, int):
            continue
        if capacity(memory_fraction(exp.peak_memory_bytes, budget_bytes)) is Capacity.NEAR:
            continue
        out.setdefault(family_key(exp.ds_config), []).append(Reading(exp.mbs, p.value, ledger.half_width(exp.name)))
    return out


def predict(exp: Experiment, families: dict[str, list[Reading]], best: tuple[str, float] | None,
            precision: float, cpu: bool = False, noise: float = 0.0) -> Prediction | None:
    """The `Prediction` that keeps ``exp`` from launching; None: launch it (no best, no bound, or an upper bound whose
    gain is `zerotune.core.noise.resolvable` against ``precision`` and ``noise``, one run's relative 95% noise)."""
    if best is None:
        return None
    bound = model_bounds(exp, families, cpu)
    if bound is None or resolvable(bound[1] / best[1] - 1, noise, precision):
        return None
    return Prediction(exp.name, bound[0], bound[1], best[1], best[0], precision, bound[2], noise)


def model_bounds(exp: Experiment, families: dict[str, list[Reading]],
                 cpu: bool = False) -> tuple[float, float, str] | None:
    """``(low, high, source)``: the samples/s the runs so far bound ``exp`` within, and where from; None where nothing
    bounds it (a kind not gated, no bounding reading, or no affine fit). On CPU ranks (``cpu``) only an mbs above its
    family's readings is bounded: caches, not a fixed per-step cost, shape the curve there, so a smaller micro-batch
    can be faster and per-sample compute bounds no other config (D104)."""
    if exp.kind not in GATED_KINDS or not isinstance(exp.mbs, int):
        return None
    own = families.get(family_key(exp.ds_config))
    if cpu and not (own and exp.mbs > max(r.mbs for r in own)):
        return None
    if own:
        b = bounds(own, exp.mbs)
        return None if b is None else (b.low, b.high, f"{len(own)} run(s) of its family, affine step time")
    top = roofline(families)
    return None if top is None else (0.0, top, "the compute roofline of a measured family")


def roofline(families: dict[str, list[Reading]]) -> float | None:
    """The tightest compute roofline (`zerotune.model.throughput.ceiling`, samples/s) of the families with
    readings at two or more mbs: the most any config of the model could reach; None where no family gives one."""
    ceilings = [c for rs in families.values() if len({r.mbs for r in rs}) >= 2 and (c := ceiling(rs)) is not None]
    return min(ceilings) if ceilings else None
