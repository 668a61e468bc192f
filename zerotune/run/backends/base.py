"""The backend interface: run one experiment on reserved slots and classify its outcome.

A backend knows how to start the ``deepspeed`` launcher somewhere (a subprocess here, a Ray
placement group elsewhere); it never decides what to run or when.
"""
from __future__ import annotations

import abc
import re
from dataclasses import dataclass, field
from pathlib import Path

from zerotune.core.experiment import Experiment, Status
from zerotune.core.objective import OBJECTIVES, Objective
from zerotune.run.resources import Reservation


@dataclass(frozen=True)
class LaunchSpec:
    """How to launch the user's training script, the same for every experiment.

    Attributes:
        script: the training script path.
        script_args: its arguments, including the ds_config flag (the path is replaced per
            experiment).
        cpu: run DeepSpeed on CPU (``DS_ACCELERATOR=cpu``, one rank per slot).
        device_memory_bytes: per-rank memory budget. On CPU it is enforced for real with
            ``RLIMIT_DATA`` on every rank, so an over-budget config fails as a GPU OOM does.
        timeout_s: wall-clock limit per experiment (None: no limit).
        hang_timeout_s: kill an experiment whose logs have not grown for this long (None: off).
        hostfile: passed to the launcher for multi-node reservations.
        start_profile_step, end_profile_step: the ``autotuning`` settings written into each
            experiment's config so DeepSpeed's engine measures and exits.
        objective: the metric DeepSpeed is asked to write, and how to read it.
    """

    script: str
    script_args: tuple[str, ...]
    cpu: bool = False
    device_memory_bytes: int | None = None
    timeout_s: float | None = None
    hang_timeout_s: float | None = None
    hostfile: str | None = None
    start_profile_step: int = 3
    end_profile_step: int = 5
    objective: Objective = OBJECTIVES["throughput"]
    extra_env: dict[str, str] = field(default_factory=dict)


class Backend(abc.ABC):
    """Runs experiments. Implementations must be safe to call from several threads at once."""

    @abc.abstractmethod
    def run(self, exp: Experiment, reservation: Reservation, exp_dir: Path) -> Experiment:
        """Run ``exp`` on ``reservation``, writing its files under ``exp_dir``.

        Returns the experiment with ``status``, ``metric``, ``metrics``, ``exit_code``, ``wall_s``
        and ``error`` filled in. Must leave no process of the experiment running.
        """

    def cancel_all(self) -> None:
        """Kill every running experiment (used on Ctrl-C); they are recorded as interrupted."""


# The allocators' own out-of-memory messages (torch CPU and CUDA allocators, glibc/dlopen under
# a memory limit, Python). Matching these, not the word "error", decides that a run was an OOM.
OOM_PATTERNS = re.compile(
    r"DefaultCPUAllocator: can't allocate memory|CUDA out of memory|torch\.(cuda\.)?OutOfMemoryError|"
    r"OutOfMemoryError|HIP out of memory|XPU out of memory|std::bad_alloc|\bMemoryError\b|"
    r"Cannot allocate memory|failed to map segment from shared object|out of memory")


def classify(exit_code: int | None, metrics: dict | None, metric_key: str, log_text: str,
             timed_out: bool) -> tuple[Status, str]:
    """Decide an experiment's outcome from facts, never from the word "error" in stderr.

    Order: a valid positive metric in ``metrics.json`` is OK (whatever stderr says); a timeout
    is TIMEOUT; an allocator OOM message is OOM; anything else is FAILED.

    Returns:
        (status, a one-line reason; empty for OK).
    """
    if metrics is not None:
        value = metrics.get(metric_key)
        if isinstance(value, (int, float)) and value > 0:
            return Status.OK, ""
    if timed_out:
        return Status.TIMEOUT, "killed after the timeout"
    m = OOM_PATTERNS.search(log_text)
    if m:
        line = next((ln for ln in log_text.splitlines() if m.group(0) in ln), m.group(0))
        return Status.OOM, line.strip()[-300:]
    if exit_code == 0:
        reason = f"exited 0 without writing metrics.json (does the script run more than end_profile_step steps?)"
        if metrics is not None:
            reason = f"metrics.json has no positive '{metric_key}'"
        return Status.FAILED, reason
    return Status.FAILED, f"exit code {exit_code}: {_last_error_line(log_text)}"


def _last_error_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if re.search(r"(Error|Exception|error:)", ln) and "launch.py" not in ln:
            return ln[-300:]
    return lines[-1][-300:] if lines else "no output"
