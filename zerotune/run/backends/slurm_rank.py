"""One rank of a Slurm job step: ``srun ... python -u -m zerotune.run.backends.slurm_rank SCRIPT ARGS...``.

srun starts every task of the step with Slurm's own variables (``SLURM_PROCID``, ``SLURM_LOCALID``,
``SLURM_NTASKS`` ...); this wrapper turns them into what DeepSpeed's per-node launcher gives each rank it starts
(``deepspeed/launcher/launch.py``) and what ``torch.distributed`` reads (:func:`rank_env`), applies the CPU
ranks' memory budget (:data:`DATA_LIMIT_ENV`, :func:`~zerotune.run.backends.base.limit_data`), and execs the
training script as that launcher does: ``python -u SCRIPT --local_rank=<LOCAL_RANK> ARGS...``.

``MASTER_ADDR`` and ``MASTER_PORT`` come from the step's environment (the backend sets them: the step's first
node and a port free there), as does the probe (``PYTHONPATH``, :mod:`zerotune.probe`).
"""
from __future__ import annotations

import os
import sys
from collections.abc import Mapping

from zerotune.run.backends.base import limit_data

__all__ = ["DATA_LIMIT_ENV", "expand_counts", "main", "rank_env"]

DATA_LIMIT_ENV = "ZEROTUNE_DATA_LIMIT"
"""Each rank's ``RLIMIT_DATA``, bytes, set by the wrapper before it execs the script (CPU ranks' budget)."""


def expand_counts(value: str) -> list[int]:
    """Slurm's compressed per-node counts as a list: ``"2(x3),1"`` -> ``[2, 2, 2, 1]``
    (``SLURM_STEP_TASKS_PER_NODE``, ``SLURM_JOB_CPUS_PER_NODE``).

    Raises:
        ValueError: ``value`` is not in that form.
    """
    counts: list[int] = []
    for part in value.split(","):
        count, _, repeat = part.partition("(x")
        counts += [int(count)] * (int(repeat.rstrip(")")) if repeat else 1)
    return counts


def rank_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables DeepSpeed's launcher sets for a rank, from the Slurm task's ``environ``:

    ``RANK`` (``SLURM_PROCID``), ``LOCAL_RANK`` (``SLURM_LOCALID``), ``WORLD_SIZE`` (``SLURM_NTASKS``),
    ``LOCAL_SIZE`` (this node's tasks: ``SLURM_STEP_TASKS_PER_NODE`` at ``SLURM_NODEID``), ``CROSS_RANK``
    (``SLURM_NODEID``) and ``CROSS_SIZE`` (``SLURM_STEP_NUM_NODES``).

    Raises:
        KeyError: a Slurm variable is missing (not a task started by srun).
    """
    node = int(environ["SLURM_NODEID"])
    tasks = expand_counts(environ.get("SLURM_STEP_TASKS_PER_NODE") or environ["SLURM_TASKS_PER_NODE"])
    nodes = environ.get("SLURM_STEP_NUM_NODES") or environ["SLURM_NNODES"]
    return {"RANK": str(int(environ["SLURM_PROCID"])), "LOCAL_RANK": str(int(environ["SLURM_LOCALID"])),
            "WORLD_SIZE": str(int(environ.get("SLURM_STEP_NUM_TASKS") or environ["SLURM_NTASKS"])),
            "LOCAL_SIZE": str(tasks[node]), "CROSS_RANK": str(node), "CROSS_SIZE": str(int(nodes))}


def main(argv: list[str]) -> None:
    """Exec ``argv`` (``SCRIPT ARGS...``) as this task's rank; never returns."""
    if not argv:
        sys.exit("usage: srun ... python -m zerotune.run.backends.slurm_rank SCRIPT [ARGS...]")
    try:
        env = {**os.environ, **rank_env(os.environ)}
    except (KeyError, ValueError, IndexError) as e:
        sys.exit(f"zerotune.run.backends.slurm_rank: not a task of a Slurm step ({type(e).__name__}: {e}); "
                 "it is started by srun")
    limit_data(int(os.environ.get(DATA_LIMIT_ENV) or 0))
    script, *args = argv
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, "-u", script, f"--local_rank={env['LOCAL_RANK']}", *args], env)


if __name__ == "__main__":
    main(sys.argv[1:])
