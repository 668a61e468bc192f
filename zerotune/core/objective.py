"""The objective: which metric is tuned, its direction, its unit, and where DeepSpeed writes it.

Everything that compares, reports or reads a metric takes one `Objective`, so the metric's knowledge lives here
only. The names are DeepSpeed's ``autotuning.metric`` values.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, TypeVar

from zerotune.core.errors import ConfigError

T = TypeVar("T")


@dataclass(frozen=True)
class Objective:
    """A metric and how to read and compare it: ``name`` (``throughput``, ``latency`` or ``flops``), its direction,
    zerotune's ``unit`` (``samples/s``, ``s/step``, ``FLOP/s per GPU``), its ``metric_key`` in DeepSpeed's
    ``metrics.json`` (``engine._autotuning_exit``) and the ``scale`` to ``unit`` (latency: microseconds -> s)."""

    name: str = "throughput"
    higher_is_better: bool = True
    unit: str = "samples/s"
    metric_key: str = "throughput"
    scale: float = 1.0

    @classmethod
    def named(cls, name: str) -> "Objective":
        """The objective DeepSpeed's ``autotuning.metric`` names.

        Raises:
            ConfigError: an unknown metric name.
        """
        try:
            return OBJECTIVES[name]
        except KeyError:
            raise ConfigError(f"metric = {name!r}: expected one of {', '.join(OBJECTIVES)}") from None

    def gain(self, new: float, old: float) -> float:
        """Relative improvement of ``new`` over ``old`` (positive = better), e.g. 0.01 = 1%."""
        if old == 0:
            return math.inf if self.better(new, old) else 0.0
        return (new - old) / abs(old) if self.higher_is_better else (old - new) / abs(old)

    def better(self, new: float, old: float | None) -> bool:
        """True when ``new`` is strictly better than ``old`` (anything beats None)."""
        return old is None or (new > old if self.higher_is_better else new < old)

    def best(self, items: Iterable[T], value: Callable[[T], float | None]) -> T | None:
        """The item with the best value (the first on ties), never one whose value is None; None when none has one."""
        best, best_value = None, None
        for item in items:
            v = value(item)
            if v is not None and (best is None or self.better(v, best_value)):
                best, best_value = item, v
        return best

    def read(self, metrics: dict[str, Any] | None) -> float | None:
        """The metric in `unit` from DeepSpeed's ``metrics.json`` content; None without a positive finite value."""
        if not metrics:
            return None
        value = metrics.get(self.metric_key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            return None
        return float(value) * self.scale


OBJECTIVES: dict[str, Objective] = {
    "throughput": Objective("throughput", True, "samples/s", "throughput", 1.0),
    "latency": Objective("latency", False, "s/step", "latency", 1e-6),  # DeepSpeed writes microseconds
    "flops": Objective("flops", True, "FLOP/s per GPU", "FLOPS_per_gpu", 1.0),
}
