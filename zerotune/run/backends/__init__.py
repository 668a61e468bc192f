"""Backends: where an experiment's processes run (``local``: the deepspeed launcher here; ``ray``; ``slurm``)."""
from __future__ import annotations

from zerotune.core.launch import LaunchSpec
from zerotune.run.backends.base import Backend


def make_backend(kind: str, spec: LaunchSpec, ray_address: str | None = None) -> Backend:
    """The backend ``kind`` names (``local``, ``ray`` or ``slurm``; Ray is imported only when asked for)."""
    if kind == "slurm":
        from zerotune.run.backends.slurm import SlurmBackend
        return SlurmBackend(spec)
    if kind == "ray":
        from zerotune.run.backends.ray import RayBackend
        return RayBackend(spec, ray_address)
    from zerotune.run.backends.local import LocalBackend
    return LocalBackend(spec)
