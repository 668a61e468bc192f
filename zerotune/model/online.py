"""Online correction: the memory model fitted to every measured peak, with an explicit margin (D110).

Rules: the profile run calibrates the prior (`MemoryModel.calibrated`); the strategy calls `OnlineMemory.observed`
after each finished experiment (`zerotune.strategy.evaluation.Evaluator`). Each family (a ZeRO stage with one
precision and one choice of memory savers, whatever its mbs and gas: `family`) is a line in mbs over the prior's
structural terms (`OnlineMemory`). A config measured ok is predicted at the mean of its peaks; one not measured is
refused (never launched) when its prediction raised by the margin (`OnlineMemory.margin`) is over the budget
(`OnlineMemory.refusal`). Pure functions of the prior and the readings.
"""
from __future__ import annotations

import dataclasses
import json
import math
import statistics
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from zerotune.core.experiment import Experiment, ExperimentKind, Status
from zerotune.core.units import format_bytes
from zerotune.deepspeed.config import precision
from zerotune.model.linefit import Line, fit_line
from zerotune.model.memory import MemoryModel
from zerotune.model.zero_options import ZeroOptions

MARGIN_QUANTILE = 0.95
"""The quantile of the fit's relative residuals that is the safety margin."""

Family = tuple[int, str, bool, str, str, int, int]
"""ZeRO stage, precision, activation checkpointing, offload_optimizer device, offload_param device, AutoTP degree,
Ulysses degree."""


def family(memory: MemoryModel, ds_config: dict[str, Any]) -> Family:
    """The family a config's peaks are fitted in (`OnlineMemory`): its stage (0-3), precision, whether it
    gets the checkpointed activation term (`MemoryModel.checkpointed`), its offload devices, and its AutoTP and
    Ulysses degrees (each holds other activations per sample than the profile measured)."""
    zero = ds_config.get("zero_optimization")
    zero = zero if isinstance(zero, dict) else {}
    stage = zero.get("stage", 0)
    stage = min(max(stage, 0), 3) if isinstance(stage, int) and not isinstance(stage, bool) else 0

    def device(key: str) -> str:
        section = zero.get(key)
        return str(section.get("device", "none")).lower() if isinstance(section, dict) else "none"

    options = ZeroOptions.of(ds_config)
    return stage, precision(ds_config), memory.checkpointed(ds_config), device("offload_optimizer"), \
        device("offload_param"), options.tp, options.sp


def family_label(fam: Family) -> str:
    """``ZeRO stage 1``, ``ZeRO stage 3 bf16 + checkpointing + offload optimizer (cpu)``: for the log and summary."""
    stage, dtype, checkpointed, optimizer, params, tp, sp = fam
    savers = ([f"AutoTP {tp}"] if tp > 1 else []) + ([f"Ulysses {sp}"] if sp > 1 else []) + (
        ["checkpointing"] if checkpointed else []) + [
        f"offload {what} ({dev})" for what, dev in (("optimizer", optimizer), ("params", params)) if dev != "none"]
    return f"ZeRO stage {stage}" + ("" if dtype == "fp32" else f" {dtype}") + "".join(f" + {s}" for s in savers)


def _key(ds_config: dict[str, Any]) -> str:
    return json.dumps(ds_config, sort_keys=True, default=str)


@dataclass(frozen=True)
class Reading:
    """One finished run as the fit reads it: its config and mbs, and its peak per rank, bytes; for a run out of
    memory (``bound``) the budget plus one, a lower bound on the peak."""

    ds_config: dict[str, Any]
    mbs: int
    peak_bytes: int
    bound: bool = False

    @classmethod
    def of(cls, exp: Experiment, budget_bytes: int) -> "Reading | None":
        """The reading of a finished experiment held to ``budget_bytes``: an ok run's peak or an out-of-memory run's
        bound; None otherwise (the profile run, the prior's own calibration; no integer mbs; no peak)."""
        mbs = exp.ds_config.get("train_micro_batch_size_per_gpu")
        if exp.kind is ExperimentKind.PROFILE or not isinstance(mbs, int) or isinstance(mbs, bool):
            return None
        if exp.status is Status.OK and exp.peak_memory_bytes:
            return cls(exp.ds_config, mbs, int(exp.peak_memory_bytes))
        if exp.status is Status.OOM:
            return cls(exp.ds_config, mbs, int(budget_bytes) + 1, bound=True)
        return None


def quantile(values: list[float], q: float) -> float:
    """The ``q`` quantile of ``values``, linear between order statistics (numpy's default); 0.0 for none."""
    if not values:
        return 0.0
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


@dataclass(frozen=True)
class OnlineMemory:
    """The memory model as the finished runs so far (``readings``, in order) correct the profile-calibrated
    ``prior``, whose structural terms every prediction keeps. Per family, a run's peak less those terms
    (`structural_bytes`), i.e. its overhead and activations, is a line in mbs fitted by least squares
    (`zerotune.model.linefit.fit_line`): through every ok peak, the prior as one point at its mbs until the family's
    own peak there replaces it, each out-of-memory run as a lower bound, the slope never below 0. A family with no
    reading takes the prior's line turned about the prior's point (`slope_ratio`)."""

    prior: MemoryModel
    readings: tuple[Reading, ...] = ()

    # -- learning -------------------------------------------------------------------------------------
    def observed(self, exp: Experiment, budget_bytes: int) -> tuple["OnlineMemory", str | None]:
        """The model after ``exp``'s outcome (held to ``budget_bytes`` per rank) and a line for the log saying
        what its family's fit and the margin became (None: ``exp`` teaches nothing, `Reading.of`)."""
        reading = Reading.of(exp, budget_bytes)
        if reading is None:
            return self, None
        new = dataclasses.replace(self, readings=self.readings + (reading,))
        fam = family(self.prior, exp.ds_config)
        what = (f"{exp.name} ran out of memory (its peak is over {format_bytes(budget_bytes)})" if reading.bound
                else f"{exp.name} peaked at {format_bytes(reading.peak_bytes)}")
        return new, f"memory fit: {what}; {new.describe_family(fam)}; margin {new.margin:.1%}"

    @property
    def prior_mbs(self) -> int:
        """The mbs of the prior's point: the profile's, where the calibration measured it (1 uncalibrated)."""
        return self.prior.anchor[2] if self.prior.anchor is not None else 1

    def structural_bytes(self, ds_config: dict[str, Any], mbs: int | None = None) -> int:
        """What the prior's structural terms put on a rank for ``ds_config`` at ``mbs``: its estimate less the
        activations and the overhead (the two terms each family's line stands for)."""
        b = self.prior.breakdown(ds_config, mbs)
        return b.total - b.activations - b.overhead

    def _prior_point(self, ds_config: dict[str, Any]) -> tuple[float, float]:
        x = self.prior_mbs
        return float(x), float(self.prior.overhead_bytes + self.prior.activation_bytes(ds_config) * x)

    def _by_family(self) -> dict[Family, list[Reading]]:
        groups: dict[Family, list[Reading]] = {}
        for r in self.readings:
            groups.setdefault(family(self.prior, r.ds_config), []).append(r)
        return groups

    def _prior_replaced(self, readings: list[Reading]) -> bool:
        """Whether a family's own ok peak at the prior's mbs takes the prior's point's place."""
        return any(not r.bound and r.mbs == self.prior_mbs for r in readings)

    def _fit(self, readings: list[Reading], slope_ratio: float) -> Line:
        """A family's line through its readings and the prior's point (unless a peak at the prior's mbs replaces it);
        an undetermined slope prefers the prior's times ``slope_ratio``."""
        cfg = readings[0].ds_config
        points = ([] if self._prior_replaced(readings) else [(*self._prior_point(cfg), 1.0)]) + [
            (float(r.mbs), float(r.peak_bytes - self.structural_bytes(r.ds_config, r.mbs)), 1.0)
            for r in readings if not r.bound]
        bounds = [(float(r.mbs), float(r.peak_bytes - self.structural_bytes(r.ds_config, r.mbs)))
                  for r in readings if r.bound]
        return fit_line(points, bounds, tie_slope=self.prior.activation_bytes(cfg) * slope_ratio)

    @cached_property
    def slope_ratio(self) -> float:
        """What a family without peaks of its own takes: the median of fitted over prior slope, over the families
        whose ok peaks (one at an mbs other than the prior's) fix their slope, else over those with readings;
        1.0 with none. What the profile misses per sample (on CPU the backward's temporaries) every stage misses."""
        groups = self._by_family()
        fixed = {f: rs for f, rs in groups.items() if any(not r.bound and r.mbs != self.prior_mbs for r in rs)}
        ratios = []
        for rs in (fixed or groups).values():
            prior_slope = self.prior.activation_bytes(rs[0].ds_config)
            if prior_slope > 0:
                ratios.append(self._fit(rs, 1.0).slope / prior_slope)
        return statistics.median(ratios) if ratios else 1.0

    @cached_property
    def _lines(self) -> dict[Family, Line]:
        return {f: self._fit(rs, self.slope_ratio) for f, rs in self._by_family().items()}

    def line(self, ds_config: dict[str, Any]) -> Line:
        """The line of ``ds_config``'s family: its fit, or without readings the prior's line turned about the
        prior's point to `slope_ratio` times its slope."""
        fam = family(self.prior, ds_config)
        if fam in self._lines:
            return self._lines[fam]
        x, y = self._prior_point(ds_config)
        slope = self.prior.activation_bytes(ds_config) * self.slope_ratio
        return Line(y - slope * x, slope)  # with a ratio of 1, exactly the prior's (integers in a float)

    @cached_property
    def _measured(self) -> dict[str, list[int]]:
        peaks: dict[str, list[int]] = {}
        for r in self.readings:
            if not r.bound:
                peaks.setdefault(_key(r.ds_config), []).append(r.peak_bytes)
        return peaks

    # -- predicting ----------------------------------------------------------------------------------
    def fitted_bytes(self, ds_config: dict[str, Any], mbs: int | None = None) -> int:
        """The family fit's bytes per rank for ``ds_config`` at ``mbs`` (default: its own), measured or not."""
        m = mbs if mbs is not None else int(ds_config.get("train_micro_batch_size_per_gpu") or 1)
        return round(self.structural_bytes(ds_config, m) + self.line(ds_config).at(m))

    def measured_bytes(self, ds_config: dict[str, Any]) -> int | None:
        """The mean of the ok peaks measured for exactly ``ds_config`` (its replicas too); None: never measured."""
        peaks = self._measured.get(_key(ds_config))
        return round(statistics.fmean(peaks)) if peaks else None

    def bytes_per_device(self, ds_config: dict[str, Any], mbs: int | None = None) -> int:
        """The predicted peak per rank, bytes: a config measured ok at its measurement (`measured_bytes`),
        any other at its family's fit (`fitted_bytes`)."""
        own = ds_config.get("train_micro_batch_size_per_gpu")
        measured = self.measured_bytes(ds_config) if mbs is None or mbs == own else None
        return measured if measured is not None else self.fitted_bytes(ds_config, mbs)

    @cached_property
    def residuals(self) -> list[float]:
        """Each measured peak's relative residual from its family's line, in reading order: ``(peak - fit) /
        line``, the line being the fitted part of the fit (`fitted_bytes` less the structural terms)."""
        out = []
        for r in self.readings:
            line = self.line(r.ds_config).at(r.mbs)
            if not r.bound and line > 0:
                out.append((r.peak_bytes - self.fitted_bytes(r.ds_config, r.mbs)) / line)
        return out

    @cached_property
    def margin(self) -> float:
        """The safety margin, a fraction of a prediction's fitted part: the `MARGIN_QUANTILE` quantile of
        `residuals` (0 when it is negative or there is none). Relative to the fitted part, not the whole peak: the
        structural terms are arithmetic, the noise is in the heap the overhead and the activations churn."""
        return max(0.0, quantile(self.residuals, MARGIN_QUANTILE))

    def guarded_bytes(self, ds_config: dict[str, Any], mbs: int | None = None) -> int:
        """The fitted prediction with the margin: `fitted_bytes` plus ``margin`` times its line's value."""
        m = mbs if mbs is not None else int(ds_config.get("train_micro_batch_size_per_gpu") or 1)
        return self.fitted_bytes(ds_config, m) + round(self.margin * max(0.0, self.line(ds_config).at(m)))

    def refusal(self, ds_config: dict[str, Any], budget_bytes: int) -> str | None:
        """Why ``ds_config`` is not launched: never measured ok, and its prediction with the margin
        (`guarded_bytes`) is over ``budget_bytes``; None when it may be launched."""
        if self.measured_bytes(ds_config) is not None or self.guarded_bytes(ds_config) <= budget_bytes:
            return None
        with_margin = (f", {format_bytes(self.guarded_bytes(ds_config))} with the {self.margin:.1%} margin"
                       if self.margin > 0 else " (margin 0%)")
        return (f"not launched: predicted {format_bytes(self.bytes_per_device(ds_config))} per rank{with_margin}, "
                f"over the {format_bytes(budget_bytes)} budget")

    def fits(self, ds_config: dict[str, Any], budget_bytes: int) -> bool:
        return self.refusal(ds_config, budget_bytes) is None

    def max_mbs(self, ds_config: dict[str, Any], budget_bytes: int, cap: int = 1024) -> int:
        """The largest mbs (at most ``cap``) whose `guarded_bytes` fit ``budget_bytes``; 0 when none does. The
        activations share their room with the reduction's copy, as in `MemoryModel.max_mbs`."""
        if self.guarded_bytes(ds_config, 0) > budget_bytes:
            return 0
        line, grow = self.line(ds_config), 1 + self.margin
        if line.slope <= 0:
            return cap
        room = budget_bytes - self.structural_bytes(ds_config, 0) + self.prior.copy_after_backward_bytes(ds_config)
        best = int(min(cap, (room - grow * line.intercept) // (grow * line.slope)))
        while best > 0 and self.guarded_bytes(ds_config, best) > budget_bytes:
            best -= 1
        return best

    def host_fits(self, ds_config: dict[str, Any], host_memory_bytes: int | None, ranks_per_node: int) -> bool:
        """`MemoryModel.host_fits` of the prior: the host bytes are structural, not fitted."""
        return self.prior.host_fits(ds_config, host_memory_bytes, ranks_per_node)

    # -- telling -------------------------------------------------------------------------------------
    def describe_family(self, fam: Family) -> str:
        """A fitted family's line, e.g. ``ZeRO stage 0: 17.11 MiB/sample + 380.59 MiB over its structural terms (6
        peak(s), 1 OOM bound(s), the prior as one point)``."""
        readings = self._by_family()[fam]
        peaks = sum(not r.bound for r in readings)
        bounds = len(readings) - peaks
        replaced = self._prior_replaced(readings)
        line = self._lines[fam]
        sign = "+" if line.intercept >= 0 else "-"
        return (f"{family_label(fam)}: {format_bytes(round(line.slope))}/sample {sign} "
                f"{format_bytes(round(abs(line.intercept)))} over its structural terms ({peaks} peak(s)"
                + (f", {bounds} OOM bound(s)" if bounds else "")
                + (f", one at mbs {self.prior_mbs} in the prior's place)" if replaced else ", the prior as one point)"))

    def describe(self) -> list[str]:
        """The summary's lines: each fitted family, what the others take, and the margin."""
        if not self.readings:
            return []
        lines = [self.describe_family(f) for f in self._by_family()]
        lines.append(f"families without a run: the prior turned to {self.slope_ratio:.2f}x its slope per sample "
                     f"about its point at mbs {self.prior_mbs}")
        lines.append(f"margin {self.margin:.1%}: the {MARGIN_QUANTILE:.0%} quantile of the fit's relative residuals "
                     f"over {len(self.residuals)} peak(s), on a prediction's fitted part; a config never measured is "
                     f"not launched when its prediction with the margin is over the budget")
        return ["memory fit (per family, a line through its measured peaks, the profile's prior as one point; "
                "docs/decisions.md, D110): " + "; ".join(lines)]
