"""The dry run's answer: the experiments the strategy would try, with the memory model's verdict on each, as a
table or JSON.

The strategy runs against the memory-model oracle (`zerotune.strategy.oracle`: the memory model taken as right, an
assumed metric). The model's size comes from an earlier profile run in the same results dir, else from
``autotuning.model_info`` (``num_params``, optionally ``activation_mem_per_gpu``), else memory is unknown.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

from rich.table import Table

from zerotune.core.experiment import Experiment, ExperimentKind, Status
from zerotune.core.units import format_bytes


@dataclass(frozen=True)
class PlannedExperiment:
    """One experiment the tuning may launch.

    Attributes:
        name: its directory under the experiments dir.
        phase: its `zerotune.core.experiment.ExperimentKind` value: ``profile``, ``mbs`` or ``knobs``.
        knobs: dotted key -> value of the settings that differ within its knob space (empty in the other phases).
        memory_bytes: the memory model's bytes per device (None: model size unknown).
        fits: ``memory_bytes`` is within the per-device budget (None: unknown).
        skipped: why the throughput model would not launch it (its prediction under the oracle's assumed metric,
            `zerotune.strategy.prediction`); None: launched, or pruned by memory (``fits``).
    """

    name: str
    phase: str
    stage: int
    mbs: int
    gas: int
    knobs: dict[str, Any] = field(default_factory=dict)
    memory_bytes: int | None = None
    fits: bool | None = None
    ds_config: dict[str, Any] = field(default_factory=dict, repr=False)
    skipped: str | None = None


@dataclass(frozen=True)
class Plan:
    """The dry run's answer: ``experiments`` in the order the phases would run them; ``model_info_source``, where the
    memory model's parameters come from (``profile run on disk``, ``autotuning.model_info``; None: unknown);
    ``device_memory_bytes``, the per-device budget the fits are judged against."""

    experiments: Sequence[PlannedExperiment]
    model_info_source: str | None
    device_memory_bytes: int
    dp_world_size: int

    @classmethod
    def from_experiments(cls, experiments: Sequence[Experiment], model_info_source: str | None,
                         device_memory_bytes: int, dp_world_size: int, skip_profile: bool = False) -> "Plan":
        """The plan of a strategy's experiments, in order; without the profile when ``skip_profile`` (it is on disk)."""
        rows = [PlannedExperiment(e.name, e.kind.value, e.stage, e.mbs, e.gas, dict(e.knobs), e.memory_bytes,
                                  None if e.memory_bytes is None else e.memory_bytes <= device_memory_bytes,
                                  e.ds_config, e.error if e.status is Status.SKIPPED else None)
                for e in experiments if not (skip_profile and e.kind is ExperimentKind.PROFILE)]
        return cls(rows, model_info_source, device_memory_bytes, dp_world_size)

    def to_json(self) -> dict[str, Any]:
        return {"model_info_source": self.model_info_source, "device_memory_bytes": self.device_memory_bytes,
                "dp_world_size": self.dp_world_size, "experiments": [asdict(e) for e in self.experiments]}

    def json_text(self) -> str:
        return json.dumps(self.to_json(), indent=2, sort_keys=False)

    def header(self) -> str:
        """One line: how many experiments, how many fit, how many the throughput model would not launch, where the
        model size comes from."""
        if self.model_info_source is None:
            verdict = ("memory per device unknown until the profile run (or give autotuning.model_info.num_params "
                       "and activation_mem_per_gpu)")
        else:
            verdict = (f"{sum(e.fits is True for e in self.experiments)} fit "
                       f"{format_bytes(self.device_memory_bytes)} per device (model size from {self.model_info_source})")
        skipped = sum(e.skipped is not None for e in self.experiments)
        verdict += f"; {skipped} not launched by the throughput model" if skipped else ""
        return (f"zerotune dry run: {len(self.experiments)} experiments may be generated, {verdict}; "
                f"DP world size {self.dp_world_size}")

    def table(self) -> Table:
        """One row per experiment: name, phase, stage, mbs, gas, knobs, bytes per device, fits; a candidate the
        throughput model would not launch says so in its ``fits`` cell, with its prediction below the table."""
        table = Table()
        for col in ("experiment", "phase", "stage", "mbs", "gas", "knobs that differ", "memory/device", "fits"):
            table.add_column(col, justify="right" if col in ("stage", "mbs", "gas", "memory/device") else "left",
                             no_wrap=col != "knobs that differ")
        for e in self.experiments:
            knobs = " ".join(f"{k.removeprefix('zero_optimization.')}={_value(v)}" for k, v in e.knobs.items()) or "-"
            memory = "?" if e.memory_bytes is None else format_bytes(e.memory_bytes)
            fits = "?" if e.fits is None else ("yes" if e.fits else "no")
            table.add_row(e.name, e.phase, str(e.stage), str(e.mbs), str(e.gas), knobs, memory,
                          fits + (", not launched" if e.skipped else ""))
        skipped = [f"{e.name}: {e.skipped}" for e in self.experiments if e.skipped]
        if skipped:
            table.caption = "\n".join(skipped)
            table.caption_justify = "left"
        return table


def _value(v: Any) -> str:
    return json.dumps(v, separators=(",", ":"), sort_keys=True) if isinstance(v, (dict, list)) else str(v)
