"""The Ray backend: each experiment in its own Ray placement group, the ``deepspeed`` launcher inside it.

How one experiment runs: `RayBackend.run`; what runs on its node: `zerotune.run.backends._ray_node`. Cluster rules:
- The experiment directory must be on a filesystem shared by this machine and the Ray nodes, and the script, its
  data and zerotune at the same paths on every node; a node that cannot see the directory fails the experiment.
- Several nodes need passwordless ssh between them, as any multi-node DeepSpeed run (its pdsh runner).
- Bundles ask for Ray's ``GPU`` resource: without GPUs give the cluster logical ones (``ray start --head --num-gpus
  2``) and run the ranks on CPU (``DS_ACCELERATOR=cpu``); the GPU ids then only count ranks.
- Ray is optional (``pip install 'zerotune[ray]'``), imported only when the backend first connects (a dry run never).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import threading
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from zerotune.core.errors import ConfigError
from zerotune.core.experiment import Experiment, Status
from zerotune.core.launch import LaunchSpec, Reservation
from zerotune.deepspeed.rank_env import passed_env
from zerotune.run.backends._ray_node import DISPATCH_MARKER, NodeLauncher, _granted_slots
from zerotune.run.backends.base import Backend
from zerotune.run.backends.ray_warm import WarmHosts
from zerotune.run.processes import RUNNING_DIR

__all__ = ["RayBackend", "import_ray", "node_spec", "require_ray"]

POLL_S = 0.5
INSTALL_HINT = "install it with: pip install 'zerotune[ray]'"


def import_ray():
    """Import Ray.

    Raises:
        ConfigError: Ray is not installed (``pip install 'zerotune[ray]'``).
    """
    try:
        import ray
    except ImportError as e:
        raise ConfigError(f"--backend ray needs Ray, which is not installed ({e}); {INSTALL_HINT}") from None
    return ray


def require_ray() -> None:
    """Check that Ray is installed without importing it (an import costs seconds and fixes Ray's environment for the
    whole process; a dry run launches nothing).

    Raises:
        ConfigError: Ray is not installed (``pip install 'zerotune[ray]'``).
    """
    if importlib.util.find_spec("ray") is None:
        raise ConfigError(f"--backend ray needs Ray, which is not installed; {INSTALL_HINT}")


class RayBackend(Backend):
    """Runs each experiment in a Ray placement group on a Ray cluster.

    Args:
        address: the Ray cluster, e.g. ``"10.0.0.1:6379"`` or ``"auto"``; ``None`` connects to ``$RAY_ADDRESS``
            when set, else starts a local Ray instance. An existing ``ray.init`` connection wins over it.

    Raises:
        ConfigError: Ray is not installed.
    """

    def __init__(self, spec: LaunchSpec, address: str | None = None):
        self.spec = spec
        self.address = address
        require_ray()
        self._ray_module = None  # imported on first use (connect): a dry run never imports it
        self._cancelled = threading.Event()
        self._lock = threading.Lock()
        self._running: dict[str, Any] = {}  # experiment name -> its launcher actor
        self._remote_cache: tuple | None = None
        self._warm: WarmHosts | None = None

    @property
    def _ray(self):
        if self._ray_module is None:
            self._ray_module = import_ray()
        return self._ray_module

    def connect(self) -> None:
        """Connect this process to the Ray cluster, once (on the first ``run``, so a dry run never touches Ray).

        Raises:
            ConfigError: the cluster cannot be reached at ``address``.
        """
        with self._lock:
            if self._ray.is_initialized():
                return
            try:
                self._ray.init(address=self.address, log_to_driver=False)
            except (ConnectionError, RuntimeError, ValueError) as e:
                where = f"at {self.address}" if self.address else "(no --address: $RAY_ADDRESS or a new local instance)"
                raise ConfigError(f"cannot connect to the Ray cluster {where}: {e}") from None

    def run(self, exp: Experiment, reservation: Reservation, exp_dir: Path) -> Experiment:
        """Run ``exp`` (updated in place and returned) in a placement group shaped like ``reservation``.

        Ray decides which nodes and GPU ids:
        1. A placement group, one ``{"GPU": slots, "CPU": 1}`` bundle per node (``STRICT_PACK`` on one node,
           ``STRICT_SPREAD`` on several), waited for at most the experiment timeout.
        2. On several nodes a probe task in each other bundle reports its node's IP and GPU ids into
           ``exp_dir/hostfile`` for the launcher's ``--hostfile --force_multi``.
        3. A `NodeLauncher` actor in bundle 0 runs `LocalBackend` on its node with `node_spec` (one node: ranks forked
           from its warm server, `zerotune.run.backends.ray_warm`).
        4. The actor is killed and the group removed, whatever happened.

        Outcomes are as for `LocalBackend`, plus: TIMEOUT when the group is not placed within the experiment timeout;
        FAILED, without waiting, when the cluster cannot be reached or has no node big enough for a bundle; FAILED
        when the node cannot see ``exp_dir`` or Ray loses the actor; INTERRUPTED after `cancel_all`.
        """
        ray = self._ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        exp_dir = Path(exp_dir).resolve()
        exp_dir.mkdir(parents=True, exist_ok=True)
        bundles = [{"GPU": float(n.num_slots), "CPU": 1.0} for n in reservation.nodes]
        strategy = "STRICT_PACK" if len(bundles) == 1 else "STRICT_SPREAD"
        shape = f"{len(bundles)} x {{GPU: {reservation.nodes[0].num_slots}, CPU: 1}} {strategy}"
        start = time.monotonic()
        try:
            self.connect()
        except ConfigError as e:
            return _finish(exp, Status.FAILED, str(e), start)
        unfit = _unfit_reason(ray.nodes(), reservation, strategy)
        if unfit:
            return _finish(exp, Status.FAILED, f"Ray cannot place {shape}: {unfit}", start)

        pg = placement_group(bundles, strategy=strategy, name=f"zerotune-{exp.name}-{uuid.uuid4().hex[:6]}")
        actor = None
        try:
            outcome = self._wait_placed(pg)
            if outcome is not None:
                status, why = outcome
                return _finish(exp, status, f"Ray placement group {shape} {why}", start)

            def in_bundle(i: int) -> PlacementGroupSchedulingStrategy:
                return PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i)

            probe, launcher = self._remotes()
            others = ray.get([probe.options(num_cpus=0, num_gpus=float(n.num_slots), scheduling_strategy=in_bundle(i))
                              .remote() for i, n in enumerate(reservation.nodes) if i > 0])
            warm, cold_why = self._warm_socket(pg, reservation, exp_dir.parent / RUNNING_DIR)
            token = uuid.uuid4().hex
            (exp_dir / DISPATCH_MARKER).write_text(token)
            actor = launcher.options(num_cpus=1, num_gpus=float(reservation.nodes[0].num_slots),
                                     scheduling_strategy=in_bundle(0)).remote(node_spec(self.spec))
            with self._lock:
                self._running[exp.name] = actor
            if self._cancelled.is_set():
                return _finish(exp, Status.INTERRUPTED, "the tuner was interrupted", start)
            done = ray.get(actor.run.remote(exp, str(exp_dir), token, os.getcwd(), others, warm))
            for f in dataclasses.fields(Experiment):
                setattr(exp, f.name, getattr(done, f.name))
            if cold_why and not exp.launch_note:
                exp.launch_note = f"launched cold: {cold_why}"
            return exp
        except ray.exceptions.RayError as e:
            status = Status.INTERRUPTED if self._cancelled.is_set() else Status.FAILED
            return _finish(exp, status, f"Ray error: {type(e).__name__}: {str(e)[:300]}", start)
        finally:
            with self._lock:
                self._running.pop(exp.name, None)
            (exp_dir / DISPATCH_MARKER).unlink(missing_ok=True)
            if actor is not None:
                ray.kill(actor)
            remove_placement_group(pg)

    def _warm_socket(self, pg, reservation: Reservation, running_dir: Path) -> tuple[str, str]:
        """(the warm server's socket on ``pg``'s first node, ''); ('', why) when it cannot launch; ('', '') when the
        run goes cold by rule (warm launches off, several nodes)."""
        if not self.spec.warm or reservation.num_nodes > 1:
            return "", ""
        from ray.util import placement_group_table

        with self._lock:
            if self._warm is None:
                self._warm = WarmHosts(self._ray, node_spec(self.spec), running_dir)
        node_id = placement_group_table(pg)["bundles_to_node_id"][0]
        return self._warm.socket_on(node_id, self._cancelled)

    def close(self) -> None:
        """Stop the warm servers' host actors, if any were started."""
        with self._lock:
            warm, self._warm = self._warm, None
        if warm is not None:
            warm.stop()

    def _remotes(self):
        """The probe task and the launcher actor class as Ray remotes (made once)."""
        with self._lock:
            if self._remote_cache is None:
                self._remote_cache = (self._ray.remote(_granted_slots),
                                      self._ray.remote(max_concurrency=2)(NodeLauncher))
            return self._remote_cache

    def _wait_placed(self, pg) -> tuple[Status, str] | None:
        """Wait until Ray places ``pg``: None when placed, else (status, why) after the timeout or `cancel_all`."""
        ready = pg.ready()
        start = time.monotonic()
        while True:
            done, _ = self._ray.wait([ready], timeout=POLL_S)
            if done:
                return None
            if self._cancelled.is_set():
                return Status.INTERRUPTED, "not placed before the tuner was interrupted"
            waited = time.monotonic() - start
            if self.spec.timeout_s is not None and waited > self.spec.timeout_s:
                return Status.TIMEOUT, (f"not placed after {self.spec.timeout_s:g} s: the cluster's GPUs are "
                                        f"held by other work (available now: {self._ray.available_resources()})")

    def cancel_all(self) -> None:
        """Stop every running experiment (each node's `LocalBackend` kills its launcher); they end INTERRUPTED."""
        self._cancelled.set()
        with self._lock:
            actors = list(self._running.values())
        for actor in actors:
            actor.cancel.remote()


def node_spec(spec: LaunchSpec, environ: Mapping[str, str] = os.environ) -> LaunchSpec:
    """``spec`` with the tuner's communication settings (`zerotune.deepspeed.rank_env.passed_env`) in ``extra_env``,
    for an experiment's node: the actor runs with the raylet's environment, not the tuner's."""
    return dataclasses.replace(spec, extra_env={**passed_env(environ), **spec.extra_env})


def _unfit_reason(nodes: list[dict], reservation: Reservation, strategy: str) -> str:
    """Why the cluster's live nodes can never hold the bundles (total, not free, resources; an autoscaling cluster's
    nodes must be up), or ''."""

    gpus = reservation.nodes[0].num_slots
    alive = [n for n in nodes if n.get("Alive")]
    big = [n for n in alive if n["Resources"].get("GPU", 0) >= gpus and n["Resources"].get("CPU", 0) >= 1]
    need = reservation.num_nodes if strategy == "STRICT_SPREAD" else 1
    if len(big) >= need:
        return ""
    have = ", ".join(f"{n['NodeManagerAddress']}: GPU={n['Resources'].get('GPU', 0):g} "
                     f"CPU={n['Resources'].get('CPU', 0):g}" for n in alive) or "no live node"
    return (f"it needs {need} node(s) with {gpus} GPU(s) and 1 CPU each, the cluster has {len(big)} ({have}); "
            "on CPU give Ray logical GPUs, e.g. ray start --head --num-gpus N")


def _finish(exp: Experiment, status: Status, error: str, start: float) -> Experiment:
    exp.status, exp.error = status, error
    exp.metric, exp.metrics = None, {}
    exp.wall_s = round(time.monotonic() - start, 3)
    return exp
