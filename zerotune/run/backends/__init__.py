"""Backends: where an experiment's processes run (``local``: the deepspeed launcher here; ``ray``; ``slurm``), by
name: `BACKENDS`, each made by `make_backend`, the nodes of those that find their own
(`backend_nodes`)."""
from __future__ import annotations

from zerotune.core.launch import LaunchSpec, Node
from zerotune.run.backends.base import Backend

__all__ = ["BACKENDS", "backend_nodes", "make_backend"]

BACKENDS = ("local", "ray", "slurm")
"""The backends `make_backend` makes, by the name ``--backend`` and ``TuneOptions.backend`` give."""


def make_backend(kind: str, spec: LaunchSpec, ray_address: str | None = None) -> Backend:
    """The backend ``kind`` names (one of `BACKENDS`; Ray is imported only when asked for)."""
    if kind == "slurm":
        from zerotune.run.backends.slurm import SlurmBackend
        return SlurmBackend(spec)
    if kind == "ray":
        from zerotune.run.backends.ray import RayBackend
        return RayBackend(spec, ray_address)
    from zerotune.run.backends.local import LocalBackend
    return LocalBackend(spec)


def backend_nodes(kind: str, cpu: bool, num_gpus: int = -1, num_nodes: int = -1) -> list[Node] | None:
    """The nodes with their device slots that backend ``kind`` finds itself: ``slurm``, its allocation's
    (`zerotune.run.backends.slurm.slurm_nodes`, the first ``num_nodes``, ``num_gpus`` slots each; -1: all);
    None for ``local`` and ``ray``, whose nodes the launcher options select (a hostfile, ``--include``).

    Raises:
        ConfigError: as `zerotune.run.backends.slurm.slurm_nodes` (not inside an allocation, more than it
            has).
    """
    if kind == "slurm":
        from zerotune.run.backends.slurm import slurm_nodes
        return slurm_nodes(cpu, num_gpus, num_nodes)
    return None
