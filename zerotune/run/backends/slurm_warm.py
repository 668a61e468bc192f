"""The warm rank servers of a Slurm allocation: one long-lived job step, a server task on each node, for the life
of a tuning.

Rules: the step overlaps the experiments' steps, so it costs no slot. An experiment is still a step of its own, whose
tasks ask their node's server to fork their ranks (`zerotune.run.backends.slurm_rank.attach`). The step is cancelled
at the tuning's end, by a rerun after a SIGKILLed tuner (`zerotune.run.processes.reap_orphans`), or with the
allocation. On CUDA nodes whose cgroups confine memory, the forked ranks count against the servers' step.
See D303 and docs/clusters.md.
"""
from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path

from zerotune.run.backends.slurm_step import SLURM_STEP_GONE_S, cancel_slurm_step, step_handle
from zerotune.run.processes import RUN_TOKEN_ENV, kill_token, new_run_token, write_running_record
from zerotune.run.store import open_log
from zerotune.run.warm.client import READY_TIMEOUT_S, SERVER_RECORD, STOP_WAIT_S, WarmUnavailable

__all__ = ["SlurmWarmServers", "server_step_command"]

SERVER_MODULE = "zerotune.run.warm.server"


def server_step_command(hosts: list[str], name: str, socket_template: str, script: str, ready_dir: Path,
                        gpus_per_node: int = 0) -> list[str]:
    """The ``srun --overlap`` line of the servers' step ``name``: one task on each of ``hosts``, on CUDA
    (``gpus_per_node`` > 0) with the nodes' GPUs unbound for the forked ranks. Each server accepts on its node-local
    socket (``socket_template``) and then writes ``<node>.json`` into ``ready_dir`` (on the shared filesystem)."""
    cmd = ["srun", "--overlap", "--nodes", str(len(hosts)), "--ntasks", str(len(hosts)), "--ntasks-per-node", "1",
           "--nodelist", ",".join(hosts), "--job-name", name]
    if gpus_per_node > 0:
        cmd += ["--gpus-per-node", str(gpus_per_node), "--gpu-bind=none"]
    return cmd + ["--export=ALL", sys.executable, "-u", "-m", SERVER_MODULE, "--socket", socket_template,
                  "--script", script, "--parent", "0", "--ready", str(ready_dir)]


class SlurmWarmServers:
    """The servers' step of allocation ``job_id`` on ``hosts`` for ``script``, the ranks' environment ``env``.
    Thread-safe; `start` once, `ready` before each launch, `stop` at the end."""

    def __init__(self, job_id: str, hosts: list[str], script: str, env: Mapping[str, str], running_dir: Path,
                 gpus_per_node: int = 0):
        self.job_id, self.hosts, self.script, self.env = job_id, list(hosts), script, dict(env)
        self.running_dir, self.gpus_per_node = Path(running_dir), gpus_per_node
        self.token = new_run_token()
        tag = self.token[-12:]
        self.name = f"zerotune-warm-{tag}"
        self.socket_template = f"/tmp/zerotune-warm-{tag}/{{node}}.sock"
        self.ready_dir = self.running_dir.parent / f".zerotune-warm-{tag}"
        self.log_path = self.running_dir.parent / ".zerotune-warm.log"
        self.proc: subprocess.Popen | None = None
        self.unusable = ""  # why no run is launched warm ('' while it may be)
        self.pings: dict[str, dict] = {}  # node -> its server's ping answer, once ready
        self._lock = threading.Lock()
        self._record: Path | None = None

    def start(self) -> None:
        """Start the servers' step (they preload in the background; `ready` waits for them)."""
        with self._lock:
            if self.proc is None and not self.unusable:
                self._record = write_running_record(self.running_dir, SERVER_RECORD, self.token, None,
                                                    stop=step_handle(self.job_id, self.name))
                env = {**self.env, RUN_TOKEN_ENV: self.token, "PYTORCH_NVML_BASED_CUDA_CHECK": "1"}
                cmd = server_step_command(self.hosts, self.name, self.socket_template, self.script, self.ready_dir,
                                          self.gpus_per_node)
                with open_log(self.log_path) as out:
                    self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=out, env=env,
                                                 start_new_session=True)

    def ready(self, stop: threading.Event | None = None) -> None:
        """Wait until every node's server has preloaded and accepts (its ready file), and whether it can launch.

        Raises:
            WarmUnavailable: the step ended or was not ready within ``READY_TIMEOUT_S``, a server is not fork-safe,
                or ``stop`` was set.
        """
        with self._lock:
            if self.unusable:
                raise WarmUnavailable(self.unusable)
            if len(self.pings) == len(self.hosts):
                return
            if self.proc is None:
                raise WarmUnavailable("the warm servers' step was not started")
            deadline = time.monotonic() + READY_TIMEOUT_S
            while len(self.pings) < len(self.hosts):
                self._read_pings()
                if self.proc.poll() is not None and len(self.pings) < len(self.hosts):
                    self.unusable = (f"the warm servers' step ended ({self.proc.returncode}) before every node's "
                                     f"server was ready: see {self.log_path}")
                elif time.monotonic() > deadline:
                    self.unusable = f"the warm servers were not ready in {READY_TIMEOUT_S:g} s"
                if self.unusable:
                    raise WarmUnavailable(self.unusable)
                if stop is not None and stop.is_set():
                    raise WarmUnavailable("the tuning was stopped while the warm servers preloaded")
                time.sleep(0.05)
            unsafe = {node: ping["unsafe"] for node, ping in self.pings.items() if ping.get("unsafe")}
            if unsafe:
                self.unusable = f"the warm servers are not fork-safe: {unsafe}"
                raise WarmUnavailable(self.unusable)

    def _read_pings(self) -> None:
        for host in self.hosts:
            if host not in self.pings:
                try:
                    self.pings[host] = json.loads((self.ready_dir / f"{host}.json").read_text())
                except (OSError, ValueError):
                    pass

    def stop(self) -> None:
        """Cancel the servers' step (their runs end with them), end its srun, kill what carries its token here, and
        remove its record and ready files."""

        with self._lock:
            proc, self.proc = self.proc, None
            self.unusable = self.unusable or "the warm servers were stopped"
        if proc is not None:
            cancel_slurm_step(self.job_id, self.name)
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=SLURM_STEP_GONE_S + STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            kill_token(self.token)
        if self._record is not None:
            self._record.unlink(missing_ok=True)
        shutil.rmtree(self.ready_dir, ignore_errors=True)
        shutil.rmtree(Path(self.socket_template).parent, ignore_errors=True)  # this node's; a server removes its own
