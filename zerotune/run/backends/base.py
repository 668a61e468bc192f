"""The backend interface: run one experiment on reserved slots.

A backend starts the ``deepspeed`` launcher somewhere, supervises it and stops it; it never decides what to run or
when. The experiment directory belongs to `zerotune.run.expdir`, which every backend calls before and after a run.
"""
from __future__ import annotations

import abc
import resource
from pathlib import Path

from zerotune.core.experiment import Experiment
from zerotune.core.launch import LaunchSpec, Reservation


def limit_data(limit: int | None) -> None:
    """Limit this process and its children to ``limit`` bytes of private data (``RLIMIT_DATA``; None or 0: none):
    the CPU ranks' memory budget, under which torch raises its allocator's OOM as a GPU run raises CUDA OOM."""
    if limit:
        resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))


class Backend(abc.ABC):
    """Runs experiments. Implementations must be safe to call from several threads at once."""

    @abc.abstractmethod
    def run(self, exp: Experiment, reservation: Reservation, exp_dir: Path) -> Experiment:
        """Run ``exp`` on ``reservation``, writing its files under ``exp_dir``; returns it with ``status``,
        ``metric``, ``metrics``, ``exit_code``, ``wall_s`` and ``error`` filled in. Must leave no process of the
        experiment running."""

    def cancel_all(self) -> None:
        """Kill every running experiment (used on Ctrl-C); they are recorded as interrupted."""

    def close(self) -> None:
        """Release what the backend keeps for the tuning's life (a warm rank server), however the tuning ends; the
        backend may be used again after it."""

    def training_launch(self, spec: LaunchSpec, reservation: Reservation, config_path: str, master_port: int,
                        ds_config: dict | None = None) -> tuple[dict[str, str], list[str]] | None:
        """The environment additions and the command that train with ``config_path`` on ``reservation`` (``zerotune
        run``, ``cmd_optimal.txt``); ``ds_config``: that file's content where not written yet. None: the
        ``deepspeed`` runner's line, without the probe."""

        return None
