"""What a launch is: the spec every experiment's launch follows (`LaunchSpec`), the hosts and device slots
zerotune may use (`Node`), the slots one experiment holds (`Reservation`), and one experiment's launch (`RunLaunch`).

Records only: the job builds the spec (`zerotune.inputs.job.Job.launch_spec`), the slot pool hands out
reservations (`zerotune.run.slots.SlotPool`), and `zerotune.deepspeed.launcher` makes the command from both.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, Sequence

from zerotune.core.objective import OBJECTIVES, Objective
from zerotune.core.stopping import StopRule

__all__ = ["LaunchSpec", "Node", "Reservation", "RunLaunch", "UserLauncher"]


class UserLauncher(Protocol):
    """The user's launcher as the backends use it (`zerotune.launchers.base.Launcher`): its rank contract
    (`zerotune.launchers.contract`), how the config reaches the ranks, their command on one node, and why they
    cannot be forked warm ('' when they can)."""

    name: str
    contract: str
    config_in_argv: bool

    def script_arguments(self, script_args: Sequence[str], config_path: str) -> list[str]: ...

    def rank_env(self, config_path: str | None) -> dict[str, str]: ...

    def command(self, script: str, script_args: Sequence[str], ranks: int, master_port: int) -> list[str]: ...

    def warm_note(self) -> str: ...


@dataclass(frozen=True)
class LaunchSpec:
    """How to launch the user's training script, the same for every experiment.

    Attributes:
        script, script_args: the training script and its arguments (the ds_config flag's path replaced per run).
        cpu: run DeepSpeed on CPU (``DS_ACCELERATOR=cpu``, one rank per slot).
        device_memory_bytes: per-rank budget, enforced on CPU by ``RLIMIT_DATA`` on every rank (an over-budget
            config fails as a GPU OOM does), on CUDA by the probe's allocator cap (`zerotune.probe.sitecustomize`).
        timeout_s: wall-clock limit per experiment; hang_timeout_s: kill a run whose logs stop growing this long.
        hostfile: passed to the launcher for multi-node reservations.
        start_profile_step, end_profile_step: the ``autotuning`` steps DeepSpeed's engine measures, then exits.
        objective: the metric DeepSpeed writes, and how to read it.
        stop_rule: ends a run once its probe streams say enough (`zerotune.core.stopping`; None: at the end step).
        arg_mappings: ``autotuning.arg_mappings``, (ds_config key, script flag) pairs passed as script arguments.
        max_steps_arg: ``autotuning.max_steps_arg``, the script's steps flag, raised past the last measured step
            (`zerotune.deepspeed.args.raise_steps`).
        warm: fork each run's ranks from a server that preloaded torch, DeepSpeed and the script's imports, where
            the backend can (`zerotune.run.warm`, D303); False: ``--cold-launch``.
        launcher: the user's launcher when not ``deepspeed`` (torchrun, Accelerate, a script starting its own
            ranks), whose contract its ranks get; None: ``deepspeed``'s (`zerotune.deepspeed.launcher`).
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
    max_steps_arg: str | None = None
    warm: bool = True
    launcher: UserLauncher | None = None


@dataclass(frozen=True)
class Node:
    """One host (as in the hostfile; ``localhost`` without one) and the device slots zerotune may use on it: real
    device ids, ascending and unique (``(4, 5)`` after ``--include host:4,5``); nodes of a cluster may differ in
    count. Raises ValueError on an empty host or slots that are not ascending unique ids >= 0."""

    host: str
    slots: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.host:
            raise ValueError("Node.host must be a non-empty host name")
        if any(s < 0 for s in self.slots) or list(self.slots) != sorted(set(self.slots)):
            raise ValueError(f"Node.slots must be ascending unique device ids >= 0, got {self.slots}")

    @property
    def num_slots(self) -> int:
        return len(self.slots)


@dataclass(frozen=True)
class Reservation:
    """Device slots held by one experiment (``SlotPool.try_reserve``): its nodes in pool order, each with only its
    reserved slots."""

    nodes: tuple[Node, ...]

    @property
    def world_size(self) -> int:
        """Total ranks (slots) across all reserved nodes."""
        return sum(len(n.slots) for n in self.nodes)

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    def include_arg(self) -> str:
        """The ``deepspeed`` launcher's ``--include`` value for these slots (``worker-0:0,1@worker-1:2,3``); a single
        remote host also needs ``--force_multi``, as the launcher uses ssh/pdsh only for more than one host."""
        return "@".join(f"{n.host}:{','.join(str(s) for s in n.slots)}" for n in self.nodes)


@dataclass(frozen=True)
class RunLaunch:
    """One experiment's launch, made before its ranks start; the command, the warm request and the stop take it:
    its directory (the probe's streams, the logs, ``cmd.txt``), its ds_config file (written before the launch), a
    free master port and its run token (`zerotune.run.processes.new_run_token`, in every rank's environment)."""

    name: str
    reservation: Reservation
    exp_dir: Path
    config_path: str
    port: int
    token: str
