"""Backends by name (`BACKENDS`): where an experiment's processes run, made by `make_backend`."""
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
    """The nodes with their device slots that backend ``kind`` finds itself: ``slurm``'s allocation
    (`zerotune.run.backends.slurm.slurm_nodes`); None for ``local`` and ``ray`` (the launcher options select them).

    Raises:
        ConfigError: as `zerotune.run.backends.slurm.slurm_nodes`.
    """

    if kind == "slurm":
        from zerotune.run.backends.slurm import slurm_nodes
        return slurm_nodes(cpu, num_gpus, num_nodes)
    return None
