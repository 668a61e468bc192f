"""Every experiment's wall-clock bound: ``--timeout``, or a default derived from the profile run's wall time.

Every experiment has one, so a hung run ends the experiment (TIMEOUT), never the tuning. ``--timeout`` sets it for
every experiment. Without it the profile run, and any run while no profile run is recorded, gets
`UNKNOWN_STARTUP_TIMEOUT_S`; every other gets ``max(DEFAULT_TIMEOUT_FLOOR_S, DEFAULT_TIMEOUT_FACTOR x the profile
run's wall time)`` (room for start-up twice, larger micro batches and an op build). That wall time is read from the
exps dir's records, so a resumed tuning and a Ray node get the same bound.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from zerotune.core.experiment import Experiment, ExperimentKind, Status
from zerotune.run.exprecord import load_records

__all__ = ["DEFAULT_TIMEOUT_FACTOR", "DEFAULT_TIMEOUT_FLOOR_S", "Timeout", "UNKNOWN_STARTUP_TIMEOUT_S",
           "experiment_timeout"]

DEFAULT_TIMEOUT_FLOOR_S = 600.0
"""The least default timeout of an experiment after the profile run, seconds."""

DEFAULT_TIMEOUT_FACTOR = 10.0
"""The default timeout of an experiment after the profile run, in profile run wall times."""

UNKNOWN_STARTUP_TIMEOUT_S = 1800.0
"""The default timeout of the profile run, and of any run while no profile run is recorded, seconds."""


@dataclass(frozen=True)
class Timeout:
    """An experiment's wall-clock bound: ``seconds`` from the launch, set by ``rule`` (for the error; ``""``:
    ``--timeout``)."""

    seconds: float
    rule: str = ""

    def reason(self) -> str:
        """The error of an experiment killed at this bound."""
        return f"killed after the {self.seconds:g} s {self.rule or 'timeout'}"


def experiment_timeout(timeout_s: float | None, exp: Experiment, exps_dir: Path) -> Timeout:
    """The bound of ``exp`` launched in ``exps_dir``: ``timeout_s`` (``--timeout``) when given, else the default."""
    if timeout_s is not None:
        return Timeout(timeout_s)
    profile_s = None if exp.kind is ExperimentKind.PROFILE else profile_wall_s(exps_dir)
    if profile_s is None:
        return Timeout(UNKNOWN_STARTUP_TIMEOUT_S, "timeout for a run whose start-up time is unknown (the profile "
                                                  "run's; --timeout sets another)")
    seconds = round(max(DEFAULT_TIMEOUT_FLOOR_S, DEFAULT_TIMEOUT_FACTOR * profile_s), 1)
    return Timeout(seconds, f"default timeout ({DEFAULT_TIMEOUT_FACTOR:g} x the profile run's {profile_s:g} s, at "
                            f"least {DEFAULT_TIMEOUT_FLOOR_S:g} s; --timeout sets another)")


def profile_wall_s(exps_dir: Path) -> float | None:
    """The longest wall time of an OK profile run recorded in ``exps_dir``, seconds (None: none recorded)."""

    runs = [record.experiment for record in load_records(exps_dir)]
    walls = [float(e.wall_s) for e in runs if e.kind is ExperimentKind.PROFILE and e.status is Status.OK
             and isinstance(e.wall_s, (int, float)) and e.wall_s > 0]
    return max(walls, default=None)
