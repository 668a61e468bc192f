"""Stop handles: what a running record (:func:`~zerotune.run.processes.write_running_record`) names, besides the
run's token, launcher and master port, so that a later tuner can stop the run once the tuner that started it is
gone: something the run holds outside this machine's processes.

A handle is a JSON object with a ``kind``; each kind is a backend's, stopped by that backend's canceller
(:data:`CANCELLERS`): ``slurm_step``, a Slurm job step (:mod:`zerotune.run.backends.slurm_step`). The local backend's
runs have none: their token and their launcher's session find every process.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from zerotune.run.backends.slurm_step import STOP_KIND, cancel_step_handle, legacy_handle

__all__ = ["CANCELLERS", "cancel_handle", "record_handle"]

CANCELLERS: dict[str, Callable[[Mapping[str, Any]], bool]] = {STOP_KIND: cancel_step_handle}
"""Each handle kind's canceller: it stops what the handle names and returns whether it is gone."""


def record_handle(record: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The stop handle of a running record: its ``stop`` object, or in a record an older zerotune wrote, the Slurm
    step its own keys name (:func:`~zerotune.run.backends.slurm_step.legacy_handle`); None when it has none."""
    handle = record.get("stop")
    return handle if isinstance(handle, Mapping) else legacy_handle(record)


def cancel_handle(handle: Mapping[str, Any] | None) -> bool:
    """Stop what ``handle`` names through its kind's canceller. Returns whether it is gone; False for no handle or
    a kind this zerotune does not know (a newer one's)."""
    kind = handle.get("kind") if handle is not None else None
    canceller = CANCELLERS.get(kind) if isinstance(kind, str) else None
    return canceller(handle) if canceller is not None else False
