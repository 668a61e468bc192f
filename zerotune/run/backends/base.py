"""The backend interface: run one experiment on reserved slots.

A backend knows how to start the ``deepspeed`` launcher somewhere (a subprocess here, a Ray
placement group elsewhere), supervise it and stop it; it never decides what to run or when. The
experiment directory (the config a run gets, its result files, its outcome) belongs to
:mod:`zerotune.run.expdir`, which every backend calls before and after a run.
"""
from __future__ import annotations

import abc
import resource
from dataclasses import dataclass, field
from pathlib import Path

from zerotune.core.experiment import Experiment
from zerotune.core.objective import OBJECTIVES, Objective
from zerotune.core.stopping import StopRule
from zerotune.run.slots import Reservation


@dataclass(frozen=True)
class LaunchSpec:
    """How to launch the user's training script, the same for every experiment.

    Attributes:
        script: the training script path.
        script_args: its arguments, including the ds_config flag (the path is replaced per
            experiment).
        cpu: run DeepSpeed on CPU (``DS_ACCELERATOR=cpu``, one rank per slot).
        device_memory_bytes: per-rank memory budget, enforced for real: on CPU with ``RLIMIT_DATA`` on every
            rank, so an over-budget config fails as a GPU OOM does; on CUDA by the probe, which caps each
            device's caching allocator at it (:func:`zerotune.probe.sitecustomize.cap_allocator`).
        timeout_s: wall-clock limit per experiment (None: no limit).
        hang_timeout_s: kill an experiment whose logs have not grown for this long (None: off).
        hostfile: passed to the launcher for multi-node reservations.
        start_profile_step, end_profile_step: the ``autotuning`` settings written into each
            experiment's config so DeepSpeed's engine measures and exits.
        objective: the metric DeepSpeed is asked to write, and how to read it.
        stop_rule: ends a run early once its probe streams say enough (adaptive experiments,
            :mod:`zerotune.core.stopping`); None: every run goes to ``end_profile_step``.
        arg_mappings: ``autotuning.arg_mappings`` as (ds_config key, script flag) pairs: each launch
            passes its config's values as these script arguments (:mod:`zerotune.deepspeed.args`).
        warm: fork each run's ranks from a server that preloaded torch, DeepSpeed and the script's imports once
            per tuning, where the backend can (:mod:`zerotune.run.warm`); False: every run through DeepSpeed's
            launcher (``--cold-launch``).
    """

    script: str
    script_args: tuple[str, ...]
    cpu: bool = False
    device_memory_bytes: int | None = None
    timeout_s: float | None = None
    hang_timeout_s: float | None = None
    hostfile: str | None = None
    start_profile_step: int = 3
    end_profile_step: int = 5
    objective: Objective = OBJECTIVES["throughput"]
    extra_env: dict[str, str] = field(default_factory=dict)
    stop_rule: StopRule | None = None
    arg_mappings: tuple[tuple[str, str], ...] = ()
    warm: bool = True


def limit_data(limit: int | None) -> None:
    """Limit this process (and what it execs or starts) to ``limit`` bytes of private data (``RLIMIT_DATA``; None
    or 0: no limit): the CPU ranks' memory budget (:attr:`LaunchSpec.device_memory_bytes`), under which torch
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
        call :func:`zerotune.run.expdir.prepare` before the launch and
        :func:`zerotune.run.expdir.finish` once the run's processes are gone.
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
