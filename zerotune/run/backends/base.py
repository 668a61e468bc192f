"""The backend interface: run one experiment on reserved slots.

A backend knows how to start the ``deepspeed`` launcher somewhere (a subprocess here, a Ray
placement group elsewhere), supervise it and stop it; it never decides what to run or when. The
experiment directory (the config a run gets, its result files, its outcome) belongs to
`zerotune.run.expdir`, which every backend calls before and after a run.
"""
from __future__ import annotations

import abc
import resource
from pathlib import Path

from zerotune.core.experiment import Experiment
from zerotune.core.launch import LaunchSpec, Reservation


def limit_data(limit: int | None) -> None:
    """Limit this process (and what it execs or starts) to ``limit`` bytes of private data (``RLIMIT_DATA``; None
    or 0: no limit): the CPU ranks' memory budget (`LaunchSpec.device_memory_bytes`), under which torch
    raises ``DefaultCPUAllocator: can't allocate memory`` as a GPU run raises CUDA OOM."""
    if limit:
        resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))


class Backend(abc.ABC):
    """Runs experiments. Implementations must be safe to call from several threads at once."""

    @abc.abstractmethod
    def run(self, exp: Experiment, reservation: Reservation, exp_dir: Path) -> Experiment:
        """Run ``exp`` on ``reservation``, writing its files under ``exp_dir``.

        Returns the experiment with ``status``, ``metric``, ``metrics``, ``exit_code``, ``wall_s``
        and ``error`` filled in. Must leave no process of the experiment running. Implementations
        call `zerotune.run.expdir.prepare` before the launch and
        `zerotune.run.expdir.finish` once the run's processes are gone.
        """

    def cancel_all(self) -> None:
        """Kill every running experiment (used on Ctrl-C); they are recorded as interrupted."""

    def close(self) -> None:
        """Release what the backend keeps for the tuning's life (a warm rank server); called once the tuning ends,
        however it ends. The backend may be used again after it (it starts afresh)."""

    def training_launch(self, spec: LaunchSpec, reservation: Reservation, config_path: str, master_port: int,
                        ds_config: dict | None = None) -> tuple[dict[str, str], list[str]] | None:
        """The environment additions and the command that train as ``spec`` says with ``config_path`` on
        ``reservation`` (``zerotune run`` starts it, ``cmd_optimal.txt`` shows it); ``ds_config``: that file's
        content where it is not written yet. None (here): the ``deepspeed`` runner's line, without the probe."""
        return None
