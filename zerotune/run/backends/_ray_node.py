"""What runs on a Ray node for the Ray backend (`zerotune.run.backends.ray`): the `NodeLauncher` actor on an
experiment's first node, a `LocalBackend` for one run, with the reaper process that stops its launchers if Ray kills
it; the probe task reporting a node's IP and granted GPU ids; the dispatch marker the node checks. Ray ships these by
reference to this module, so it must stay importable on every node (zerotune installed at the same path).
"""
from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

from zerotune.core.experiment import Experiment, Status
from zerotune.core.launch import LaunchSpec, Node, Reservation
from zerotune.run.backends.local import LocalBackend
from zerotune.run.slots import LOCALHOST
from zerotune.run.warm.client import AttachedWarmServer

__all__ = ["DISPATCH_MARKER", "NodeLauncher"]

DISPATCH_MARKER = ".zerotune_dispatch"  # written in exp_dir by the driver, checked by the node
POLL_S = 0.5


class NodeLauncher:
    """The Ray actor on the first node of an experiment: a `LocalBackend` for one run; threaded
    (``max_concurrency=2``) so that `cancel` is served while `run` runs.

    A launcher leads its own session and would outlive an actor Ray kills, so a reaper process is told each
    launcher's group and, when the actor's end closes its stdin, sends them TERM, then KILL after 10 s. This covers
    this node only: a multi-node run's other ranks are then left to fail on the broken rendezvous.
    """

    def __init__(self, spec: LaunchSpec):
        self.spec = dataclasses.replace(spec, warm=False)  # warm only through its node's host actor (run)
        self.backend = LocalBackend(self.spec)
        self._reaper = subprocess.Popen([sys.executable, "-c", _REAPER], stdin=subprocess.PIPE,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                        start_new_session=True, text=True)
        self._reaper.wait()  # the forked reaper lives on, reading the pipe

    def run(self, exp: Experiment, exp_dir: str, token: str, cwd: str, others: list[tuple[str, list[int]]],
            warm_socket: str = "") -> Experiment:
        """Run ``exp`` with the launcher on this node, on the GPUs Ray granted; returns ``exp`` with its outcome.

        Args:
            exp_dir: its directory (absolute; on a shared filesystem).
            token: the content of the dispatch marker the driver wrote in ``exp_dir``.
            cwd: the driver's working directory, so relative paths in the script's arguments mean the same.
            others: ``(node IP, GPU ids)`` of the other bundles, in order (multi-node only).
            warm_socket: the node's warm server ('': launch cold).
        """
        path = Path(exp_dir)
        try:
            seen = (path / DISPATCH_MARKER).read_text()
        except OSError:
            seen = None
        if seen != token:
            exp.status = Status.FAILED
            exp.error = (f"node {socket.gethostname()} cannot see the experiment directory {exp_dir}: "
                         "the Ray backend needs the results dir on a filesystem shared with the nodes")
            return exp
        if os.path.isdir(cwd):
            os.chdir(cwd)
        mine = _granted_slots()
        if others:
            nodes = [Node(ip, tuple(ids)) for ip, ids in [mine, *others]]
            hostfile = path / "hostfile"
            hostfile.write_text("".join(f"{n.host} slots={max(n.slots) + 1}\n" for n in nodes))
            spec = dataclasses.replace(self.spec, hostfile=str(hostfile))
        else:
            nodes = [Node(LOCALHOST, tuple(mine[1]))]
            spec = dataclasses.replace(self.spec, hostfile=None)
        self.backend.use_spec(dataclasses.replace(spec, warm=bool(warm_socket)))
        self.backend._warm = AttachedWarmServer(warm_socket) if warm_socket else None
        running = threading.Event()
        watch = threading.Thread(target=self._report_launchers, args=(running,), daemon=True)
        running.set()
        watch.start()
        try:
            return self.backend.run(exp, Reservation(tuple(nodes)), path)
        finally:
            running.clear()
            watch.join()

    def _report_launchers(self, running: threading.Event) -> None:
        """While ``running``, tell the reaper ``+PGID`` for each launcher this actor starts; ``-PGID`` after."""

        me, told = psutil.Process(), set()
        while running.is_set():
            for child in me.children():
                try:
                    if child.pid not in told and os.getpgid(child.pid) == child.pid:
                        self._tell(f"+{child.pid}")
                        told.add(child.pid)
                except (OSError, psutil.Error):
                    pass
            time.sleep(POLL_S / 2)
        for pid in told:
            self._tell(f"-{pid}")

    def _tell(self, line: str) -> None:
        try:
            self._reaper.stdin.write(line + "\n")
            self._reaper.stdin.flush()
        except OSError:
            pass

    def cancel(self) -> None:
        """Stop the running experiment (its outcome becomes INTERRUPTED)."""
        self.backend.cancel_all()


# The reaper (``python -c``): forks away from the actor (whose direct children Ray kills with it),
# reads ``+PGID``/``-PGID`` lines, and at end of input (the actor exited or was killed) stops the
# process groups still listed: TERM, then KILL after 10 s.
_REAPER = """
import os, signal, sys, time
if os.fork():  # leave the actor's children: Ray kills those with the actor
    os._exit(0)
groups = set()
for line in sys.stdin:
    line = line.strip()
    if line[1:].isdigit():
        (groups.add if line[0] == "+" else groups.discard)(int(line[1:]))

def signal_all(sig):
    alive = set()
    for g in groups:
        try:
            os.killpg(g, sig)
            alive.add(g)
        except OSError:
            pass
    return alive

signal_all(signal.SIGTERM)
deadline = time.monotonic() + 10
while signal_all(0) and time.monotonic() < deadline:
    time.sleep(0.2)
signal_all(signal.SIGKILL)
"""


def _granted_slots() -> tuple[str, list[int]]:
    """In a Ray task or actor: this node's IP and the GPU ids Ray granted, ascending."""
    import ray

    return ray.util.get_node_ip_address(), sorted(int(i) for i in ray.get_gpu_ids())
