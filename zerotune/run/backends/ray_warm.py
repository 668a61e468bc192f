"""The Ray backend's warm rank servers: a host actor per node, for the life of a tuning.

An experiment's actor (`zerotune.run.backends._ray_node.NodeLauncher`) lives for one run, so each node an
experiment's first bundle lands on gets one `WarmHost` actor (no CPU, no GPU, pinned), started at the first such
experiment and killed at the tuning's end. The experiment's actor reaches its node's server by its socket and
supervises the forked run as on one machine. Multi-node experiments go cold, through DeepSpeed's runner (D303).
"""
from __future__ import annotations

import socket
import threading
from pathlib import Path

from zerotune.core.launch import LaunchSpec, Node, Reservation
from zerotune.run.backends.direct import warm_server_env
from zerotune.run.slots import LOCALHOST
from zerotune.run.warm.client import SERVER_RECORD, WarmServer, WarmUnavailable

__all__ = ["WarmHost", "WarmHosts"]

POLL_S = 0.5


class WarmHost:
    """The Ray actor that owns (as parent) its node's warm server for ``spec``'s script; the server's running record
    is named after the node, under ``running_dir``."""


    def __init__(self, spec: LaunchSpec, running_dir: str):
        running = Path(running_dir)
        self.server = WarmServer(spec.script, warm_server_env(spec, Reservation((Node(LOCALHOST, (0,)),)), running),
                                 running, record=f"{SERVER_RECORD}-{socket.gethostname()}")
        self.server.start()

    def socket(self) -> tuple[str, str]:
        """Wait until the server is ready: (its socket path, '') or ('', why it cannot launch)."""
        try:
            self.server.ready()
        except WarmUnavailable as e:
            return "", str(e)
        return str(self.server.socket_path), ""

    def stop(self) -> None:
        """Stop the server (every run it launched ends with it)."""
        self.server.stop()


class WarmHosts:
    """The driver's side: one `WarmHost` per Ray node id, made on first use with ``ray``'s API."""

    def __init__(self, ray, spec: LaunchSpec, running_dir: Path):
        self.ray, self.spec, self.running_dir = ray, spec, running_dir
        self._hosts: dict[str, object] = {}
        self._lock = threading.Lock()
        self._remote = None

    def socket_on(self, node_id: str, cancelled: threading.Event) -> tuple[str, str]:
        """The warm server socket on node ``node_id``: (path, '') once it is ready, or ('', why not)."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        with self._lock:
            if self._remote is None:
                self._remote = self.ray.remote(WarmHost)
            if node_id not in self._hosts:
                self._hosts[node_id] = self._remote.options(
                    num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)
                ).remote(self.spec, str(self.running_dir))
            host = self._hosts[node_id]
        ref = host.socket.remote()
        while not self.ray.wait([ref], timeout=POLL_S)[0]:
            if cancelled.is_set():
                return "", "the tuning was stopped while the warm server preloaded"
        try:
            return tuple(self.ray.get(ref))
        except self.ray.exceptions.RayError as e:
            return "", f"the warm host actor failed: {type(e).__name__}: {str(e)[:200]}"

    def stop(self) -> None:
        """Stop every node's server, then kill its actor."""
        with self._lock:
            hosts, self._hosts = list(self._hosts.values()), {}
        for host in hosts:
            try:
                self.ray.get(host.stop.remote(), timeout=60)
            except Exception:  # noqa: BLE001 - the actor may be gone already; the kill below ends it anyway
                pass
            self.ray.kill(host)
