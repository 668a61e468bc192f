"""How a run's ranks are started and stopped: the starter a supervising backend composes.

`zerotune.run.backends.local.LocalBackend` supervises a run whatever starts it; its starter (`RankStarter`) says what
starts the ranks, which processes are theirs and how they stop. `DirectStarter` starts them from this machine:
DeepSpeed's per-node launcher (or the user's) as a subprocess, DeepSpeed's runner over ssh for several nodes, and,
on this machine alone, forked from a warm rank server (`zerotune.run.warm`). Slurm's starts job steps
(`zerotune.run.backends.slurm.SrunStarter`).
"""
from __future__ import annotations

import os
import subprocess
import threading
from pathlib import Path
from typing import Protocol

import psutil

from zerotune.core.experiment import Experiment
from zerotune.core.launch import LaunchSpec, Reservation, RunLaunch
from zerotune.deepspeed.launcher import launch_command, launch_env, multi_node, script_arguments
from zerotune.deepspeed.rank_env import RUNNER_ENV_FILE, runner_env_file
from zerotune.launchers.contract import DEEPSPEED
from zerotune.probe import BUDGET_ENV, PROBE_DIR_ENV
from zerotune.run import expdir
from zerotune.run.processes import RUN_TOKEN_ENV, descendants, kill_token_on, kill_tree
from zerotune.run.warm.client import WarmRun, WarmServer
from zerotune.run.warm.rank import SETUP_FAILED

__all__ = ["DirectStarter", "RankStarter", "warm_note", "warm_server_env"]


class RankStarter(Protocol):
    """What a supervising backend asks of the thing that starts a run's ranks (`DirectStarter`, the Slurm
    backend's ``SrunStarter``); ``spec`` is the backend's, replaced with it
    (`zerotune.run.backends.local.LocalBackend.use_spec`)."""

    spec: LaunchSpec

    def command(self, run: RunLaunch) -> tuple[dict[str, str], list[str]]:
        """The environment additions (shown in ``cmd.txt``) and the cold command that start ``run``'s ranks."""

    def stop_handle(self, token: str) -> dict[str, str] | None:
        """What a later tuner needs, besides the token and the launcher's session, to stop the run of ``token``
        (`zerotune.run.backends.stop_handles`)."""

    def data_limit(self) -> int | None:
        """The ``RLIMIT_DATA`` the started command gets, bytes (None: none)."""

    def ranks(self, proc, token: str) -> list[psutil.Process]:
        """The run's processes to watch (sampled for peak memory, killed at the end)."""

    def stop(self, proc, known: dict[int, psutil.Process], token: str, since: float) -> None:
        """Stop the run and return once every process of it is gone."""

    def warm_eligible(self, reservation: Reservation) -> bool:
        """Whether runs on ``reservation`` go warm."""

    def new_warm_server(self, env: dict[str, str], reservation: Reservation, running_dir: Path):
        """The warm server (not started) whose ranks get ``env``."""

    def warm_launch(self, warm, run: RunLaunch, env: dict[str, str], cmd: list[str], logs: tuple):
        """Launch ``run`` from ``warm`` (``cmd``: the cold command; ``env``: the whole environment; ``logs``: the open
        ``stdout.log`` and ``stderr.log``). Raises ``WarmUnavailable`` when it cannot."""

    def warm_failure(self, proc, exp_dir: Path) -> str:
        """Why the warm run ``proc`` failed for a reason of the warm start's ('' when it did not)."""

    def finish(self, exp: Experiment) -> Experiment:
        """``exp``'s outcome as the starter knows it better than the supervisor (a step the allocation refused)."""

    def training_launch(self, spec: LaunchSpec, reservation: Reservation, config_path: str, master_port: int,
                        ds_config: dict | None = None) -> tuple[dict[str, str], list[str]] | None:
        """The environment additions and the command that train (``zerotune run``, ``cmd_optimal.txt``); None: the
        ``deepspeed`` runner's line."""


class DirectStarter:
    """Starts a run's ranks from this machine (see the module docstring); one per backend, thread-safe."""

    def __init__(self, spec: LaunchSpec):
        self.spec = spec
        self._remote: dict[str, list[str]] = {}  # run token -> the hosts of a multi-node run
        self._lock = threading.Lock()

    def command(self, run: RunLaunch) -> tuple[dict[str, str], list[str]]:
        """DeepSpeed's launcher on ``run.reservation`` (the caller adds the run's token to the environment); on
        several nodes, the environment also goes into the runner's env file ``exp_dir/deepspeed_env``."""
        env = launch_env(self.spec, run.reservation, probe_dir=run.exp_dir, config_path=run.config_path)
        if multi_node(self.spec, run.reservation):  # the token too, so the other nodes' ranks are found by it
            env.update(runner_env_file({**env, RUN_TOKEN_ENV: run.token}, run.exp_dir / RUNNER_ENV_FILE))
            with self._lock:
                self._remote[run.token] = [n.host for n in run.reservation.nodes]
        return env, launch_command(self.spec, run.reservation, run.config_path, run.port, direct=True)

    def stop_handle(self, token: str) -> dict[str, str] | None:
        """None: the token and the session find every process of a run started here."""
        return None

    def data_limit(self) -> int | None:
        """The CPU ranks' budget (inherited by the launcher's ranks); none on CUDA."""
        return self.spec.device_memory_bytes if self.spec.cpu else None

    def ranks(self, proc, token: str) -> list[psutil.Process]:
        """The launcher's tree."""
        return descendants(proc.pid)

    def stop(self, proc, known: dict[int, psutil.Process], token: str, since: float) -> None:
        """`zerotune.run.processes.kill_tree`; a multi-node run's runner is first SIGKILLed alone (its SIGTERM handler
        would pkill every DeepSpeed launcher on its hosts), then its processes on every node by token."""
        with self._lock:
            hosts = self._remote.pop(token, None)
        if hosts is not None:
            if proc.poll() is None:
                proc.kill()
            kill_token_on(hosts, token)
        kill_tree(proc, known, token, since)

    def warm_eligible(self, reservation: Reservation) -> bool:
        """Warm launches are on, the launcher's ranks can be forked (`warm_note`), and the run is this machine's."""

        return self.spec.warm and not warm_note(self.spec) and [n.host for n in reservation.nodes] == [
            "localhost"] and not multi_node(self.spec, reservation)

    def new_warm_server(self, env: dict[str, str], reservation: Reservation, running_dir: Path) -> WarmServer:
        """This machine's warm server."""
        return WarmServer(self.spec.script, env, running_dir)

    def warm_launch(self, warm: WarmServer, run: RunLaunch, env: dict[str, str], cmd: list[str],
                    logs: tuple) -> WarmRun:
        """The server's launch request (`warm_request`)."""
        return warm.launch(warm_request(self.spec, run, env, self.data_limit()))

    def warm_failure(self, proc: WarmRun, exp_dir: Path) -> str:
        """Its server went away, or its ranks failed before the script started."""
        if proc.lost:
            return "its warm server went away during the run"
        if proc.returncode == SETUP_FAILED:
            return "its warm ranks failed before the script started (stderr.log says why)"
        return ""

    def finish(self, exp: Experiment) -> Experiment:
        return exp

    def training_launch(self, spec: LaunchSpec, reservation: Reservation, config_path: str, master_port: int,
                        ds_config: dict | None = None) -> tuple[dict[str, str], list[str]] | None:
        return None


def warm_server_env(spec: LaunchSpec, reservation: Reservation, running_dir: Path) -> dict[str, str]:
    """A warm server's environment (its imports need the ranks' accelerator, ``PYTHONPATH``, the extension cache):
    this process's with the launch's, less the probe variables each run's request carries."""
    env = {**os.environ, **launch_env(spec, reservation, probe_dir=running_dir)}  # the exps dir's cache, beside it
    env.pop(PROBE_DIR_ENV, None)
    env.pop(BUDGET_ENV, None)
    return env


def warm_note(spec: LaunchSpec) -> str:
    """Why ``spec``'s ranks cannot be forked warm ('' when they can; `zerotune.core.launch.UserLauncher.warm_note`)."""
    return spec.launcher.warm_note() if spec.launcher is not None else ""


def warm_request(spec: LaunchSpec, run: RunLaunch, env: dict[str, str], data_limit: int | None) -> dict:
    """The warm server's launch request for ``run`` on this machine (`zerotune.run.warm.server`): the direct
    launch's command line as data; ``env``: the ranks' whole environment."""

    contract = spec.launcher.contract if spec.launcher is not None else DEEPSPEED
    return {"script": spec.script, "args": script_arguments(spec, run.config_path), "env": env, "cwd": os.getcwd(),
            "contract": contract, "slots": list(run.reservation.nodes[0].slots), "master_addr": "127.0.0.1",
            "master_port": run.port, "stdout": str(run.exp_dir / expdir.STDOUT_LOG),
            "stderr": str(run.exp_dir / expdir.STDERR_LOG), "data_limit": data_limit,
            "probe_dir": str(run.exp_dir.resolve()), "token": run.token}


def popen_cold(cmd: list[str], env: dict[str, str], logs: tuple, preexec_fn) -> subprocess.Popen:
    """Start a cold command in a session of its own, its output into ``logs`` (stdout, stderr), no stdin."""
    return subprocess.Popen(cmd, stdout=logs[0], stderr=logs[1], stdin=subprocess.DEVNULL, env=env,
                            start_new_session=True, preexec_fn=preexec_fn)
