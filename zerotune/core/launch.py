"""What a launch is: the spec every experiment's launch follows (`LaunchSpec`), the hosts and device slots
zerotune may use (`Node`), the slots one experiment holds (`Reservation`), and one experiment's launch
as the backends start, watch and stop it (`RunLaunch`).

Records only, on the ground floor: the job builds the spec (`zerotune.inputs.job.Job.launch_spec`), the
slot pool hands out reservations (`zerotune.run.slots.SlotPool`), and the ``deepspeed`` launcher's
environment and command are made from both (`zerotune.deepspeed.launcher`) for the backends that start them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, Sequence

from zerotune.core.objective import OBJECTIVES, Objective
from zerotune.core.stopping import StopRule

__all__ = ["LaunchSpec", "Node", "Reservation", "RunLaunch", "UserLauncher"]


class UserLauncher(Protocol):
    """The user's launcher as the backends use it (`zerotune.launchers.base.Launcher` implements it): its
    rank contract (`zerotune.launchers.contract`), how an experiment's config reaches the ranks, the command
    that starts them on one node, and why they cannot be forked warm ('' when they can)."""

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
        script: the training script path.
        script_args: its arguments, including the ds_config flag (the path is replaced per
            experiment).
        cpu: run DeepSpeed on CPU (``DS_ACCELERATOR=cpu``, one rank per slot).
        device_memory_bytes: per-rank memory budget, enforced for real: on CPU with ``RLIMIT_DATA`` on every
            rank, so an over-budget config fails as a GPU OOM does; on CUDA by the probe, which caps each
            device's caching allocator at it (`zerotune.probe.sitecustomize.cap_allocator`).
        timeout_s: wall-clock limit per experiment (None: no limit).
        hang_timeout_s: kill an experiment whose logs have not grown for this long (None: off).
        hostfile: passed to the launcher for multi-node reservations.
        start_profile_step, end_profile_step: the ``autotuning`` settings written into each
            experiment's config so DeepSpeed's engine measures and exits.
        objective: the metric DeepSpeed is asked to write, and how to read it.
        stop_rule: ends a run early once its probe streams say enough (adaptive experiments,
            `zerotune.core.stopping`); None: every run goes to ``end_profile_step``.
        arg_mappings: ``autotuning.arg_mappings`` as (ds_config key, script flag) pairs: each launch
            passes its config's values as these script arguments (`zerotune.deepspeed.args`).
        max_steps_arg: ``autotuning.max_steps_arg``, the script's flag for its length in steps: each experiment
            raises it past the last step DeepSpeed measures (`zerotune.deepspeed.args.raise_steps`).
        warm: fork each run's ranks from a server that preloaded torch, DeepSpeed and the script's imports once
            per tuning, where the backend can (`zerotune.run.warm`); False: every run through DeepSpeed's
            launcher (``--cold-launch``).
        launcher: the user's launcher when it is not ``deepspeed`` (torchrun, Accelerate, a script that starts its
            own ranks): its ranks get its contract, cold and warm; None: the ``deepspeed`` launcher's
            (`zerotune.deepspeed.launcher`).
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
    """One host and the device slots zerotune may use on it.

    Attributes:
        host: host name as in the hostfile (``localhost`` without one).
        slots: real device ids on that host, ascending and unique, e.g. ``(4, 5)`` after
            ``--include host:4,5``. Nodes of one cluster may have different slot counts.
    """

    host: str
    slots: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.host:
            raise ValueError("Node.host must be a non-empty host name")
        if any(s < 0 for s in self.slots) or list(self.slots) != sorted(set(self.slots)):
            raise ValueError(f"Node.slots must be ascending unique device ids >= 0, got {self.slots}")

    @property
    def num_slots(self) -> int:
        """Number of device slots on this node."""
        return len(self.slots)


@dataclass(frozen=True)
class Reservation:
    """Device slots held by one experiment, from ``SlotPool.try_reserve``.

    Attributes:
        nodes: the reserved nodes, in pool order, each with only its reserved slots.
    """

    nodes: tuple[Node, ...]

    @property
    def world_size(self) -> int:
        """Total ranks (slots) across all reserved nodes."""
        return sum(len(n.slots) for n in self.nodes)

    @property
    def num_nodes(self) -> int:
        """Number of reserved nodes."""
        return len(self.nodes)

    def include_arg(self) -> str:
        """The ``deepspeed`` launcher's ``--include`` value for exactly these slots.

        ``localhost:0,1`` for one local node, ``worker-0:0,1@worker-1:2,3`` for two hosts.

        .. note:: The launcher only uses ssh/pdsh when more than one host is active (or
           ``--force_multi`` is given): a reservation of a single remote host needs
           ``--force_multi`` with the hostfile, or it runs on the local machine.
        """
        return "@".join(f"{n.host}:{','.join(str(s) for s in n.slots)}" for n in self.nodes)


@dataclass(frozen=True)
class RunLaunch:
    """One experiment's launch, made once before its ranks start: what every step of the launch path (the command,
    the warm request, the stop) takes.

    Attributes:
        name: the experiment's name.
        reservation: the slots it runs on.
        exp_dir: its directory (the probe's streams, the logs, ``cmd.txt``).
        config_path: the ds_config file it runs, written before the launch.
        port: its master port, free on this machine.
        token: its run token (`zerotune.run.processes.new_run_token`), in every rank's environment.
    """

    name: str
    reservation: Reservation
    exp_dir: Path
    config_path: str
    port: int
    token: str
