"""The Slurm backend: run inside an allocation (``salloc`` or an ``sbatch`` script), each experiment a job step.

The nodes and devices per node are the allocation's (`slurm_nodes`). Each experiment is one ``srun`` on its
reservation's nodes (`srun_command`), whose tasks become the ranks through `zerotune.run.backends.slurm_rank`, warm
ones forked from a server per node. Supervision is the local backend's with `SrunStarter` as its starter.
Rules: the results dir, the script and zerotune lie at the same paths on every node (a shared filesystem,
docs/clusters.md); the master port is checked free on this machine only (a taken one fails, a rerun retries it).
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

import psutil

from zerotune.core.errors import ConfigError
from zerotune.core.experiment import Experiment, Status
from zerotune.core.launch import LaunchSpec, Node, Reservation, RunLaunch
from zerotune.deepspeed.launcher import launch_env, script_arguments
from zerotune.run.backends.direct import popen_cold
from zerotune.run.backends.local import LocalBackend
from zerotune.run.backends.slurm_rank import DATA_LIMIT_ENV, expand_counts
from zerotune.run.backends.slurm_step import SLURM_STEP_GONE_S, cancel_slurm_step, slurm_step_id, step_handle
from zerotune.run.backends.slurm_warm import SlurmWarmServers
from zerotune.run.expdir import STDERR_LOG
from zerotune.run.processes import adopt_orphans, descendants, kill_tree, run_processes
from zerotune.run.warm.rank import SETUP_FAILED_LINE

__all__ = ["SlurmBackend", "SrunStarter", "slurm_nodes", "srun_command", "step_env"]

RANK_MODULE = "zerotune.run.backends.slurm_rank"
ALLOCATION_ENDING = "Job/step already completing or completed"  # srun's error when it cannot create a step
_SCAN_S = 1.0  # how often the ranks on this machine are looked up by token while a step runs, seconds


def _allocation_env(environ: Mapping[str, str], name: str) -> str:
    value = environ.get(name)
    if not value:
        raise ConfigError(f"--backend slurm runs inside a Slurm allocation (salloc, or an sbatch script): {name} "
                          "is not set")
    return value


def hostnames(nodelist: str) -> list[str]:
    """Slurm's node list expanded, ``node[1-2]`` -> ``["node1", "node2"]`` (``scontrol show hostnames``).

    Raises:
        ConfigError: scontrol is missing or refuses the list.
    """
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ConfigError(f"--backend slurm: cannot run 'scontrol show hostnames {nodelist}': {e}") from None
    hosts = out.stdout.split()
    if out.returncode != 0 or not hosts:
        raise ConfigError(f"--backend slurm: 'scontrol show hostnames {nodelist}' failed: "
                          f"{out.stderr.strip() or out.returncode}")
    return hosts


def slurm_nodes(cpu: bool, num_gpus: int = -1, num_nodes: int = -1, environ: Mapping[str, str] = os.environ,
                expand=hostnames) -> list[Node]:
    """The allocation's nodes with their device slots, from Slurm's environment ``environ``.

    Nodes: ``SLURM_JOB_NODELIST`` expanded, the first ``num_nodes`` (-1: all). Slots per node, ids ``0..S-1``: on
    CUDA, ``SLURM_GPUS_ON_NODE`` (or fewer, ``num_gpus``); on CPU, ``num_gpus``, else ``SLURM_NTASKS_PER_NODE``,
    else the fewest of ``SLURM_JOB_CPUS_PER_NODE``.

    Raises:
        ConfigError: not inside an allocation; no GPU on the nodes (CUDA); more nodes or devices asked for than
            the allocation has.
    """
    hosts = expand(_allocation_env(environ, "SLURM_JOB_NODELIST"))
    if num_nodes > len(hosts):
        raise ConfigError(f"--num_nodes {num_nodes}: the Slurm allocation has {len(hosts)} node(s)")
    hosts = hosts[:num_nodes] if num_nodes > 0 else hosts
    if cpu:
        slots = num_gpus if num_gpus > 0 else int(environ.get("SLURM_NTASKS_PER_NODE") or min(
            expand_counts(_allocation_env(environ, "SLURM_JOB_CPUS_PER_NODE"))))
    else:
        have = int(environ.get("SLURM_GPUS_ON_NODE") or 0)
        if have < 1:
            raise ConfigError("--backend slurm on CUDA: the allocation has no GPU (SLURM_GPUS_ON_NODE is not set): "
                              "ask salloc/sbatch for --gpus-per-node, or tune CPU ranks with --cpu")
        if num_gpus > have:
            raise ConfigError(f"--num_gpus {num_gpus}: the Slurm allocation has {have} GPU(s) per node")
        slots = num_gpus if num_gpus > 0 else have
    return [Node(host, tuple(range(slots))) for host in hosts]


def step_env(spec: LaunchSpec, reservation: Reservation, master_port: int, probe_dir: Path | None = None,
             config_path: str | None = None) -> dict[str, str]:
    """The environment a step adds to this process's (srun exports it to every rank): the local backend's
    (`zerotune.deepspeed.launcher.launch_env`), ``MASTER_ADDR`` (the first node), ``MASTER_PORT`` and, for an
    experiment (``probe_dir`` given) on CPU ranks with a budget, each rank's ``RLIMIT_DATA``
    (`zerotune.run.backends.slurm_rank.DATA_LIMIT_ENV`); training after tuning runs unlimited."""
    env = launch_env(spec, reservation, probe_dir=probe_dir, config_path=config_path)
    env.pop("CUDA_VISIBLE_DEVICES", None)  # a torchrun-like launcher's slots: Slurm sets each node's for its step
    env.update(MASTER_ADDR=reservation.nodes[0].host, MASTER_PORT=str(master_port))
    if probe_dir is not None and spec.cpu and spec.device_memory_bytes:
        env[DATA_LIMIT_ENV] = str(int(spec.device_memory_bytes))
    return env


def srun_command(spec: LaunchSpec, reservation: Reservation, config_path: str, cpus_per_task: int, name: str,
                 ds_config: dict | None = None) -> list[str]:
    """The ``srun`` line of one step named ``name``: ``reservation``'s nodes, one task per slot, ``--exact`` with
    ``cpus_per_task`` CPUs each (experiments share a node as the slot pool places them), on CUDA ``--gpus-per-node``
    and ``--gpu-bind=none`` (each rank sees its node's GPUs and takes the ``LOCAL_RANK``-th; a one-GPU-per-task
    binding would leave rank 1 no device 1); the script's arguments as for the deepspeed launcher; with
    ``spec.launcher``, that launcher's rank contract (``--contract``)."""
    nodes, per_node = reservation.num_nodes, reservation.nodes[0].num_slots
    cmd = ["srun", "--nodes", str(nodes), "--ntasks", str(nodes * per_node), "--ntasks-per-node", str(per_node),
           "--nodelist", ",".join(n.host for n in reservation.nodes), "--kill-on-bad-exit=1", "--exact",
           "--cpus-per-task", str(cpus_per_task)]
    if not spec.cpu:  # every rank sees the step's GPUs on its node and takes the LOCAL_RANK-th, as under DeepSpeed's
        cmd += ["--gpus-per-node", str(per_node), "--gpu-bind=none"]  # launcher; no per-task binding inherited
    cmd += ["--job-name", name, "--export=ALL", sys.executable, "-u", "-m", RANK_MODULE]
    if spec.launcher is not None:  # its ranks' contract (torchrun's), not DeepSpeed's
        cmd += ["--contract", spec.launcher.contract]
    cmd.append(spec.script)
    return cmd + script_arguments(spec, config_path, ds_config)


class SrunStarter:
    """The Slurm backend's `zerotune.run.backends.direct.RankStarter`: each run a job step of this allocation.

    A run is stopped by cancelling its step, found by its unique name in ``squeue --steps`` (Slurm signals every rank
    on every node); the running record names the step as its stop handle, so a rerun after the tuner was killed
    cancels it first (`zerotune.run.processes.reap_orphans`).

    Raises:
        ConfigError: not inside an allocation (``environ`` lacks ``SLURM_JOB_ID``, ``SLURM_JOB_CPUS_PER_NODE``).
    """

    def __init__(self, spec: LaunchSpec, environ: Mapping[str, str] = os.environ):
        self.spec = spec
        self.environ = environ
        self._hosts: list[str] | None = None
        self.job_id = _allocation_env(environ, "SLURM_JOB_ID")
        self.cpus_per_node = min(expand_counts(_allocation_env(environ, "SLURM_JOB_CPUS_PER_NODE")))
        self._steps: dict[str, str] = {}  # run token -> its step's name
        self._scans: dict[str, tuple[float, list[psutil.Process]]] = {}  # run token -> (when, its processes here)

    def cpus_per_task(self, reservation: Reservation) -> int:
        """CPUs per rank: the allocation's CPUs per node (the fewest) over the ranks per node, at least 1."""
        return max(1, self.cpus_per_node // reservation.nodes[0].num_slots)

    def command(self, run: RunLaunch) -> tuple[dict[str, str], list[str]]:
        """The step's environment and ``srun`` line, named ``zerotune-<experiment>-<token's end>``."""
        name = f"zerotune-{run.name}-{run.token[-8:]}"
        self._steps[run.token] = name
        return (step_env(self.spec, run.reservation, run.port, probe_dir=run.exp_dir, config_path=run.config_path),
                srun_command(self.spec, run.reservation, run.config_path, self.cpus_per_task(run.reservation), name))

    def stop_handle(self, token: str) -> dict[str, str] | None:
        """The run's job step: its ranks on other nodes have no process on this machine."""
        return step_handle(self.job_id, self._steps[token]) if token in self._steps else None

    def data_limit(self) -> int | None:
        """None: each rank's is set by the rank wrapper; srun itself runs unlimited."""
        return None

    def ranks(self, proc: subprocess.Popen, token: str) -> list[psutil.Process]:
        """srun's tree and its ranks on this machine (started by slurmd), looked up by token at most every second."""
        when, found = self._scans.get(token, (0.0, []))
        if time.monotonic() - when > _SCAN_S:
            found = run_processes(token)
            self._scans[token] = (time.monotonic(), found)
        return descendants(proc.pid) + [p for p in found if p.pid != proc.pid]

    def stop(self, proc: subprocess.Popen, known: dict[int, psutil.Process], token: str, since: float) -> None:
        """Cancel the run's step while srun runs, wait for srun to exit, kill what is left on this machine, and wait
        until the step has left ``squeue``."""
        name = self._steps.pop(token, "")
        self._scans.pop(token, None)
        step = slurm_step_id(self.job_id, name) if proc.poll() is None else None
        if step is not None:
            subprocess.run(["scancel", "--quiet", step], capture_output=True, timeout=30)
            try:
                proc.wait(timeout=SLURM_STEP_GONE_S)
            except subprocess.TimeoutExpired:
                pass
        kill_tree(proc, known, token, since)
        cancel_slurm_step(self.job_id, name)

    def warm_eligible(self, reservation: Reservation) -> bool:
        """Warm launches are on (every node of the allocation has a server)."""
        return self.spec.warm

    def new_warm_server(self, env: dict[str, str], reservation: Reservation, running_dir: Path) -> SlurmWarmServers:
        """The warm rank servers' step on every node of the allocation, not started."""
        return SlurmWarmServers(self.job_id, self.hosts(), self.spec.script, env, running_dir,
                                0 if self.spec.cpu else reservation.nodes[0].num_slots)

    def hosts(self) -> list[str]:
        """The allocation's nodes (``SLURM_JOB_NODELIST`` expanded), asked of Slurm once."""
        if self._hosts is None:
            self._hosts = hostnames(_allocation_env(self.environ, "SLURM_JOB_NODELIST"))
        return self._hosts

    def warm_launch(self, warm: SlurmWarmServers, run: RunLaunch, env: dict[str, str], cmd: list[str],
                    logs: tuple) -> subprocess.Popen:
        """The cold step (``cmd``) with its tasks attached to the warm servers (``slurm_rank --warm``): each has its
        node's server fork its rank and stands for it in the step. The forked ranks lack the run's token: their peak
        comes from the probe's streams alone."""
        at = cmd.index(RANK_MODULE) + 1  # --warm SOCKET first: the wrapper reads its options in that order
        return popen_cold([*cmd[:at], "--warm", warm.socket_template, *cmd[at:]], env, logs, adopt_orphans)

    def warm_failure(self, proc: subprocess.Popen, exp_dir: Path) -> str:
        """Why a task's warm rank did not run the script (`zerotune.run.backends.slurm_rank.attach`), or ''."""


        if proc.returncode == 0:
            return ""
        try:
            text = (exp_dir / STDERR_LOG).read_text(errors="replace")
        except OSError:
            return ""
        line = next((ln for ln in text.splitlines() if ln.startswith(SETUP_FAILED_LINE)), "")
        return line[len(SETUP_FAILED_LINE):].lstrip(": ")

    def finish(self, exp: Experiment) -> Experiment:
        """A step srun could not create because the allocation is ending is INTERRUPTED (re-run on resume)."""
        if exp.status is Status.FAILED and ALLOCATION_ENDING in exp.error:
            exp.status, exp.error = Status.INTERRUPTED, f"the allocation is ending: {exp.error}"
        return exp

    def training_launch(self, spec: LaunchSpec, reservation: Reservation, config_path: str, master_port: int,
                        ds_config: dict | None = None) -> tuple[dict[str, str], list[str]]:
        """The training's environment additions and ``srun`` line: one step, no probe."""
        return (step_env(spec, reservation, master_port, config_path=config_path),
                srun_command(spec, reservation, config_path, self.cpus_per_task(reservation), "zerotune-train",
                             ds_config=ds_config))


class SlurmBackend(LocalBackend):
    """The local backend's supervision with `SrunStarter` as its starter.

    Raises:

        ConfigError: not inside an allocation.
    """

    def __init__(self, spec: LaunchSpec, environ: Mapping[str, str] = os.environ):
        super().__init__(spec, SrunStarter(spec, environ))
