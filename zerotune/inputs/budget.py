"""What a tuning may spend: ``--max-launches`` and ``--max-device-hours``, and the stop when it is spent (D306).

Every experiment the tuning holds counts, the profile run and those a rerun reads from disk included, never one
refused by the memory model or skipped by the throughput model (neither launched); a launch costs its wall time times
the devices it held. The evaluator launches only what the budget has room for, else raises `BudgetSpent`; the
strategy then answers with the best that ran and by how much it could be beaten (`zerotune.strategy.stop_bound`,
D310). Under a budget the fine pass runs after the phases that try other configs
(`zerotune.strategy.tuning.Strategy.fine_last`, D312).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from zerotune.core.experiment import Experiment, Status

NOT_LAUNCHED = (Status.REFUSED, Status.SKIPPED)


class BudgetSpent(Exception):
    """The tuning's launch budget is spent (the message says which limit and the spend); ``cut``: the experiments of
    the batch it had no room for (never launched, not in the ledger)."""

    def __init__(self, message: str, cut: Sequence[Experiment] = ()):
        super().__init__(message)
        self.cut = tuple(cut)


@dataclass(frozen=True)
class LaunchBudget:
    """The limits of one tuning, None for none: ``max_launches`` (``--max-launches``, the profile run included) and
    ``max_device_hours`` (``--max-device-hours``: wall time x devices, summed over every launch)."""

    max_launches: int | None = None
    max_device_hours: float | None = None

    @staticmethod
    def spent(experiments: Iterable[Experiment]) -> tuple[int, float]:
        """(launches, device-hours) of ``experiments``: those launched (neither refused nor skipped)."""
        launched = [e for e in experiments if e.status not in NOT_LAUNCHED]
        return len(launched), sum((e.wall_s or 0.0) * e.num_nodes * e.num_slots for e in launched) / 3600

    def room(self, experiments: Iterable[Experiment]) -> int | None:
        """How many more launches the budget allows after ``experiments`` (None: no limit; 0: spent). The
        device-hour limit allows none once it is reached (a launch's cost is known only once it ran)."""
        launches, hours = self.spent(experiments)
        if self.max_device_hours is not None and hours >= self.max_device_hours:
            return 0
        return None if self.max_launches is None else max(0, self.max_launches - launches)

    def describe(self, experiments: Iterable[Experiment]) -> str:
        """``5 of --max-launches 5 launches, 0.0123 device-hours`` (with the device-hour limit when set)."""
        launches, hours = self.spent(list(experiments))
        of = f" of --max-launches {self.max_launches}" if self.max_launches is not None else ""
        of_hours = f" of --max-device-hours {self.max_device_hours:g}" if self.max_device_hours is not None else ""
        return f"{launches}{of} launches, {hours:.4g}{of_hours} device-hours"
