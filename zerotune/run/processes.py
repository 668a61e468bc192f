"""The processes of a run: finding, measuring and killing them, and cleaning up after a tuner that died.

Rules: a run's processes are found (`kill_tree`, `kill_token`) by any of three marks: descent from the launcher (made
a child subreaper, `adopt_orphans`), the launcher's session and process group, and the run's token in their
environment (`RUN_TOKEN_ENV`); never by name, so nothing else on the machine is touched. While a run is alive its
record (`write_running_record`) names its token and the tuner; the next run on the same exps dir kills the runs of a
dead tuner and removes their shared-memory buffers (`reap_orphans`). Ranks on other nodes are stopped by the same
token (`kill_token_on`), never by DeepSpeed's runner's own stop, which kills every DeepSpeed launcher on the host.
"""
from __future__ import annotations

import ctypes
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from zerotune.run.backends.stop_handles import cancel_handle, record_handle
from zerotune.run.store import read_json, write_json_atomic

__all__ = [
    "RUNNING_DIR", "RUN_TOKEN_ENV", "SHM_DIR", "RunningRecord", "adopt_orphans", "data_bytes", "descendants", "kill_token",
    "kill_token_on", "kill_tree", "new_run_token", "reap_orphans", "remove_shm_buffers", "run_processes", "runs_script",
    "write_running_record",
]

RUN_TOKEN_ENV = "ZEROTUNE_RUN_TOKEN"
RUNNING_DIR = ".zerotune-running"  # under the exps dir: one record per experiment being run
SHM_DIR = Path("/dev/shm")
_PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None  # loaded before any fork


def new_run_token() -> str:
    """A token naming one run, unique across tuners and machines (this tuner's pid and a UUID)."""
    return f"{os.getpid()}-{uuid.uuid4().hex}"


def descendants(pid: int) -> list[psutil.Process]:
    """All live descendants of ``pid`` (none if it is gone)."""
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def adopt_orphans() -> None:
    """Make this process a child subreaper (Linux ``prctl(PR_SET_CHILD_SUBREAPER)``; elsewhere nothing), so an
    orphaned descendant stays in its tree. Called in the launcher between fork and exec (it survives ``execve``)."""
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def runs_script(proc: psutil.Process, script_name: str) -> bool:
    """True when ``proc`` is a rank: it runs the training script itself, not the launcher nor a JIT compiler."""
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


def kill_tree(proc: subprocess.Popen, known: dict[int, psutil.Process], token: str,
              since: float | None = None) -> None:
    """Stop a run: the launcher's process group (TERM, then KILL after 10 s), any descendant seen on the way
    (``known``, pid -> process, added to here), and any other process of the run (`kill_token`; ``since``: the
    launch's ``time.time()``). Returns once they have exited (gone, or zombies that hold nothing)."""
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
    kill_token(token, proc.pid, since)


def _exited(proc: psutil.Process) -> bool:
    """True once ``proc`` is gone or a zombie (some inits reap orphans only about once a second; a zombie holds no
    memory, file or port)."""
    try:
        return not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return True


def _wait_exited(procs: list[psutil.Process], timeout_s: float) -> None:
    """Wait until every one of ``procs`` has exited, at most ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    delay = 0.001
    while not all(_exited(p) for p in procs) and time.monotonic() < deadline:
        time.sleep(delay)
        delay = min(delay * 2, 0.05)


def kill_token(token: str, leader: int | None = None, since: float | None = None) -> int:
    """SIGKILL every process of a run and wait for them; returns the number killed. A process of the run carries
    ``token``, or is in the session or process group ``leader`` (the launcher's pid) and started at ``since`` (the
    launch's ``time.time()``) or later, so a recycled id matches nothing, or descends from one of those."""
    procs = _of_run(token, leader, since)
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass
    _wait_exited(procs, timeout_s=5)
    return len(procs)


def kill_token_on(hosts: list[str], token: str, timeout_s: float = 60.0) -> bool:
    """SIGKILL the processes carrying ``token`` on each of ``hosts`` (`kill_token` there, by pdsh over ssh); zerotune
    must be importable at this path on every host. Returns whether pdsh exited 0 within ``timeout_s`` seconds; a
    failure is not raised (the local kill goes on)."""
    root = str(Path(__file__).resolve().parents[2])  # the directory holding the zerotune package
    remote = (f"PYTHONPATH={shlex.quote(root)} {shlex.quote(sys.executable)} -m zerotune.run.processes "
              f"--kill-token {shlex.quote(token)}")
    try:
        run = subprocess.run(["pdsh", "-S", "-w", ",".join(hosts), remote], capture_output=True, timeout=timeout_s,
                             env={**os.environ, "PDSH_RCMD_TYPE": "ssh"}, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return run.returncode == 0


def run_processes(token: str) -> list[psutil.Process]:
    """This user's live processes here whose environment carries ``token``, and their descendants: a run's
    processes that are not the launcher's (ranks a cluster's node daemon started)."""
    return _of_run(token, None, None)


@dataclass(frozen=True)
class RunningRecord:
    """A running record, ``<exps_dir>/.zerotune-running/<name>.json``: a run this tuner process holds.

    Attributes:
        host: the machine the tuner runs on. tuner_pid, tuner_create_time: the tuner process (``psutil``'s
            create time, s since the epoch), so that a reused pid is not taken for it.
        leader: the pid leading the launcher's session, once started. since: the launch's ``time.time()``.
        stop: the run's stop handle where it holds more than processes here (`zerotune.run.backends.stop_handles`).
    """

    name: str
    token: str | None = None
    master_port: int | None = None
    host: str | None = None
    tuner_pid: int | None = None
    tuner_create_time: float | None = None
    leader: int | None = None
    since: float | None = None
    stop: Mapping[str, Any] | None = None

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], name: str) -> "RunningRecord":
        """The record from its decoded JSON object (``name``: the file's stem, where it names none). A field of
        another type than zerotune writes is None, so a damaged or foreign file stops nothing it cannot name."""
        def typed(key: str, kind: type | tuple[type, ...]) -> Any:
            value = data.get(key)
            return value if isinstance(value, kind) and not isinstance(value, bool) else None

        return cls(typed("name", str) or name, typed("token", str) or None, typed("master_port", int),
                   typed("host", str), typed("tuner_pid", int), typed("tuner_create_time", (int, float)),
                   typed("leader", int), typed("since", (int, float)), record_handle(data))

    def to_dict(self) -> dict[str, Any]:
        """The JSON object `from_dict` reads back (``stop`` only where the run has a handle)."""
        record = {"name": self.name, "token": self.token, "master_port": self.master_port, "host": self.host,
                  "tuner_pid": self.tuner_pid, "tuner_create_time": self.tuner_create_time, "leader": self.leader,
                  "since": self.since}
        if self.stop is not None:
            record["stop"] = dict(self.stop)
        return record


def write_running_record(running_dir: Path, name: str, token: str, master_port: int | None, leader: int | None = None,
                         since: float | None = None, stop: Mapping[str, Any] | None = None) -> Path:
    """Write the `RunningRecord` of this tuner's run ``name``; the caller removes the returned file when the run's
    processes are gone."""
    running_dir.mkdir(parents=True, exist_ok=True)
    path = running_dir / f"{name}.json"
    record = RunningRecord(name, token, master_port, socket.gethostname(), os.getpid(), psutil.Process().create_time(),
                           leader, since, stop)
    write_json_atomic(path, record.to_dict())
    return path


def reap_orphans(running_dir: Path) -> list[str]:
    """Kill the processes of experiments whose tuner died while they ran (their records are left in
    ``running_dir``) and remove their shared-memory buffers; returns the names reaped. Records of a live tuner, or
    written on another host, are left alone. A record's stop handle is cancelled first (what it names has no
    process here)."""
    reaped = []
    try:
        paths = sorted(Path(running_dir).glob("*.json"))
    except OSError:
        return reaped
    for path in paths:
        data = read_json(path)
        if data is None:
            continue
        record = RunningRecord.from_dict(data, path.stem)
        if record.host != socket.gethostname() or _alive(record.tuner_pid, record.tuner_create_time):
            continue
        cancel_handle(record.stop)
        if record.token:
            kill_token(record.token, record.leader, record.since)
        if record.master_port is not None:
            remove_shm_buffers(record.master_port)
        path.unlink(missing_ok=True)
        reaped.append(record.name)
    return reaped


def remove_shm_buffers(master_port: int) -> list[Path]:
    """Remove the shared-memory files DeepSpeed's CPU communication left for a run on ``master_port``, once its
    processes are gone; returns the files removed. Each CPU rank creates
    ``/dev/shm/deepspeed_allreduce_buffer_<uid>_<master addr>_<port>_<rank>`` (``deepspeed/ops/csrc/cpu/comm/shm.cpp``)
    and never unlinks it, so every experiment would leak RAM-backed files."""
    removed = []
    for path in SHM_DIR.glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*_{master_port}_*"):
        try:
            path.unlink()
            removed.append(path)
        except OSError:
            pass
    return removed


def _of_run(token: str, leader: int | None, since: float | None) -> list[psutil.Process]:
    """This user's live non-zombie processes of a run (`kill_token`'s marks) and their descendants."""

    found: dict[int, psutil.Process] = {}
    uid = os.getuid()
    for p in psutil.process_iter():
        try:
            if p.status() == psutil.STATUS_ZOMBIE or p.uids().real != uid:
                continue
            if p.environ().get(RUN_TOKEN_ENV) == token or (
                    leader is not None and since is not None and p.create_time() >= since - 1  # clock ticks
                    and leader in (os.getsid(p.pid), os.getpgid(p.pid))):
                found[p.pid] = p
        except (psutil.Error, OSError):  # gone, a zombie, or another user's
            pass
    for p in list(found.values()):
        for child in descendants(p.pid):
            found.setdefault(child.pid, child)
    return list(found.values())


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


if __name__ == "__main__":  # python -m zerotune.run.processes --kill-token TOKEN: what kill_token_on runs on a node
    if len(sys.argv) != 3 or sys.argv[1] != "--kill-token":
        sys.exit("usage: python -m zerotune.run.processes --kill-token TOKEN")
    print(f"{socket.gethostname()}: {kill_token(sys.argv[2])} process(es) of the run killed")
