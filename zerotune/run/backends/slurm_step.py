"""Slurm's job steps as a tuner stops them: found by name, cancelled until gone from ``squeue``, and named in a
running record by a stop handle (`step_handle`), so a rerun after a SIGKILLed tuner cancels a step whose ranks
have no process on its machine.

Only the standard library and Slurm's commands: the reaper (`zerotune.run.processes.reap_orphans`) imports it.
"""
from __future__ import annotations

import subprocess
import time
from collections.abc import Mapping
from typing import Any

__all__ = ["SLURM_STEP_GONE_S", "STOP_KIND", "cancel_slurm_step", "cancel_step_handle", "slurm_step_id", "step_handle"]

SLURM_STEP_GONE_S = 30.0  # how long a cancelled Slurm step may take to leave squeue (KillWait and a margin), s
STOP_KIND = "slurm_step"
"""The stop handle's ``kind`` for a Slurm job step (`step_handle`)."""


def slurm_step_id(job_id: str, name: str) -> str | None:
    """The id (``JOB.STEP``) of job ``job_id``'s step named ``name`` in ``squeue --steps``; None when there is none
    (ended, never created, or squeue did not answer)."""
    try:
        out = subprocess.run(["squeue", "--steps", "--noheader", "--jobs", job_id, "--format", "%i %j"],
                             capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    return next((line.split()[0] for line in out.splitlines() if line.split()[1:] == [name]), None)


def cancel_slurm_step(job_id: str, name: str, wait_s: float = SLURM_STEP_GONE_S) -> bool:
    """``scancel`` job ``job_id``'s step named ``name`` (Slurm signals its ranks on every node) until it has left
    ``squeue``, at most ``wait_s`` seconds. Returns whether it is gone (True also when there was none)."""
    deadline = time.monotonic() + wait_s
    while (step := slurm_step_id(job_id, name)) is not None:
        if time.monotonic() >= deadline:
            return False
        subprocess.run(["scancel", "--quiet", step], capture_output=True, timeout=30)
        time.sleep(0.5)
    return True


def step_handle(job_id: str, name: str) -> dict[str, str]:
    """The stop handle of job ``job_id``'s step named ``name``."""
    return {"kind": STOP_KIND, "job_id": job_id, "step_name": name}


def cancel_step_handle(handle: Mapping[str, Any]) -> bool:
    """Cancel the step ``handle`` names; returns whether it is gone (False for a malformed handle)."""

    job_id, name = handle.get("job_id"), handle.get("step_name")
    if not (isinstance(job_id, str) and isinstance(name, str)):
        return False
    return cancel_slurm_step(job_id, name)
