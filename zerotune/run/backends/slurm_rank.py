"""One rank of a Slurm job step: ``srun ... python -u -m zerotune.run.backends.slurm_rank SCRIPT ARGS...``.

The wrapper turns srun's task variables into what DeepSpeed's per-node launcher gives each rank (`rank_env`),
applies the CPU ranks' memory budget (`DATA_LIMIT_ENV`) and execs the script as that launcher does,
``python -u SCRIPT --local_rank=<LOCAL_RANK> ARGS...`` (or as torchrun does, `contract_env`). With ``--warm SOCKET``
the node's warm rank server forks the rank instead and the task stands for it in the step (`attach`); a task that
cannot get its rank started exits `zerotune.run.warm.rank.SETUP_FAILED`, and the backend runs the experiment cold.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import sys
from collections.abc import Mapping

from zerotune.launchers.contract import DEEPSPEED, TORCHRUN, rank_argv, torchrun_env
from zerotune.probe.sitecustomize import PROBE_DIR_ENV
from zerotune.run.backends.base import limit_data
from zerotune.run.warm.rank import SETUP_FAILED, SETUP_FAILED_LINE

__all__ = ["DATA_LIMIT_ENV", "attach", "contract_env", "expand_counts", "main", "rank_env"]

DATA_LIMIT_ENV = "ZEROTUNE_DATA_LIMIT"
"""Each rank's ``RLIMIT_DATA``, bytes, set by the wrapper before it execs the script (CPU ranks' budget)."""


def expand_counts(value: str) -> list[int]:
    """Slurm's compressed per-node counts (``SLURM_JOB_CPUS_PER_NODE``...) as a list: ``"2(x3),1"`` -> ``[2, 2, 2, 1]``.

    Raises:
        ValueError: ``value`` is not in that form.
    """
    counts: list[int] = []
    for part in value.split(","):
        count, _, repeat = part.partition("(x")
        counts += [int(count)] * (int(repeat.rstrip(")")) if repeat else 1)
    return counts


def rank_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables DeepSpeed's launcher sets for a rank (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_SIZE``,
    ``CROSS_RANK``, ``CROSS_SIZE``), from the Slurm task's ``environ``.

    Raises:
        KeyError: a Slurm variable is missing (not a task started by srun).
    """
    node = int(environ["SLURM_NODEID"])
    tasks = expand_counts(environ.get("SLURM_STEP_TASKS_PER_NODE") or environ["SLURM_TASKS_PER_NODE"])
    nodes = environ.get("SLURM_STEP_NUM_NODES") or environ["SLURM_NNODES"]
    return {"RANK": str(int(environ["SLURM_PROCID"])), "LOCAL_RANK": str(int(environ["SLURM_LOCALID"])),
            "WORLD_SIZE": str(int(environ.get("SLURM_STEP_NUM_TASKS") or environ["SLURM_NTASKS"])),
            "LOCAL_SIZE": str(tasks[node]), "CROSS_RANK": str(node), "CROSS_SIZE": str(int(nodes))}


def attach(socket_template: str, script: str, args: list[str], env: dict[str, str], contract: str = DEEPSPEED) -> int:
    """Have this node's warm server (``socket_template``, ``{node}`` for the node's name) fork this task's rank with
    ``env`` and this task's streams and CPU affinity, and wait for it; returns the status to exit with (negative: the
    killing signal). A stop signal is passed to the rank's launcher; a task killed outright closes its connection,
    on which the server kills the rank. A task that cannot get its rank started returns `SETUP_FAILED`, having said
    why on stderr."""
    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    request = {"op": "launch", "script": script, "args": args, "rank_env": env, "cwd": os.getcwd(),
               "affinity": sorted(os.sched_getaffinity(0)), "data_limit": int(env.get(DATA_LIMIT_ENV) or 0) or None,
               "probe_dir": env.get(PROBE_DIR_ENV), "contract": contract}
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    answer: dict = {}
    try:
        conn.connect(socket_template.replace("{node}", node))
        socket.send_fds(conn, [(json.dumps(request) + "\n").encode()], [0, 1, 2])
        reader = conn.makefile("rb")
        answer = json.loads(reader.readline() or b"{}")
        pid = int(answer["pid"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        why = answer.get("error") if isinstance(answer, dict) else None
        print(f"{SETUP_FAILED_LINE}: the warm server on {node} did not launch the rank: "
              f"{why or f'{type(e).__name__}: {e}'}", file=sys.stderr, flush=True)
        return SETUP_FAILED

    def forward(signum, frame):  # the launcher stops its rank as DeepSpeed's launcher does, then exits
        try:
            os.killpg(pid, signal.SIGTERM)
        except OSError:
            pass

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)
    try:
        status = int(json.loads(reader.readline() or b"{}")["exit"])
    except (OSError, ValueError, KeyError, TypeError):
        print(f"{SETUP_FAILED_LINE}: the warm server on {node} went away during the run", file=sys.stderr,
              flush=True)
        status = SETUP_FAILED
    try:
        os.killpg(pid, signal.SIGKILL)  # what the rank left in its launcher's session
    except OSError:
        pass
    return status


def main(argv: list[str]) -> None:
    """Exec ``argv`` (``[--warm SOCKET] [--contract NAME] SCRIPT ARGS...``, in that order) as this task's rank;
    never returns. ``--warm``: exit with the status of the rank the warm server forks (`attach`)."""
    warm, contract = None, DEEPSPEED
    if argv[:1] == ["--warm"] and len(argv) > 1:
        warm, argv = argv[1], argv[2:]
    if argv[:1] == ["--contract"] and len(argv) > 1:
        contract, argv = argv[1], argv[2:]
    if not argv:
        sys.exit("usage: srun ... python -m zerotune.run.backends.slurm_rank [--warm SOCKET] [--contract NAME] "
                 "SCRIPT [ARGS...]")
    try:
        env = contract_env({**os.environ, **rank_env(os.environ)}, contract)
    except (KeyError, ValueError, IndexError) as e:
        sys.exit(f"zerotune.run.backends.slurm_rank: not a task of a Slurm step ({type(e).__name__}: {e}); "
                 "it is started by srun")
    script, *args = argv
    if warm is not None:
        status = attach(warm, script, args, env, contract)
        if status < 0:
            signal.signal(-status, signal.SIG_DFL)
            os.kill(os.getpid(), -status)
        sys.exit(status & 0xFF)
    limit_data(int(os.environ.get(DATA_LIMIT_ENV) or 0))
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, "-u", script, *rank_argv(contract, env["LOCAL_RANK"]), *args], env)


def contract_env(env: dict[str, str], contract: str) -> dict[str, str]:
    """``env`` (with `rank_env`'s variables) plus those of ``contract``'s launcher (torchrun's for `TORCHRUN`)."""

    if contract != TORCHRUN:
        return env
    return torchrun_env(env, int(env["RANK"]), int(env["LOCAL_RANK"]), int(env["WORLD_SIZE"]), int(env["LOCAL_SIZE"]),
                        int(env["CROSS_RANK"]), int(env["CROSS_SIZE"]))


if __name__ == "__main__":
    main(sys.argv[1:])
