"""The local backend: the real ``deepspeed`` launcher as a subprocess, one process group per run.

Each experiment gets its own directory with the config it ran (``ds_config.json``, DeepSpeed's
``metric_path``/``model_info_path`` pointed into it), a command a person can paste
(``cmd.txt``), ``stdout.log``, ``stderr.log`` and ``metrics.json``. The launcher is started in a
new session so the whole tree (launcher and ranks) is killed as one process group on timeout,
hang or Ctrl-C, and any straggler is killed after it exits. Multi-node reservations go through
the launcher's own hostfile mechanism (``--hostfile``, ``--force_multi``), never a blanket pkill.

Every process of one run carries a token in its environment (``ZEROTUNE_RUN_TOKEN``, inherited
by the launcher's ranks and anything they start), so a process that left the process group and
its parent (``setsid`` and a double fork) is still found and killed when the run ends. While a
run is alive, ``<exps_dir>/.zerotune-running/<name>.json`` names its token and the tuner's pid:
if the tuner itself is killed (SIGKILL, OOM killer), its experiments outlive it; the next run on
the same exps dir kills the processes of every record whose tuner is gone before it launches,
and removes their shared-memory buffers (``remove_shm_buffers``).
"""
from __future__ import annotations

import json
import os
import resource
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import psutil

from zerotune.run.backends.base import Backend, LaunchSpec, classify
from zerotune.deepspeed.config import replace_config_arg
from zerotune.core.experiment import Experiment, ExperimentKind, Status, write_json_atomic
from zerotune.run.resources import Reservation

RUN_TOKEN_ENV = "ZEROTUNE_RUN_TOKEN"
RUNNING_DIR = ".zerotune-running"  # under the exps dir: one record per experiment being run

_port_lock = threading.Lock()
_ports_in_use: set[int] = set()


def free_port() -> int:
    """A TCP port free on this machine and not handed to another running experiment."""
    with _port_lock:
        for _ in range(100):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            if port not in _ports_in_use:
                _ports_in_use.add(port)
                return port
    raise RuntimeError("no free TCP port for the launcher's master_port")


def _release_port(port: int) -> None:
    with _port_lock:
        _ports_in_use.discard(port)


def deepspeed_launcher() -> list[str]:
    """The ``deepspeed`` launcher of this Python environment."""
    exe = Path(sys.executable).with_name("deepspeed")
    if exe.exists():
        return [str(exe)]
    found = shutil.which("deepspeed")
    return [found] if found else [sys.executable, "-m", "deepspeed.launcher.runner"]


def launch_env(spec: LaunchSpec, reservation: Reservation) -> dict[str, str]:
    """Environment variables the launch needs beyond the caller's (shown in ``cmd.txt``)."""
    env = dict(spec.extra_env)
    if spec.cpu:
        env["DS_ACCELERATOR"] = "cpu"
        # The launcher counts CPU "devices" from LOCAL_SIZE; it must cover the highest slot id.
        env["LOCAL_SIZE"] = str(max(max(n.slots) for n in reservation.nodes) + 1)
    return env


def launch_command(spec: LaunchSpec, reservation: Reservation, config_path: str, master_port: int) -> list[str]:
    """The ``deepspeed`` launcher command for a config on a reservation."""
    cmd = deepspeed_launcher()
    multi = spec.hostfile and any(n.host != "localhost" for n in reservation.nodes)
    if multi:
        cmd += ["--hostfile", spec.hostfile, "--force_multi"]
    cmd += ["--include", reservation.include_arg(), "--master_port", str(master_port), spec.script]
    return cmd + replace_config_arg(list(spec.script_args), config_path)


def paste_command(env: dict[str, str], cmd: list[str]) -> str:
    """A shell line a person can paste."""
    prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(env.items()))
    return (prefix + " " if prefix else "") + shlex.join(cmd)


def _vm_data_bytes(pid: int) -> int:
    """A process's private data size (``VmData``, what ``RLIMIT_DATA`` limits), bytes."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmData:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


class LocalBackend(Backend):
    """Runs each experiment through the ``deepspeed`` launcher as a subprocess of this machine."""

    poll_s = 0.2

    def __init__(self, spec: LaunchSpec):
        self.spec = spec
        self._running: dict[int, subprocess.Popen] = {}
        self._lock = threading.Lock()
        self._cancelled = threading.Event()

    def run(self, exp: Experiment, reservation: Reservation, exp_dir: Path) -> Experiment:
        spec = self.spec
        exp_dir = Path(exp_dir)
        exp_dir.mkdir(parents=True, exist_ok=True)
        metrics_path = exp_dir / "metrics.json"
        model_info_path = exp_dir / "model_info.json"
        running_dir = exp_dir.parent / RUNNING_DIR
        reap_orphans(running_dir)  # first: an orphan of a killed tuner could still write into exp_dir
        for stale in (metrics_path, model_info_path):
            stale.unlink(missing_ok=True)
        config = json.loads(json.dumps(exp.ds_config))
        at = config.setdefault("autotuning", {})
        at.update(enabled=True, metric_path=str(metrics_path.resolve()),
                  model_info_path=str(model_info_path.resolve()), start_profile_step=spec.start_profile_step,
                  end_profile_step=spec.end_profile_step, metric=spec.objective.name)
        config_path = exp_dir / "ds_config.json"
        write_json_atomic(config_path, config)

        port = free_port()
        env = launch_env(spec, reservation)
        cmd = launch_command(spec, reservation, str(config_path.resolve()), port)
        (exp_dir / "cmd.txt").write_text(paste_command(env, cmd) + "\n")

        limit = spec.device_memory_bytes if spec.cpu else None

        def limit_memory():  # runs in the child before exec; inherited by the launcher's ranks
            if limit:
                resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))

        script_name = Path(spec.script).name
        token = f"{os.getpid()}-{uuid.uuid4().hex}"
        record = _write_running_record(running_dir, exp.name, token, port)
        start = time.monotonic()
        timed_out = hung = False
        peak = 0
        with open(exp_dir / "stdout.log", "wb") as out, open(exp_dir / "stderr.log", "wb") as err:
            try:
                proc = subprocess.Popen(cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                        env={**os.environ, **env, RUN_TOKEN_ENV: token}, start_new_session=True,
                                        preexec_fn=limit_memory)
            except BaseException:
                record.unlink(missing_ok=True)
                _release_port(port)
                raise
            with self._lock:
                self._running[proc.pid] = proc
            known: dict[int, psutil.Process] = {}
            last_size, last_change = -1, start
            try:
                while proc.poll() is None:
                    now = time.monotonic()
                    for child in _descendants(proc.pid):
                        known.setdefault(child.pid, child)
                        if _is_rank(child, script_name):  # not the launcher, nor a JIT compiler
                            peak = max(peak, _vm_data_bytes(child.pid))
                    size = _size(exp_dir / "stdout.log") + _size(exp_dir / "stderr.log")
                    if size != last_size:
                        last_size, last_change = size, now
                    if spec.timeout_s is not None and now - start > spec.timeout_s:
                        timed_out = True
                    elif spec.hang_timeout_s is not None and now - last_change > spec.hang_timeout_s:
                        timed_out = hung = True
                    if timed_out or self._cancelled.is_set():
                        break
                    try:  # returns as soon as the launcher exits (a plain sleep adds poll_s / 2 on average)
                        proc.wait(timeout=self.poll_s)
                    except subprocess.TimeoutExpired:
                        pass
            finally:
                _kill_tree(proc, known, token)
                remove_shm_buffers(port)
                record.unlink(missing_ok=True)
                with self._lock:
                    self._running.pop(proc.pid, None)
                _release_port(port)
        exp.wall_s = round(time.monotonic() - start, 3)
        exp.exit_code = proc.returncode
        exp.peak_memory_bytes = peak or None

        # The profile run's result is model_info.json (the engine exits in the first forward).
        profile = exp.kind is ExperimentKind.PROFILE
        metrics = _read_json(model_info_path if profile else metrics_path)
        metric_key = "num_params" if profile else spec.objective.metric_key
        log_text = _tail(exp_dir / "stderr.log") + "\n" + _tail(exp_dir / "stdout.log")
        if self._cancelled.is_set() and metrics is None:
            exp.status, exp.error = Status.INTERRUPTED, "the tuner was interrupted"
        else:
            exp.status, exp.error = classify(proc.returncode, metrics, metric_key, log_text, timed_out)
            if hung:
                exp.error = f"no output for {spec.hang_timeout_s:g} s: killed as hung"
            elif timed_out:
                exp.error = f"killed after the {spec.timeout_s:g} s timeout"
        exp.metrics = metrics or {}
        exp.metric = spec.objective.read(exp.metrics) if exp.status == Status.OK and not profile else None
        return exp

    def cancel_all(self) -> None:
        self._cancelled.set()


def _is_rank(proc: psutil.Process, script_name: str) -> bool:
    """A rank process runs the training script itself (``python -u train.py --local_rank=0 ...``)."""
    try:
        return any(Path(arg).name == script_name for arg in proc.cmdline()[1:4])
    except psutil.Error:
        return False


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def _kill_tree(proc: subprocess.Popen, known: dict[int, psutil.Process], token: str) -> None:
    """Stop the launcher's process group (TERM, then KILL), any descendant seen on the way, and any
    other process carrying the run's token (one that left the group and its parent)."""
    for child in _descendants(proc.pid):
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
                p.wait(timeout=5)
        except psutil.Error:
            pass
    _kill_token(token)


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


def _kill_token(token: str) -> int:
    """SIGKILL every process carrying ``token`` and wait for them; the number killed."""
    procs = _with_token(token)
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=5)
    return len(procs)


def _write_running_record(running_dir: Path, name: str, token: str, master_port: int) -> Path:
    """Record that this tuner process runs experiment ``name`` with ``token`` (see the module doc)."""
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
        data = _read_json(path)
        if (data is None or data.get("host") != socket.gethostname()
                or _alive(data.get("tuner_pid"), data.get("tuner_create_time"))):
            continue
        if data.get("token"):
            _kill_token(str(data["token"]))
        if isinstance(data.get("master_port"), int):
            remove_shm_buffers(data["master_port"])
        path.unlink(missing_ok=True)
        reaped.append(str(data.get("name", path.stem)))
    return reaped


def _alive(pid, create_time) -> bool:
    """True when the process ``pid`` that started at ``create_time`` still runs (not a reused pid)."""
    try:
        p = psutil.Process(int(pid))
        return abs(p.create_time() - float(create_time)) < 0.01 and p.status() != psutil.STATUS_ZOMBIE
    except (psutil.Error, TypeError, ValueError):
        return False


SHM_DIR = Path("/dev/shm")


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


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _tail(path: Path, limit: int = 200_000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, _size(path) - limit))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


def _read_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
