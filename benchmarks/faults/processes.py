"""What a run leaves behind: its processes (by run token, by the stand-ins' paths, by a path on their command
line) and DeepSpeed's ``/dev/shm`` files."""
from __future__ import annotations

import os
from pathlib import Path

import psutil

from zerotune.run.processes import RUN_TOKEN_ENV


def processes_of_tuner(pid: int) -> list[psutil.Process]:
    """Live processes whose run token says tuner ``pid`` started them (token = '<pid>-<uuid>')."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.environ().get(RUN_TOKEN_ENV, "").startswith(f"{pid}-") and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except psutil.Error:
            pass
    return found


def stand_in_processes(work: Path) -> list[psutil.Process]:
    """Live stand-in launchers and ranks of this test (by their script paths in ``work``)."""
    found = []
    for p in psutil.process_iter():
        try:
            if any(str(work) in a and a.endswith(("rank.py", "launcher.py")) for a in p.cmdline()) \
                    and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except psutil.Error:
            pass
    return found


def shm_files() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*")}


def shm_left(work: Path, before: set[str], now: set[str] | None = None) -> set[str]:
    """This test's shared-memory files still there (in ``now``, a listing of :func:`shm_files`; None: list
    them now): those of the master ports its runs used (other tests on the machine may have their own)."""
    ports = {cmd.read_text().split("--master_port ")[1].split()[0] for cmd in work.glob("*/exps/*/cmd.txt")}
    return {name for name in (shm_files() if now is None else now) - before if name.rsplit("_", 2)[1] in ports}


def processes_running(path: str) -> list[psutil.Process]:
    """Processes (launchers, ranks) whose command line names ``path``: a test's own directory (its
    experiments' configs live there; other people's runs of the example script do not count)."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if any(path in arg for arg in p.info["cmdline"] or ()):
                found.append(p)
        except psutil.Error:
            pass
    return found


def on_free_port(command: str) -> tuple[str, int]:
    """``command`` (a ``cmd_optimal.txt`` line) made to rendezvous on a free port, so that tests running at once do
    not meet at a launcher's default 29500: the ``deepspeed`` runner's ``--master_port``, torchrun's, or Accelerate's
    ``--main_process_port``, as a user who trains two jobs on one machine sets it. Returns the line and the port."""
    from zerotune.deepspeed.launcher import free_port
    port = free_port()
    for old, new in (("--master_port 29500", f"--master_port {port}"),
                     ("accelerate launch ", f"accelerate launch --main_process_port {port} "),
                     ("torchrun ", f"torchrun --master_port {port} ")):
        if old in command:
            return command.replace(old, new, 1), port
    raise AssertionError(f"no launcher whose port the test can set in: {command}")
