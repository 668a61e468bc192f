"""The processes of a run: finding them, measuring them, killing every one of them, and cleaning up
after a tuner that died while they ran.

Every process of one run carries a token in its environment (:data:`RUN_TOKEN_ENV`, inherited by
the launcher's ranks and anything they start), so a process that left the process group and its
parent (``setsid`` and a double fork) is still found and killed when the run ends
(:func:`kill_tree`). While a run is alive, ``<exps_dir>/.zerotune-running/<name>.json``
(:func:`write_running_record`) names its token and the tuner's pid: if the tuner itself is killed
(SIGKILL, OOM killer), its experiments outlive it; the next run on the same exps dir kills the
processes of every record whose tuner is gone before it launches (:func:`reap_orphans`), and
removes their shared-memory buffers (:func:`remove_shm_buffers`).

Processes are always found by that token or by descent from a process this tuner started, never
by name: nothing else on the machine is touched.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import uuid
from pathlib import Path

import psutil

from zerotune.core.experiment import write_json_atomic
from zerotune.run.expdir import read_json

__all__ = [
    "RUNNING_DIR", "RUN_TOKEN_ENV", "SHM_DIR", "data_bytes", "descendants", "kill_token", "kill_tree",
    "new_run_token", "reap_orphans", "remove_shm_buffers", "runs_script", "write_running_record",
]

RUN_TOKEN_ENV = "ZEROTUNE_RUN_TOKEN"
RUNNING_DIR = ".zerotune-running"  # under the exps dir: one record per experiment being run
SHM_DIR = Path("/dev/shm")


def new_run_token() -> str:
    """A token naming one run, unique across tuners and machines (this tuner's pid and a UUID)."""
    return f"{os.getpid()}-{uuid.uuid4().hex}"


def descendants(pid: int) -> list[psutil.Process]:
    """All live descendants of ``pid`` (none if it is gone)."""
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def runs_script(proc: psutil.Process, script_name: str) -> bool:
    """True when ``proc`` is a rank: it runs the training script itself
    (``python -u train.py --local_rank=0 ...``), not the launcher nor a JIT compiler."""
    try:
        return any(Path(arg).name == script_name for arg in proc.cmdline()[1:4])
    except psutil.Error:
        return False


def data_bytes(pid: int) -> int:
    """A process's private data size (``VmData``, what ``RLIMIT_DATA`` limits), bytes; 0 if unknown."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmData:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def kill_tree(proc: subprocess.Popen, known: dict[int, psutil.Process], token: str) -> None:
    """Stop a run: the launcher's process group (TERM, then KILL after 10 s), any descendant seen
    on the way (``known``, pid -> process, added to here), and any other process carrying the run's
    ``token`` (one that left the group and its parent). Returns once they have exited (:func:`_exited`:
    gone, or zombies that no longer hold anything)."""
    for child in descendants(proc.pid):
        known.setdefault(child.pid, child)
    if proc.poll() is None:
        _signal_group(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
    _signal_group(proc.pid, signal.SIGKILL)
    if proc.poll() is None:
        proc.wait()
    for p in known.values():
        try:
            if p.is_running():
                p.kill()
        except psutil.Error:
            pass
    _wait_exited(list(known.values()), timeout_s=5)
    kill_token(token)


def _exited(proc: psutil.Process) -> bool:
    """True once ``proc`` has exited: gone, or a zombie. An orphaned rank or launcher (its parent
    killed first) stays a zombie until init reaps it, which some inits (a container's or a microVM's)
    do only about once a second; a zombie holds no memory, file or port any more."""
    try:
        return not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return True


def _wait_exited(procs: list[psutil.Process], timeout_s: float) -> None:
    """Wait until every one of ``procs`` has exited (:func:`_exited`), at most ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    delay = 0.001
    while not all(_exited(p) for p in procs) and time.monotonic() < deadline:
        time.sleep(delay)
        delay = min(delay * 2, 0.05)


def kill_token(token: str) -> int:
    """SIGKILL every process of this user carrying ``token`` and wait for them; the number killed."""
    procs = _with_token(token)
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass
    _wait_exited(procs, timeout_s=5)
    return len(procs)


def write_running_record(running_dir: Path, name: str, token: str, master_port: int) -> Path:
    """Record that this tuner process runs experiment ``name`` with ``token`` on ``master_port``
    (see the module doc); the caller removes the returned file when the run's processes are gone."""
    running_dir.mkdir(parents=True, exist_ok=True)
    path = running_dir / f"{name}.json"
    write_json_atomic(path, {"name": name, "token": token, "master_port": master_port, "host": socket.gethostname(),
                             "tuner_pid": os.getpid(), "tuner_create_time": psutil.Process().create_time()})
    return path


def reap_orphans(running_dir: Path) -> list[str]:
    """Kill the processes of experiments whose tuner died while they ran (their records are left in
    ``running_dir``); records of a live tuner, or written on another host (a shared filesystem),
    are left alone. Returns the names reaped.

    Processes are found by the token in their environment, never by name, so nothing else is
    touched.
    """
    reaped = []
    try:
        records = sorted(Path(running_dir).glob("*.json"))
    except OSError:
        return reaped
    for path in records:
        data = read_json(path)
        if (data is None or data.get("host") != socket.gethostname()
                or _alive(data.get("tuner_pid"), data.get("tuner_create_time"))):
            continue
        if data.get("token"):
            kill_token(str(data["token"]))
        if isinstance(data.get("master_port"), int):
            remove_shm_buffers(data["master_port"])
        path.unlink(missing_ok=True)
        reaped.append(str(data.get("name", path.stem)))
    return reaped


def remove_shm_buffers(master_port: int) -> list[Path]:
    """Remove the shared-memory files DeepSpeed's CPU communication left for a run on ``master_port``.

    On CPU each rank creates ``/dev/shm/deepspeed_allreduce_buffer_<uid>_<master addr>_<port>_<rank>``
    (``deepspeed/ops/csrc/cpu/comm/shm.cpp``, 69 MB each in DeepSpeed 0.19) and never unlinks it, so
    without this every experiment would leak about 140 MB of RAM-backed files. Called after the
    run's processes are gone; only this run's port is matched. Returns the files removed.
    """
    removed = []
    for path in SHM_DIR.glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*_{master_port}_*"):
        try:
            path.unlink()
            removed.append(path)
        except OSError:
            pass
    return removed


def _with_token(token: str) -> list[psutil.Process]:
    """Live processes of this user whose environment carries ``token`` (zombies excluded)."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.environ().get(RUN_TOKEN_ENV) == token and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except psutil.Error:  # gone, a zombie, or another user's
            pass
    return found


def _alive(pid, create_time) -> bool:
    """True when the process ``pid`` that started at ``create_time`` still runs (not a reused pid)."""
    try:
        p = psutil.Process(int(pid))
        return abs(p.create_time() - float(create_time)) < 0.01 and p.status() != psutil.STATUS_ZOMBIE
    except (psutil.Error, TypeError, ValueError):
        return False


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass
